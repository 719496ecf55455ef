"""verl 0.9's v1 agent loop (``AgentLoopWorkerTQ``: one prompt's ``rollout.n`` sessions in one worker, outputs put
into TransferQueue) on CPU, stock and on handed-off media, inside the verl 0.9.1 oracle (``agent_loop`` mode, check
``compare``, cases with ``v1``), with a real TransferQueue on a local Ray cluster.

Both sides take the batches ``agent_loop.py``'s legacy comparison takes from this pipeline's ``VerlDataLoader`` (each
side's loader reads once for both), through verl's own v1 trainer code: ``PPOTrainer._next_train_batch`` (the fetch,
the uids, the TensorDict) and ``_submit_batch_to_rollout`` (the prompts registered in TransferQueue, then the
manager's ``generate_sequences``, here one worker's). The stock side runs verl's ``AgentLoopWorkerTQ`` with
``RLHFDataset``; the hand-off side ``IngestAgentLoopWorkerTQ`` with ``IngestDataset`` and ``media_handoff``. Once
TransferQueue marks every prompt finished, each sample's fields are read back from it; with what the stand-in server
received (prompt ids, images, videos) and the hand-off worker's count of qwen-vl-utils and processor calls, they are
pickled.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from tools.oracle.agent_loop import CallCounter, FixedTokenServer, hosted_worker, trainer_config, worker_settings

# what a sample's worker puts into TransferQueue and the trainer trains on; the rest are the prompt's own fields
# (raw_prompt holds media URIs on the hand-off side) and the worker's bookkeeping
COMPARED_FIELDS = ("prompts", "responses", "response_mask", "input_ids", "position_ids", "multi_modal_inputs")
PARTITION = "train"


def _worker_class(handoff: bool) -> type:
    """verl's v1 worker class (the hand-off one with ``handoff``) that reports what its server received, and on the
    hand-off side its media call counts and which maker made the payloads it fetched."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    base = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__ray_actor_class__
    if handoff:
        from ingest.verl.agent_loop import IngestAgentLoopWorkerTQ

        base = IngestAgentLoopWorkerTQ

    class RecordingWorker(base):
        def __init__(self, config, server: FixedTokenServer):
            super().__init__(config, server)
            self.counter = CallCounter(self.processor) if handoff else None
            self.errors = _ErrorRecords()  # what verl's v1 worker logs of a failed prompt
            logging.getLogger(AgentLoopWorkerTQ.__module__).addHandler(self.errors)

        def stats(self) -> dict:
            from ingest.verl import rollout_media

            made_by = [payload["made_by"] for payload in rollout_media._CACHE.payloads.values()]
            counts = {} if self.counter is None else dict(self.counter.counts)
            return {
                "requests": self.llm_client.requests,
                "errors": list(self.errors.messages),
                "counts": {**counts, "made_by": {m: made_by.count(m) for m in ("kernels", "verl")}},
            }

    return RecordingWorker


