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

import asyncio
import contextlib
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

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


def prompt_media_key(messages: Iterable[Mapping]) -> tuple[str, str] | None:
    """``(store, key)`` of the prompt whose ``messages`` hold media URIs (read from its first media item), None where
    its first media item is no URI or it has none."""
    for item in media_items(messages)[:1]:
        parsed = parse_media_uri(item.get(item["type"]))
        if parsed is not None:
            return parsed[0], parsed[1]
    return None


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


# The payload codec: plain data (dicts, lists, numbers, numpy arrays) that Ray moves without pickling the arrays, and
# that the store holds without torch or PIL in its process. A tensor is ``{TENSOR: array}``, a PIL image
# ``{IMAGE: array, "mode": mode}``, a tuple ``{TUPLE: [...]}``; anything else verl puts in a payload is pickled. The
# kernels' ``pixel_values`` are ``{PATCHES: uint8 patches, "mean", "std", "frames"}``: an eighth of the float32
# bytes, which the rollout turns into the processor's values to the bit (``normalize_patches_into``).
TENSOR, IMAGE, TUPLE, PICKLED, PATCHES = "__tensor__", "__image__", "__tuple__", "__pickled__", "__patches__"


def encoded_tensor(array: np.ndarray) -> dict:
    """A tensor's encoding, from its values."""
    return {TENSOR: array}


def encoded_patches(patches: np.ndarray, mean: Sequence[float], std: Sequence[float], frames: int) -> dict:
    """``pixel_values`` encoded as their uint8 patches (n, C, P, P) and the normalize that makes them."""
    return {PATCHES: patches, "mean": list(mean), "std": list(std), "frames": frames}


def _pixel_values(value: Mapping[str, Any]):
    """``encoded_patches``' tensor."""
    import torch

    from ingest.media.pixels import normalize_patches_into

    patches = value[PATCHES]
    n, channels, p, _ = patches.shape
    out = np.empty((n, channels, value["frames"], p * p), np.float32)
    normalize_patches_into(patches, out, tuple(value["mean"]), tuple(value["std"]), value["frames"])
    return torch.from_numpy(out.reshape(n, -1))


def encoded_image(image: Any, pixels: np.ndarray | None = None) -> dict:
    """A PIL image's encoding (``pixels``: its ``np.asarray``, where made already)."""
    return {IMAGE: np.asarray(image) if pixels is None else pixels, "mode": image.mode}


def encode_payload(payload: Mapping[str, Any]) -> dict:
    """A payload of verl's objects (torch tensors, PIL images, tuples, containers) in the codec's plain form. A tensor
    met twice (the prompt's and the training inputs' ``pixel_values``) is one array, stored once."""
    seen: dict[int, dict] = {}

    def encode(value: Any) -> Any:
        if value is None or isinstance(value, (str, int, float, bool, np.ndarray, np.generic)):
            return value
        if isinstance(value, dict):
            return {key: encode(item) for key, item in value.items()}
        if isinstance(value, list):
            return [encode(item) for item in value]
        if isinstance(value, tuple):
            return {TUPLE: [encode(item) for item in value]}
        if id(value) in seen:
            return seen[id(value)]
        kind = type(value).__module__.split(".")[0]
        if kind == "torch":
            out = encoded_tensor(value.detach().cpu().numpy())
        elif kind == "PIL":
            out = encoded_image(value)
        else:
            out = {PICKLED: np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)}
        seen[id(value)] = out
        return out

    return encode(dict(payload))


def decode_payload(encoded: Mapping[str, Any]) -> dict:
    """``encode_payload``'s inverse (the rollout's side): tensors and images of their own (writable copies of the
    object store's read-only arrays), one tensor or image for an encoding met twice."""
    import torch
    from PIL import Image

    seen: dict[int, Any] = {}

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(item) for item in value]
        if not isinstance(value, dict):
            return value
        if TUPLE in value:
            return tuple(decode(item) for item in value[TUPLE])
        for tag in (TENSOR, IMAGE, PICKLED, PATCHES):
            if tag in value:
                if id(value) not in seen:  # the encoding met twice is one object once unpickled
                    array = value[tag]
                    if tag == TENSOR:
                        seen[id(value)] = torch.from_numpy(np.array(array))
                    elif tag == PATCHES:
                        seen[id(value)] = _pixel_values(value)
                    elif tag == IMAGE:
                        seen[id(value)] = Image.fromarray(array, value["mode"])
                    else:
                        seen[id(value)] = pickle.loads(memoryview(array))
                return seen[id(value)]
        return {key: decode(item) for key, item in value.items()}

    return decode(encoded)


