"""``python -m ingest.verl.main_ppo [verl's Hydra overrides]``: verl's own PPO entry point on this pipeline's data.

The same command line as ``python -m verl.trainer.main_ppo`` (verl 0.5, 0.6, 0.7 or 0.9, whichever is installed): verl's
Hydra config, its checks and its task runner run as they are. Only two things differ, both inside the task runner's
process, before its ``run``: ``data.custom_cls`` selects ``IngestDataset`` (verl's dataset is never built: no load, no
filter pass), and the trainer class ``run`` builds is ``ingest_trainer``'s subclass of it (``RayPPOTrainer``, or the
v1 trainer registered for ``trainer.v1.trainer_mode``), so the dataloaders are ``VerlDataLoader``\\ s. With
``data.media_handoff`` a third: the rollout's agent-loop manager is ``ingest.verl.agent_loop``'s.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

from ingest.verl.dataset import CUSTOM_CLS, select_ingest_dataset
from ingest.verl.trainer import ingest_trainer, is_ingest_trainer


def _use_ingest_trainer(config: Any, run_function: Any) -> str:
    """Point what ``run`` builds at ``ingest_trainer``'s class: the v1 trainer registry entry of the configured mode
    (verl 0.9), else the ``RayPPOTrainer`` name ``run`` reads from its globals (0.5 to 0.7, 0.9's legacy runner)."""
    trainer = config.get("trainer", {})
    if trainer.get("use_v1"):
        from verl.trainer.ppo.v1 import trainer_base

        mode = trainer.v1.trainer_mode
        registered = trainer_base.TRAINER_REGISTRY[mode]
        if not is_ingest_trainer(registered):
            trainer_base.TRAINER_REGISTRY[mode] = ingest_trainer(registered)
        return trainer_base.TRAINER_REGISTRY[mode].__name__
    names = run_function.__globals__
    if not is_ingest_trainer(names["RayPPOTrainer"]):
        names["RayPPOTrainer"] = ingest_trainer(names["RayPPOTrainer"])
    return names["RayPPOTrainer"].__name__


# the module of verl's v1 agent-loop classes, which the v1 hand-off manager subclasses; it imports TransferQueue
V1_AGENT_LOOP_MODULE = "verl.trainer.ppo.v1.agent_loop_tq"
HANDOFF_MANAGERS = {  # trainer.use_v1 -> the agent-loop manager that takes handed-off media (ingest.verl.agent_loop)
    False: "ingest.verl.agent_loop.IngestAgentLoopManager",
    True: "ingest.verl.agent_loop.IngestAgentLoopManagerTQ",
}


def use_handoff_manager(config: Any) -> str | None:
    """With ``data.media_handoff``, point ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` at the manager
    whose workers take the handed-off media (changed in place); another manager there is an error. None when off."""
    from omegaconf import open_dict

    if not config.data.get("media_handoff"):
        return None
    use_v1 = bool(config.get("trainer", {}).get("use_v1"))
    if use_v1:
        check_v1_agent_loop()
    manager = HANDOFF_MANAGERS[use_v1]
    agent = config.actor_rollout_ref.rollout.get("agent") or {}
    chosen = agent.get("agent_loop_manager_class")
    if chosen not in (None, manager):
        raise ValueError(
            f"data.media_handoff: actor_rollout_ref.rollout.agent.agent_loop_manager_class is {chosen}; the handed-off "
            f"media are taken by {manager} (remove the key, or turn media_handoff off)"
        )
    with open_dict(config):
        config.actor_rollout_ref.rollout.agent.agent_loop_manager_class = manager
    return manager


def check_v1_agent_loop() -> None:
    """Raise ``ImportError`` naming what is missing where verl's v1 agent-loop classes cannot be imported (verl 0.9's
    needs the TransferQueue package): verl would otherwise report only that the hand-off's manager class is not
    found in its module."""
    import importlib

    try:
        importlib.import_module(V1_AGENT_LOOP_MODULE)
    except ImportError as exc:
        hint = (
            "install the TransferQueue package (verl's verl-core extra: pip install 'TransferQueue>=0.1.10')"
            if exc.name == "transfer_queue"
            else "install a verl whose v1 trainer has it (0.9)"
        )
        raise ImportError(
            f"data.media_handoff on verl's v1 trainer (trainer.use_v1, verl 0.9's default) hands the media to "
            f"{V1_AGENT_LOOP_MODULE}'s agent loop, which does not import here ({type(exc).__name__}: {exc}): {hint}, "
            "or set trainer.use_v1=false for the legacy trainer"
        ) from exc


class _IngestRun:
    """Mixed in front of verl's task runner class: its ``run`` with the two changes above."""

    def run(self, config: Any):
        ingest_logs = logging.getLogger("ingest")  # the job's output shows what the pipeline did (counts, loaders)
        ingest_logs.setLevel(logging.INFO)
        if not ingest_logs.handlers:
            ingest_logs.addHandler(logging.StreamHandler(sys.stdout))
            ingest_logs.propagate = False  # verl configures the root logger too: each line once
        select_ingest_dataset(config)
        after = type(self).__mro__[type(self).__mro__.index(_IngestRun) + 1 :]  # verl's classes
        verl_run = inspect.unwrap(next(vars(c)["run"] for c in after if "run" in vars(c)))
        name = _use_ingest_trainer(config, verl_run)
        print(f"[ingest] verl's task runner trains with {name}: data.custom_cls = {CUSTOM_CLS['name']}", flush=True)
        manager = use_handoff_manager(config)
        if manager is not None:
            print(f"[ingest] data.media_handoff: the rollout's agent-loop manager is {manager}", flush=True)
        return super().run(config)


def _with_ingest(runner: Any) -> Any:
    """verl's task runner (a Ray actor class, or the plain class 0.6's ``run_ppo`` wraps) with ``_IngestRun``."""
    import ray

    actor = getattr(runner, "__ray_metadata__", None)
    # an actor class keeps the class it was made from (Ray's modified subclass names it __ray_actor_class__)
    plain = actor.modified_class.__ray_actor_class__ if actor is not None else runner
    mixed = type(plain.__name__, (_IngestRun, plain), {"__module__": __name__})
    if actor is None:
        return mixed
    return ray.remote(mixed) if actor.num_cpus is None else ray.remote(num_cpus=actor.num_cpus)(mixed)


def with_data_keys_added(overrides: list[str]) -> list[str]:
    """verl's Hydra overrides with each ``data.KEY=VALUE`` of a ``DataConfig`` key made ``++data.KEY=VALUE`` (add or
    override): Hydra refuses a plain override of a key verl's config lacks (``data.media_handoff``), and a ``+`` one
    of a key it has, so either form the user types works. Other overrides are kept as they are."""
    import dataclasses

    from ingest.config import DataConfig

    ours = {f"data.{field.name}" for field in dataclasses.fields(DataConfig)}
    return [f"++{arg}" if arg.partition("=")[0] in ours and "=" in arg else arg for arg in overrides]


def main() -> None:
    import importlib.util

    from verl.trainer import main_ppo

    sys.argv[1:] = with_data_keys_added(sys.argv[1:])  # read by verl's Hydra main below

    for name in ("TaskRunner", "TaskRunnerV1"):  # 0.5 to 0.7; 0.9 with trainer.use_v1 (its default)
        if hasattr(main_ppo, name):
            setattr(main_ppo, name, _with_ingest(getattr(main_ppo, name)))
    if importlib.util.find_spec("verl.trainer.main_ppo_v0"):  # 0.9's legacy runner, imported by main when chosen
        from verl.trainer import main_ppo_v0

        main_ppo_v0.TaskRunner = _with_ingest(main_ppo_v0.TaskRunner)
    main_ppo.main()


if __name__ == "__main__":
    sys.exit(main())
