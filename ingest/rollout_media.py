"""A prompt's media made once for verl's agent loop and handed to its workers through Ray's object store
(``data.media_handoff``): the pipeline's side.

Stock verl 0.7 and 0.9 do the media work of a prompt once per sample: for each of its ``rollout.n`` samples the agent
loop runs qwen-vl-utils on the images and videos, the processor to build the prompt ids, and after generation the
worker runs the processor again for the training inputs (``AgentLoopWorker._compute_multi_modal_inputs``). With the
hand-off the pipeline's vision actors make all three once per prompt with verl's own functions (``PromptMediaMaker``,
run by ``stages.rollout_media``) and hand them to the loader's ``MediaStore`` actor, which holds them in the object
store until ``HeldMedia`` releases them; the rows carry ``ingest-media://`` URIs in place of the media. The rollout's
side is ``ingest.verl.rollout_media`` (fetching a prompt's media once per worker process) and
``ingest.verl.agent_loop`` (verl's classes taking them).

A URI is a plain string: rows stay plain data wherever verl sends them (TransferQueue, checkpoints, reward
functions), and stock qwen-vl-utils fails on one loudly (no such file), never with a silently missing image.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

URI_PREFIX = "ingest-media://"
NAMESPACE = "ingest"  # the store actors' Ray namespace: found by name from any job namespace
MEDIA_KINDS = ("image", "video")


def media_uri(store: str, key: str, kind: str, index: int) -> str:
    """The URI that stands for item ``index`` of kind ``kind`` (image or video) of one prompt's media."""
    return f"{URI_PREFIX}{store}/{key}/{kind}/{index}"


def parse_media_uri(value: Any) -> tuple[str, str, str, int] | None:
    """``(store, key, kind, index)`` of a media URI, None for any other value."""
    if not isinstance(value, str) or not value.startswith(URI_PREFIX):
        return None
    store, key, kind, index = value[len(URI_PREFIX) :].split("/")
    return store, key, kind, int(index)


def media_items(messages: Iterable[Mapping]) -> list[dict]:
    """The image and video content items of ``messages``, in order."""
    return [
        item
        for message in messages
        if isinstance(message.get("content"), list)
        for item in message["content"]
        if isinstance(item, dict) and item.get("type") in MEDIA_KINDS
    ]


def handle_items(messages: list[dict], store: str, key: str) -> list[dict]:
    """``messages`` with each image / video item's media replaced by its URI (in place; the other keys dropped:
    the payload holds what verl makes of them)."""
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    for item in media_items(messages):
        kind = item["type"]
        item.clear()
        item.update({"type": kind, kind: media_uri(store, key, kind, counts[kind])})
        counts[kind] += 1
    return messages


# --- the pipeline side ----------------------------------------------------------------------------------------------