def check_handoff_release() -> None:
    """Refuses an installed verl 0.8 (its agent loop is neither 0.7's nor 0.9's), read from its metadata: the vision
    actors import verl only for prompts the kernels do not make."""
    from ingest.config import installed_verl_version

    release = installed_verl_version()
    if release is not None and release.startswith("0.8."):
        raise ValueError(f"media_handoff: verl {release}'s agent loop is not supported (0.7.1, 0.9)")


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


# released keys whose file and row a store keeps, for a late fetch's error (a few MB at most)
RELEASED_KEPT = 65_536

# payloads per object the store puts: each ray.put costs ~1 ms however small, and a rollout worker fetching a prompt's
# payload gets its object's others with it (a worker's samples are a run of the batch's prompts)
PAYLOADS_PER_OBJECT = 8


class MediaStore:
    """Holds one read's payloads in the object store until its loader releases them: an async actor, named
    (``NAMESPACE``), on the loader's node. It puts the payloads itself (``adopt_many``), so that it owns them: an object
    lives as long as its owner, and the vision actor that made it goes when its pool does, while the store lives as
    long as the loader needs it. Each entry keeps the file and row its prompt came from, for errors.

    The rows carry only URIs, so Ray Data's backpressure (block bytes) never holds the media back: the store does.
    Prompts made but not yet taken by the loader (``delivered``) are at most ``ahead`` (or one block); beyond that
    ``adopt_many`` waits, which holds the vision actor that calls it. When the loader has waited ``LOADER_WAIT_S`` for
    a block (``loader_waiting``), the blocks of the units up to the one it waits for pass: the block the loader needs
    may sit behind the held one (Ray Data merges an actor task's outputs, and keeps the blocks in order), and the
    others stay within the window.

    Where the driver makes the rows (a small machine: ``datasets.layout.driver_keeps_epoch``), the store makes their
    rows and media instead (``start_making``, ``make_unit``): no actor pool or Ray Data executor runs, the payloads are
    put once, by their owner, and the media's bytes never pass through the driver."""

    def __init__(self, files: Sequence[str], ahead: int, units: Sequence | None = None):
        from ingest.read.units import UnitIndex

        self._files = list(files)
        self._unit_of = UnitIndex(list(units)) if units else None  # (file, row) -> the read's unit order
        self._waited_unit = -1  # while the loader waits: the last unit whose blocks may pass the window
        self._ahead_limit = ahead
        # key -> (ref of its object's payloads, its index there, file index, row): an object goes with its last entry
        self._entries: dict[str, tuple[Any, int, int, int]] = {}
        self._ahead: set[str] = set()  # made, not yet taken by the loader
        self._blocks_taken = 0
        self._loader_waits_after = -1  # the loader waits for the block after this many (-1: not waiting)
        self._peaks = {"held": 0, "ahead": 0}
        self._changed = None  # an asyncio.Condition, made in the actor's event loop
        self._units = None  # the read units' maker where the store makes them (start_making)
        self._made: list = []  # the payloads of the unit being made: (entries, payloads) per block
        self._making = asyncio.Lock()  # one unit at a time: the stages reuse their buffers
        self._units_made = 0
        self._stopped = False  # the loader stopped reading: nothing waits for room any more
        # released key -> (file index, row), the latest RELEASED_KEPT: a late fetch's error names its row
        self._released: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def _may_adopt(self, prompts: int, unit: int) -> bool:
        return (
            self._stopped
            or not self._ahead
            or len(self._ahead) + prompts <= self._ahead_limit
            or (self._loader_waits_after == self._blocks_taken and unit <= self._waited_unit)
        )

    async def _notify(self) -> None:
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def adopt_many(self, entries: list[tuple[str, int, int]], payloads: list) -> None:
        """``(key, file index, row)`` per prompt of one block, and ``[ref]`` of the block's payloads (a list of
        ``encode_payload`` payloads in the entries' order, put once by the vision actor; the ref in a list, so Ray hands
        it over unresolved): once the window has room, put again, owned here, ``PAYLOADS_PER_OBJECT`` to an object."""
        if entries:
            await self._room(entries)
            self._hold(entries, await payloads[0])

    async def _room(self, entries: list[tuple[str, int, int]]) -> None:
        """Waits until the window has room for these prompts, then counts them as made ahead."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            unit = -1 if self._unit_of is None else min(self._unit_of(file, row) for _, file, row in entries)
            await self._changed.wait_for(lambda: self._may_adopt(len(entries), unit))
            self._ahead.update(key for key, _, _ in entries)

    def _hold(self, entries: list[tuple[str, int, int]], made: list) -> None:
        """Puts ``made`` (the entries' payloads, in order), ``PAYLOADS_PER_OBJECT`` to an object owned here."""
        import ray

        for start in range(0, len(entries), PAYLOADS_PER_OBJECT):
            ref = ray.put(made[start : start + PAYLOADS_PER_OBJECT])
            for index, (key, file, row) in enumerate(entries[start : start + PAYLOADS_PER_OBJECT]):
                self._entries[key] = (ref, index, file, row)
        self._peaks = {
            "held": max(self._peaks["held"], len(self._entries)),
            "ahead": max(self._peaks["ahead"], len(self._ahead)),
        }

    async def start_making(self, new_units: Callable[..., Callable[[Any], Iterable]]) -> None:
        """Makes the read's units here (``make_unit``), as the driver would: ``new_units(adopt=...)`` is the loader's
        ``datasets.local.DriverUnits`` (read, prompt stage, media stages) for this read, whose rollout-media stage
        hands its payloads to ``adopt``. So the media's bytes never pass through the driver."""

        def adopt(entries: list[tuple[str, int, int]], made: list) -> None:  # the stage's, in make_unit's thread
            self._made.append((entries, made))

        self._units = await asyncio.to_thread(new_units, adopt=adopt)

    async def make_unit(self, unit) -> list:
        """One read unit's blocks (``DriverUnits``'), their payloads held here once the window has room (as
        ``adopt_many``). The unit is made in a thread, one at a time (the stages reuse their buffers); the store
        answers meanwhile, and a unit waits for room after its making, so a later unit never holds up the one the
        loader waits for."""
        async with self._making:
            try:
                blocks = await asyncio.to_thread(lambda: list(self._units(unit)))
            finally:
                made, self._made = self._made, []
        for entries, payloads in made:
            if entries:
                await self._room(entries)
                self._hold(entries, payloads)
        self._units_made += 1
        return blocks

    async def stop_making(self) -> None:
        """The loader stopped reading part way: a unit waiting for room goes through (its media go with the store),
        so that the loader's calls return."""
        self._stopped = True
        await self._notify()

    async def loader_waiting(self, blocks_taken: int, unit: int) -> None:
        """The loader, having taken ``blocks_taken`` blocks, has waited ``LOADER_WAIT_S`` (or a multiple) for the next
        one: blocks of units up to ``unit`` in read order may pass the window (the one it waits for is among them)."""
        self._loader_waits_after, self._waited_unit = blocks_taken, unit
        await self._notify()

    async def delivered(self, keys: list[str]) -> None:
        """The loader took a block with these prompts' rows: they no longer count as made ahead."""
        self._ahead.difference_update(keys)
        self._blocks_taken += 1
        await self._notify()

    async def lookup(self, key: str) -> tuple[list, int, str, int] | None:
        """``([ref], index, file, row)``: the prompt's payload is item ``index`` of the object ``ref`` (a list of
        payloads; the ref in a list, so Ray hands it over unresolved)."""
        return (await self.lookup_many([key]))[0]

    async def lookup_many(self, keys: list[str]) -> list[tuple[list, int, str, int] | None]:
        """``lookup`` of each key, in one call."""
        found = [self._entries.get(key) for key in keys]
        return [None if e is None else ([e[0]], e[1], self._files[e[2]], e[3]) for e in found]

    async def release(self, keys: list[str]) -> None:
        for key in keys:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._released[key] = entry[2:]
        while len(self._released) > RELEASED_KEPT:
            self._released.popitem(last=False)
        self._ahead.difference_update(keys)
        await self._notify()

    async def released_rows(self, keys: list[str]) -> list[tuple[str, int] | None]:
        """``(file, row)`` of each key released here (of the latest ``RELEASED_KEPT``), None for any other."""
        found = [self._released.get(key) for key in keys]
        return [None if f is None else (self._files[f[0]], f[1]) for f in found]

    async def stats(self) -> dict[str, int]:
        """Prompts held now and made ahead of the loader now, the peaks of both, and the read units made here."""
        return {
            "held": len(self._entries),
            "ahead": len(self._ahead),
            "peak_held": self._peaks["held"],
            "peak_ahead": self._peaks["ahead"],
            "units_made": self._units_made,
        }


# --- the loader side ------------------------------------------------------------------------------------------------

# batches whose media stay held once handed out: the step being trained and the next one (whose rollout a one-step-off
# trainer runs beside it); a batch's media go when the second batch after it is handed out
HELD_BATCHES = 2


# how long the loader waits for a block before the store lets the media made ahead exceed its window
LOADER_WAIT_S = 0.2


class HeldMedia:
    """A loader's media stores and the media keys of the batches it handed out, each batch's released once
    ``HELD_BATCHES`` later ones and ``held`` later rows were handed out. Each read (an epoch, a resumed epoch) gets a
    ``MediaStore`` of its own, started on this node and gone with this object's process; a read's store goes once the
    batches it holds are released and a later read has begun. The stores, so the object store, hold the rollout's
    media of those batches, the rows the loader has taken but not yet handed out, and at most ``ahead`` prompts
    more."""

    def __init__(self, ahead: int, held: int = 0):
        self.ahead = ahead
        self.held = held
        self.name: str | None = None  # the current read's store
        self.store = None
        self._batches: list[tuple[Any, list[str], int]] = []  # (store, keys, rows) per batch handed out, oldest first
        self._held_rows = 0  # the rows of _batches
        self._taken: dict[str, None] = {}  # keys the loader took, not yet handed out, in order
        self._calls: list = []  # replies of the stores' calls not yet known done (an async actor's run in any order)

    def begin(self, files: Sequence[str], units: Sequence | None = None) -> str:
        """A new read of ``files`` (``units``: its read units in order): its store's name. The rows of the previous
        read that were taken but never handed out (a read stopped part way) are released with its store."""
        import uuid

        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ingest.read.units import UnitIndex

        previous = self.store
        self.name = f"ingest-media-{uuid.uuid4().hex[:16]}"
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        store = ray.remote(MediaStore).options(
            name=self.name, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=here
        )
        self.store = store.remote(list(files), self.ahead, list(units) if units else None)
        self._unit_of = UnitIndex(list(units)) if units else None
        self._last_unit = -1  # the read order of the unit of the last row taken
        self._blocks_taken = 0
        if previous is not None and self._taken:
            self._call(previous.release, list(self._taken))
        self._taken = {}
        self._drop_unheld(previous)
        return self.name

    @contextlib.contextmanager
    def waiting_for_block(self) -> Iterator[None]:
        """Around the loader's wait for its next block: past ``LOADER_WAIT_S`` the store is told which units' blocks may
        pass the window: the next one's (the block waited for is its, or the rest of the last unit's), and one more
        each further ``LOADER_WAIT_S`` (a unit whose rows were all filtered out has no block)."""
        done, store, taken, last = threading.Event(), self.store, self._blocks_taken, self._last_unit

        def tell() -> None:
            more = 1
            while not done.wait(LOADER_WAIT_S):
                store.loader_waiting.remote(taken, last + more)
                more += 1

        threading.Thread(target=tell, name="ingest-media-wait", daemon=True).start()
        try:
            yield
        finally:
            done.set()

    def delivered(self, keys: Iterable[str], last_row: tuple[int, int] | None = None) -> None:
        """The loader took a block with these prompts' rows (in order; None: a text row; ``last_row``: the block's
        last (file index, row), where it has rows)."""
        if last_row is not None and self._unit_of is not None:
            self._last_unit = max(self._last_unit, self._unit_of(*last_row))
        keys = [key for key in keys if key is not None]
        self._taken.update(dict.fromkeys(keys))
        self._blocks_taken += 1
        self._call(self.store.delivered, keys)

    def handed_out(self, keys: Iterable[str | None]) -> None:
        """A batch with these rows' media keys (None: a text row) is handed out: hold its media, release those of
        the oldest batches while ``HELD_BATCHES`` later batches and ``held`` later rows stay held, and those of rows
        taken before its last one that no batch will hand out (rows a resumed read drops: their batch was handed out
        before the state was saved)."""
        keys = list(keys)
        rows = len(keys)
        keys = [key for key in keys if key is not None]
        batch = set(keys)
        skipped = []
        while keys and self._taken:
            key = next(iter(self._taken))
            del self._taken[key]
            if key == keys[-1]:
                break
            if key not in batch:
                skipped.append(key)
        if skipped:
            self._call(self.store.release, skipped)
        self._batches.append((self.store, keys, rows))
        self._held_rows += rows
        while len(self._batches) > HELD_BATCHES and self._held_rows - self._batches[0][2] >= self.held:
            store, released, oldest_rows = self._batches.pop(0)
            self._held_rows -= oldest_rows
            if released:
                self._call(store.release, released)
            self._drop_unheld(store)

    def _call(self, method, keys: list[str]) -> None:
        import ray

        self._calls.append(method.remote(keys))
        if len(self._calls) > 64:
            self._calls = ray.wait(self._calls, num_returns=len(self._calls), timeout=0)[1]

    def _drop_unheld(self, store) -> None:
        """Ends ``store`` once it is not the current read's and holds no handed-out batch."""
        if store is None or store is self.store or any(held is store for held, _, _ in self._batches):
            return
        import ray

        self._settled()
        ray.kill(store)

    def _settled(self) -> None:
        """Waits for the calls made so far (the stores run them in any order)."""
        import ray

        calls, self._calls = self._calls, []
        if calls:
            ray.wait(calls, num_returns=len(calls))

    def stats(self) -> dict[str, int]:
        """The current read's ``MediaStore.stats`` once the calls made so far are done."""
        import ray

        self._settled()
        return ray.get(self.store.stats.remote())

    def lookup(self, key: str) -> tuple[list, int, str, int] | None:
        """The current read's ``MediaStore.lookup`` once the calls made so far are done."""
        import ray

        self._settled()
        return ray.get(self.store.lookup.remote(key))