class _ErrorRecords(logging.Handler):
    """The error records of a logger, formatted with their exceptions."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(self.format(record))


class _TrainerStandIn:
    """verl's v1 ``PPOTrainer`` methods that fetch and submit a batch (its own functions, ``with_verls_methods``) on
    the attributes they read, with ``worker`` as the agent-loop manager."""

    @classmethod
    def with_verls_methods(cls) -> type:
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        names = ("_fetch_one_gen_batch", "_next_train_batch", "_submit_batch_to_rollout")
        return type("TrainerStandIn", (cls,), {name: getattr(PPOTrainer, name) for name in names})

    def __init__(self, loader, batch_size: int, worker, agent: str | None):
        from omegaconf import OmegaConf

        self.config = OmegaConf.create({"data": {"train_batch_size": batch_size, "gen_batch_size": None}})
        self.train_dataloader = AgentNamedBatches(loader, agent)
        self.train_dataloader_it = None
        self.global_steps = 0
        self.trainer_mode = "sync"
        self.agent_loop_manager = self
        self.worker = worker

    def generate_sequences(self, batch) -> None:
        import ray

        ray.get(self.worker.generate_sequences.remote(batch))  # the worker's sessions run on in the background


class AgentNamedBatches:
    """Stands where the dataloader is: ``loader``'s batches (a list of them here), each row's ``agent_name`` ``agent``
    where given (as a dataset's column sets it)."""

    def __init__(self, loader, agent: str | None):
        self.loader, self.agent = loader, agent

    def __iter__(self):
        for batch in self.loader:
            if self.agent is not None:
                batch = {**batch, "agent_name": np.array([self.agent] * len(batch["raw_prompt"]), dtype=object)}
            yield batch


def _finished(uids: list[str], timeout: float = 600) -> None:
    """Wait until TransferQueue marks each prompt of ``uids`` finished (a failure is an error)."""
    import transfer_queue as tq

    deadline = time.monotonic() + timeout
    while True:
        tags = tq.kv_list(PARTITION).get(PARTITION, {})
        status = {uid: (tags.get(uid) or {}).get("status") for uid in uids}
        if any(s == "failure" for s in status.values()):
            raise RuntimeError(f"an agent loop failed: {status}")
        if all(s == "finished" for s in status.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"agent loops not finished: {status}")
        time.sleep(0.2)


def _plain(value: Any) -> Any:
    """A TransferQueue field's value as plain data: tensors cloned, tensordict lists and stacks as lists."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    data = getattr(value, "data", None)
    if data is not None and not isinstance(value, np.ndarray):
        return _plain(data)
    return value


def _samples(uids: list[str], n: int) -> list[dict]:
    """Each prompt's ``n`` sessions' fields (``COMPARED_FIELDS``), in prompt order, then session order."""
    import transfer_queue as tq

    keys = [f"{uid}_{session}_0" for uid in uids for session in range(n)]
    fields = tq.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=list(COMPARED_FIELDS))
    samples = []
    for i in range(len(keys)):
        sample = {}
        for name in COMPARED_FIELDS:
            column = fields[name]
            value = column.unbind(0)[i] if getattr(column, "is_nested", False) else column[i]
            sample[name] = _plain(value)
        samples.append(sample)
    return samples


def start_transfer_queue() -> None:
    """TransferQueue on the running Ray session, with one storage unit: its controller and storage units take a CPU
    each, and the 4-CPU session the comparison's pipelines see keeps two for their actors."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))


def compare_v1(
    spec: dict, batches: dict[str, list[dict]], tool_config: str | None, sides: tuple[str, ...] = ("stock", "handoff")
) -> dict:
    """``sides`` (stock, hand-off) on ``batches`` (by side: the loader's first batches, stock and with
    ``media_handoff``), fetched and submitted by verl's own v1 trainer code (Ray and TransferQueue started)."""
    import ray
    import transfer_queue as tq

    n, size, agent = spec["n"], spec["batch_size"], spec.get("agent")
    result = {}
    for side in sides:
        handoff = side == "handoff"
        settings = worker_settings(spec, handoff, tool_config)
        worker = hosted_worker(side, _worker_class(handoff), *settings)
        trainer = _TrainerStandIn.with_verls_methods()(batches[side], size, worker, agent)
        samples, raw_prompt = [], None
        for step in range(1, len(batches[side]) + 1):
            trainer.global_steps = step
            batch = trainer._next_train_batch()  # verl's own: fetch, uids, TensorDict
            uids = list(batch["uid"])
            raw_prompt = [list(messages) for messages in batch["raw_prompt"]]
            trainer._submit_batch_to_rollout(batch)  # verl's own: TransferQueue, generate_sequences
            _finished(uids)
            samples.append(_samples(uids, n))
        result[side] = {"samples": samples, "last_raw_prompt": raw_prompt, **ray.get(worker.stats.remote())}
        tq.kv_clear(keys=list(tq.kv_list(PARTITION).get(PARTITION, {})), partition_id=PARTITION)
    return result


class _ManagerStandIn:
    """Stands where ``AgentLoopManagerTQ`` is: its ``generate_sequences``, the batch split over its workers (a list)
    or given to its one worker."""

    def __init__(self, workers):
        self.workers = workers if isinstance(workers, list) else [workers]

    def generate_sequences(self, batch) -> None:
        import ray

        chunks = batch.chunk(len(self.workers)) if len(self.workers) > 1 else [batch]
        # the workers' sessions run on in the background
        ray.get([worker.generate_sequences.remote(chunk) for worker, chunk in zip(self.workers, chunks, strict=False)])


def bench_worker_class(handoff: bool) -> type:
    """verl's v1 worker (``IngestAgentLoopWorkerTQ`` with ``handoff``) with a stand-in server and its media work
    metered (``agent_loop.CpuMeter``): ``stats`` gives the media CPU and the process's CPU since it was made (its
    prompts' sessions run in the background)."""
    from tools.oracle.agent_loop import CpuMeter, _meter_media_work

    class BenchWorkerTQ(_worker_class(handoff)):
        def __init__(self, config, handoff: bool):
            self.meter = CpuMeter()
            _meter_media_work(self.meter, handoff)
            super().__init__(config, FixedTokenServer(record=False))
            self.started = time.process_time()

        def stats(self) -> dict:
            return {
                "samples": self.llm_client.calls,  # one request per single-turn session
                "step_cpu_s": time.process_time() - self.started,
                "media_cpu_s": self.meter.seconds,
            }

    return BenchWorkerTQ


def v1_bench_steps(batches, workers: list, batch_size: int) -> int:
    """Each batch through verl's own v1 trainer code (``_next_train_batch``: the uids, the TensorDict;
    ``_submit_batch_to_rollout``: TransferQueue, then the workers' ``generate_sequences``), waited for until
    TransferQueue marks its prompts finished, then cleared (as the replay buffer takes them); the prompts."""
    import transfer_queue as tq

    trainer = _TrainerStandIn.with_verls_methods()([], batch_size, None, None)
    trainer.agent_loop_manager = _ManagerStandIn(workers)
    prompts = 0
    for step, batch in enumerate(batches, 1):
        trainer.train_dataloader, trainer.train_dataloader_it, trainer.global_steps = [batch], None, step
        tensors = trainer._next_train_batch()  # verl's own
        uids = list(tensors["uid"])
        trainer._submit_batch_to_rollout(tensors)  # verl's own
        _finished(uids)
        stored = tq.kv_list(PARTITION).get(PARTITION, {})
        tq.kv_clear(keys=[key for key in stored if key.split("_")[0] in set(uids)], partition_id=PARTITION)
        prompts += len(uids)
    return prompts


def _settled(uids: list[str], timeout: float = 600) -> dict[str, str]:
    """Each prompt's terminal TransferQueue status (``finished`` or ``failure``), once every one has one."""
    import transfer_queue as tq

    deadline = time.monotonic() + timeout
    while True:
        tags = tq.kv_list(PARTITION).get(PARTITION, {})
        status = {uid: (tags.get(uid) or {}).get("status") for uid in uids}
        if all(s in ("finished", "failure") for s in status.values()):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"agent loops not settled: {status}")
        time.sleep(0.2)