def training_inputs(prompt_inputs: Mapping[str, Any]) -> dict:
    """The training inputs verl's ``AgentLoopWorker._compute_multi_modal_inputs`` computes for a sample, from the
    processor's outputs for its prompt: the processor's image and video outputs depend only on the media, and the
    one text-dependent output it keeps, ``mm_token_type_ids``, is read by ``_compute_position_ids`` only for its
    presence (it rebuilds the values from the sample's ids, then pops the key)."""
    import torch
    from transformers import BatchFeature

    inputs = {k: v for k, v in prompt_inputs.items() if k not in ("input_ids", "attention_mask")}
    inputs = dict(BatchFeature(data=inputs).convert_to_tensors("pt"))
    grid = inputs.get("image_grid_thw")
    if grid is not None:
        inputs["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    return inputs


class PromptMediaMaker:
    """What verl's agent loop makes of one prompt's media before and after generation, with verl's own functions (the
    installed release; the pipeline's actors run in the trainer's environment): the fetched images and videos (its
    dataset class's), the prompt ids and the processor's outputs for them (no tools, as the single-turn loop asks),
    and the training inputs (``training_inputs``). verl 0.9 renders the prompt with its continuous-token builder;
    verl 0.7 with ``AgentLoopBase.apply_chat_template``'s processor call, made here as it stands there. verl 0.8.0's
    agent loop is neither and is refused.

    ``model_path``: the model folder verl's rollout loads (``actor_rollout_ref.model.path``; its ``config.json``
    names the model type that picks the builder). ``data``: verl's ``data:`` section (``apply_chat_template_kwargs``,
    ``mm_processor_kwargs``)."""

    def __init__(self, model_path: str, data: Mapping[str, Any]):
        from omegaconf import OmegaConf
        from verl.utils import hf_processor, hf_tokenizer
        from verl.utils.dataset.rl_dataset import RLHFDataset

        self.tokenizer = hf_tokenizer(model_path)
        self.processor = hf_processor(model_path)
        if self.processor is None:
            raise ValueError(f"{model_path}: verl loads no processor from it, so its rollout makes no media")
        self.data = OmegaConf.create(dict(data))
        self.dataset_cls = RLHFDataset
        image_processor = getattr(self.processor, "image_processor", None)
        self.image_patch_size = getattr(image_processor, "patch_size", 14)  # as AgentLoopBase's
        self.builder = None
        try:  # verl 0.9
            from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
        except ImportError:  # verl 0.7 and 0.8 (``verl.utils.tokenizer`` is a module there)
            create_continuous_token_builder = None
        if create_continuous_token_builder is not None:
            from transformers import AutoConfig

            self.builder = create_continuous_token_builder(
                self.tokenizer,
                hf_model_type=getattr(AutoConfig.from_pretrained(model_path), "model_type", None),
                chat_template_kwargs=self.data.get("apply_chat_template_kwargs", {}),
                mm_processor_kwargs=self.data.get("mm_processor_kwargs", {}),
                processor=self.processor,
            )
        elif hasattr(RLHFDataset, "process_multi_modal_info"):
            import verl

            raise ValueError(f"media_handoff: verl {verl.__version__}'s agent loop is not supported (0.7.1, 0.9)")

    def make(self, messages: list[dict]) -> dict:
        """One prompt's payload: ``images`` / ``videos`` / ``audios`` (verl's lists, None where it has none),
        ``prompt_ids``, ``prompt_inputs`` (the processor's outputs but the ids) and ``training_inputs``."""
        prompt_inputs: dict[str, Any] = {}
        if self.builder is not None:
            images, videos, audios = self.dataset_cls._process_multi_modal_info(
                messages, image_patch_size=self.image_patch_size, config=self.data
            )
            prompt_ids = self.builder.build_initial_tokens(
                messages, images=images, videos=videos, audios=audios, mm_inputs_out=prompt_inputs
            )
        else:
            import asyncio

            audios = None
            images, videos = asyncio.run(
                self.dataset_cls.process_vision_info(messages, image_patch_size=self.image_patch_size, config=self.data)
            )
            prompt_ids = self._verl_07_prompt(messages, images, videos, prompt_inputs)
        return {
            "images": images,
            "videos": videos,
            "audios": audios,
            "prompt_ids": list(prompt_ids),
            "prompt_inputs": prompt_inputs,
            "training_inputs": training_inputs(prompt_inputs),
        }

    def _verl_07_prompt(self, messages: list[dict], images, videos, prompt_inputs: dict) -> list[int]:
        """verl 0.7.1's ``AgentLoopBase.apply_chat_template`` (processor path, no tools), keeping the processor's other
        outputs in ``prompt_inputs``."""
        from verl.utils.chat_template import apply_chat_template
        from verl.utils.tokenizer import normalize_token_ids

        kwargs = self.data.get("apply_chat_template_kwargs", {})
        raw_prompt = apply_chat_template(
            self.processor, messages, tools=None, add_generation_prompt=True, tokenize=False, **kwargs
        )
        video_metadatas = None
        if videos is not None:
            videos, video_metadatas = (list(part) for part in zip(*videos, strict=False))
        model_inputs = self.processor(
            text=[raw_prompt],
            images=images,
            videos=videos,
            video_metadata=video_metadatas,
            return_tensors="pt",
            do_sample_frames=False,
        )
        prompt_ids = normalize_token_ids(model_inputs.pop("input_ids"))
        prompt_inputs.update(model_inputs)
        return prompt_ids


class MediaStore:
    """Holds the prompts' payloads in the object store until the loader releases them: the run's store, one named
    actor (``NAMESPACE``) on the loader's node. It puts each payload itself (``adopt_many``), so that it owns it: an
    object lives as long as its owner, and the vision actor that made it goes when its pool does (at each epoch's end,
    say), while the store lives as long as the loader. Each entry keeps the file and row its prompt came from, for
    errors."""

    def __init__(self):
        self._entries: dict[str, tuple[Any, str | None, int | None]] = {}

    def adopt_many(self, entries: list[tuple[str, list, str | None, int | None]]) -> None:
        """``(key, [ref], file, row)`` per prompt (the ref in a list, so Ray hands it over unresolved): the payload
        put again, owned here."""
        import ray

        for key, refs, file, row in entries:
            self._entries[key] = (ray.put(ray.get(refs[0])), file, row)

    def lookup(self, key: str) -> tuple[list, str, int] | None:
        """``([ref], file, row)``: the ref in a list, so Ray hands it over unresolved."""
        entry = self._entries.get(key)
        return None if entry is None else ([entry[0]], entry[1], entry[2])

    def release(self, keys: list[str]) -> None:
        for key in keys:
            self._entries.pop(key, None)

    def size(self) -> int:
        return len(self._entries)


# --- the loader side ------------------------------------------------------------------------------------------------

# batches whose media stay held once handed out: the step being trained and the next one (whose rollout a one-step-off
# trainer runs beside it); a batch's media go when the second batch after it is handed out
HELD_BATCHES = 2


class HeldMedia:
    """A loader's ``MediaStore`` (started on this node, named, gone with this object's process) and the media keys of
    the batches it handed out, each batch's released once ``HELD_BATCHES`` later ones were handed out: the store, so
    the object store, holds the rollout's media of those batches plus what the pipeline made ahead of them."""

    def __init__(self):
        import uuid

        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.name = f"ingest-media-{uuid.uuid4().hex[:16]}"
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        store = ray.remote(MediaStore).options(
            name=self.name, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=here
        )
        self.store = store.remote()
        self._batches: list[list[str]] = []

    def handed_out(self, raw_prompt: Iterable[list[dict]]) -> None:
        """A batch is handed out (its ``raw_prompt`` messages): hold its media, release those of the batch
        ``HELD_BATCHES`` before it."""
        keys = {
            parsed[1]
            for messages in raw_prompt
            for item in media_items(messages)
            if (parsed := parse_media_uri(item.get(item["type"]))) is not None
        }
        self._batches.append(sorted(keys))
        while len(self._batches) > HELD_BATCHES:
            released = self._batches.pop(0)
            if released:
                self.store.release.remote(released)
