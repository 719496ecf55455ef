"""verl 0.7 and 0.9's agent-loop classes, taking a prompt's media from the pipeline (``ingest.rollout_media``) where
verl would make them again for each sample. Selected by configuration, nothing of verl's edited:
``IngestAgentLoopManager`` (``IngestAgentLoopManagerTQ`` for the v1 trainers) through
``actor_rollout_ref.rollout.agent.agent_loop_manager_class``, which ``python -m ingest.verl.main_ppo`` sets when
``data.media_handoff`` is on.

Per sample of a prompt whose rows carry media URIs:
- its images and videos: ``IngestDataset.process_multi_modal_info`` (0.7: ``process_vision_info``) returns the
  fetched payload's, in lists of the sample's own (no qwen-vl-utils);
- its prompt ids: the agent loop's continuous-token builder (0.7: its ``apply_chat_template``) returns the payload's
  for the payload's own media and no tools (verl 0.9's length checks run on them as on its own);
- its training inputs: the worker's ``_compute_multi_modal_inputs`` returns a copy of the payload's for the payload's
  own media (a trajectory whose media grew, a tool's images, gets verl's own computation).
Position ids stay verl's: they depend on the response.
"""

from __future__ import annotations

from typing import Any

import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker, _agent_loop_registry
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from ingest.verl import rollout_media
from ingest.verl.rollout_media import handed_off


class _HandedOffPromptTokens:
    """An agent loop's continuous-token builder, but a handed-off prompt's initial tokens come from its payload."""

    def __init__(self, builder: Any):
        self._builder = builder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._builder, name)

    def build_initial_tokens(self, messages, *, tools=None, images=None, videos=None, audios=None, mm_inputs_out=None):
        payload = None if tools or audios else handed_off(images, videos)
        if payload is None:  # tool schemas change the prompt: verl renders it
            return self._builder.build_initial_tokens(
                messages, tools=tools, images=images, videos=videos, audios=audios, mm_inputs_out=mm_inputs_out
            )
        if mm_inputs_out is not None:
            mm_inputs_out.update(payload["prompt_inputs"])
        return list(payload["prompt_ids"])


class _HandedOffTokensMixin:
    """verl 0.9: the loop's builder wrapped (``_HandedOffPromptTokens``); verl 0.7: its ``apply_chat_template``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if hasattr(self, "continuous_token_builder"):
            self.continuous_token_builder = _HandedOffPromptTokens(self.continuous_token_builder)

    async def apply_chat_template(self, messages, tools=None, images=None, videos=None, remove_system_prompt=False):
        payload = None if tools or remove_system_prompt else handed_off(images, videos)
        if payload is None:  # tool schemas, a tool turn's messages: verl renders them
            return await super().apply_chat_template(
                messages, tools=tools, images=images, videos=videos, remove_system_prompt=remove_system_prompt
            )
        return list(payload["prompt_ids"])


class IngestSingleTurnAgentLoop(_HandedOffTokensMixin, SingleTurnAgentLoop):
    """verl's single-turn loop on handed-off prompt media."""


class IngestToolAgentLoop(_HandedOffTokensMixin, ToolAgentLoop):
    """verl's tool loop on handed-off prompt media: the prompt's fetched media are the payload's; its prompt ids
    (rendered with the tool schemas) and, where tools added images, its training inputs are verl's own."""


# verl's registered loops and ours in their place (only where the registry still holds verl's own class)
AGENT_LOOPS = {
    "single_turn_agent": (SingleTurnAgentLoop, IngestSingleTurnAgentLoop),
    "tool_agent": (ToolAgentLoop, IngestToolAgentLoop),
}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_agent_loops() -> None:
    """Put our loops in this process's registry under verl's names, where verl's own classes are registered (a
    user's loop under that name, from ``agent_loop_config_path``, stays)."""
    for name, (theirs, ours) in AGENT_LOOPS.items():
        entry = _agent_loop_registry.get(name)
        if entry is not None and entry.get("_target_") == _qualified(theirs):
            _agent_loop_registry[name] = {"_target_": _qualified(ours)}


class _HandedOffInputsMixin:
    """A worker whose training inputs for a handed-off prompt are the payload's (``rollout_media.training_inputs``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register_agent_loops()

    async def generate_sequences(self, batch, *args, **kwargs):
        # the batch's payloads in one call per store, before its samples ask for them one by one (the v1 worker
        # starts its prompts' sessions in the background: they find the payloads fetched)
        raw_prompt = rollout_media.batch_raw_prompts(batch)
        if raw_prompt is not None:
            rollout_media.prefetch(raw_prompt)
        return await super().generate_sequences(batch, *args, **kwargs)

    def _compute_multi_modal_inputs(self, output, input_ids) -> dict:
        data = output.multi_modal_data or {}
        payload = None if data.get("audios") else handed_off(data.get("images"), data.get("videos"))
        if payload is None or self.processor is None:
            return super()._compute_multi_modal_inputs(output, input_ids)
        # a new dict per sample: verl's _compute_position_ids pops mm_token_type_ids from it
        return dict(payload["training_inputs"])


class IngestAgentLoopWorker(_HandedOffInputsMixin, AgentLoopWorker):
    """verl's agent-loop worker (legacy trainer) on handed-off prompt media."""


class IngestAgentLoopManager(AgentLoopManager):
    """verl's agent-loop manager (legacy trainer) with ``IngestAgentLoopWorker``\\ s."""

    agent_loop_workers_class = ray.remote(IngestAgentLoopWorker)


try:  # the v1 trainers' TransferQueue classes (verl 0.9)
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
except ImportError:  # pragma: no cover - verl without the v1 trainers
    AgentLoopManagerTQ = None
else:
    # AgentLoopWorkerTQ is an actor class: subclass the class it was made from
    _PlainWorkerTQ = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__ray_actor_class__

    class IngestAgentLoopWorkerTQ(_HandedOffInputsMixin, _PlainWorkerTQ):
        """verl's v1 agent-loop worker on handed-off prompt media."""

    class IngestAgentLoopManagerTQ(AgentLoopManagerTQ):
        """verl's v1 agent-loop manager with ``IngestAgentLoopWorkerTQ``\\ s (its ``__init__`` sets verl's worker
        class; the workers start after it, in ``create``)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.agent_loop_workers_class = ray.remote(IngestAgentLoopWorkerTQ)