def v1_steps(spec: dict) -> dict:
    """verl 0.9's v1 async trainer (``colocate_async``) on handed-off media, through its own code: its
    ``_init_dataloader`` (``gen_batch_size`` 1: ``ingest_trainer``'s loaders fetch single prompts), and each step its
    ``_next_train_batch`` (a step's prompts fetched one by one) and ``_submit_batch_to_rollout`` (the prompts and
    their fields put into TransferQueue, then the worker's ``generate_sequences``).

    Stock: three steps in flight at once. Hand-off: two steps in flight at once, ``data.pt`` saved by verl's own
    lines; then a third step's prompts fetched, one prompt's payload released from its store while TransferQueue
    holds the prompt, and that step submitted; then a loader resumed from ``data.pt`` by verl's own lines runs the
    third step again. Each sample's fields are read back from TransferQueue (Ray and TransferQueue started)."""
    import sys

    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base

    from ingest.rollout_media import prompt_media_key
    from ingest.verl import ingest_trainer
    from tools.oracle.trainer_v1 import LOAD_FROM, LOAD_TO, SAVE_FROM, SAVE_TO
    from tools.oracle.verl_runner import _lines, _processor, _tokenizer, run_save_lines

    mode, n, model = "colocate_async", spec["n"], spec["model"]
    trainer_cls = ingest_trainer(get_trainer_cls(mode))
    source = open(sys.modules[trainer_base.__name__].__file__).read()
    save_lines, load_lines = _lines(source, SAVE_FROM, SAVE_TO), _lines(source, LOAD_FROM, LOAD_TO)
    tokenizer, processor = _tokenizer(model), _processor(model)

    def new_trainer(handoff: bool, worker):
        trainer = object.__new__(trainer_cls)  # no worker groups: the data side of verl's trainer
        trainer.config = OmegaConf.create(
            {
                "data": {**spec["trainer_data"], "media_handoff": handoff},
                "trainer": {
                    "total_epochs": 1,
                    "total_training_steps": None,
                    "v1": {"trainer_mode": mode, "sampler": {}, mode: {"num_warmup_batches": 1}},
                },
                "algorithm": {"filter_groups": None},
                "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}},
                "critic": {"optim": {"lr": 1e-5}},
            }
        )
        trainer.tokenizer, trainer.processor = tokenizer, processor
        trainer.trainer_mode, trainer.parameter_sync_step, trainer.global_steps = mode, 1, 0
        trainer.agent_loop_manager = _ManagerStandIn(worker)
        trainer._init_dataloader()  # verl's own, then ours: gen_batch_size 1
        return trainer

    def submit_step(trainer) -> list[str]:
        trainer.global_steps += 1
        batch = trainer._next_train_batch()
        trainer._submit_batch_to_rollout(batch)
        return list(batch["uid"])

    def new_worker(handoff: bool):
        config = trainer_config(model, n, spec["prompt_length"], handoff)
        return hosted_worker("handoff" if handoff else "stock", _worker_class(handoff), config, FixedTokenServer())

    result = {}
    worker = new_worker(False)
    trainer = new_trainer(False, worker)
    steps = [submit_step(trainer) for _ in range(3)]
    result["stock"] = {"statuses": [_settled(uids) for uids in steps], "samples": [_samples(u, n) for u in steps]}
    tq.kv_clear(keys=list(tq.kv_list(PARTITION).get(PARTITION, {})), partition_id=PARTITION)

    worker = new_worker(True)
    trainer = new_trainer(True, worker)
    steps = [submit_step(trainer) for _ in range(2)]
    statuses = [_settled(uids) for uids in steps]
    run_save_lines(save_lines, trainer, spec["checkpoint_dir"])  # data.pt after step 2
    trainer.global_steps += 1
    batch = trainer._next_train_batch()
    _, key = prompt_media_key(list(batch["raw_prompt"])[1])
    held = trainer.train_dataloader.held_media
    _, _, file, row = held.lookup(key)
    ray.get(held.store.release.remote([key]))  # gone while TransferQueue holds its prompt
    trainer._submit_batch_to_rollout(batch)
    faulted = list(batch["uid"])
    fault = {"statuses": _settled(faulted), "uid": faulted[1], "file": file, "row": row}
    tq.kv_clear(
        keys=[k for k in tq.kv_list(PARTITION).get(PARTITION, {}) if k.split("_")[0] in faulted], partition_id=PARTITION
    )
    resumed = new_trainer(True, worker)
    resumed.global_steps = 2
    folder = os.path.join(spec["checkpoint_dir"], "global_step_2")
    scope = {"self": resumed, "os": os, "torch": torch, "global_step_folder": folder, "logger": logging}
    exec(load_lines, scope)  # verl's own data.pt lines
    steps.append(submit_step(resumed))
    statuses.append(_settled(steps[-1]))
    result["handoff"] = {
        "statuses": statuses,
        "samples": [_samples(u, n) for u in steps],
        "fault": fault,
        "held_rows": trainer.train_dataloader.config.media_handoff_held,
        **ray.get(worker.stats.remote()),
    }
    tq.kv_clear(keys=list(tq.kv_list(PARTITION).get(PARTITION, {})), partition_id=PARTITION)
    return result
