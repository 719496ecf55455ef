"""``build_sft_dataset``: Parquet conversations -> read units -> SFT render actor pool (-> vision actor pool) -> rows
of shifted, truncated, optionally packed training samples; ``SFTCollate`` pads them into torch tensors per batch.

The read side is the RL pipeline's (``plan_input``, ``ParquetUnitsDatasource``, provenance columns, the read fused
into the first actor pool); the stages are in ``ingest.stages.sft``. See docs/sft.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.data.collate_fn import ArrowBatchCollateFn

from ingest.blocks import contiguous, tensor_from_record
from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan, check_model_path, plan_input
from ingest.datasets.pools import map_on_pool, read_units_into_pool
from ingest.errors import SourceError
from ingest.read.files import expand_files, inspect_files, printable_path
from ingest.sft.tokenizers import HFChatTokenizer, is_processor_object, is_tokenizer_object
from ingest.stages.sft import NO_TARGET_POLICIES
from ingest.tokenizer.chat import ChatTokenizer

MEDIA_TENSOR_COLUMNS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def check_sft_config(cfg: DataConfig) -> None:
    if cfg.sft_max_length is not None and int(cfg.sft_max_length) < 1:
        raise ValueError(f"sft_max_length must be >= 1 or null, got {cfg.sft_max_length}")
    if cfg.vision_pool_max_size == 0:
        raise ValueError("vision_pool_max_size: 0 (vision in the actors before it) is build_dataset's; SFT needs >= 1")
    if int(cfg.sft_pack_token_budget) < 0:
        raise ValueError(f"sft_pack_token_budget must be >= 0 (0: no packing), got {cfg.sft_pack_token_budget}")


def plan_sft_input(files: FilesArg, cfg: DataConfig, *, epoch: int = 0, multimodal: bool = False) -> InputPlan:
    """``plan_input`` for conversations: every file needs the messages column, or the prompt + completion columns."""
    try:
        return plan_input(files, dataclasses.replace(cfg, prompt_key=cfg.sft_messages_key), epoch=epoch,
                          multimodal=multimodal)  # fmt: skip
    except SourceError as exc:
        if exc.column != cfg.sft_messages_key:
            raise
    try:
        plan = plan_input(files, cfg, epoch=epoch, multimodal=multimodal)
    except SourceError as exc:
        if exc.column != cfg.prompt_key:
            raise
        raise _layout_error(files, cfg) from None
    for info in plan.infos:
        if cfg.sft_completion_key not in info.schema.names:
            raise _layout_error(files, cfg, [info])
    return plan


def _layout_error(files: FilesArg, cfg: DataConfig, infos: list | None = None) -> SourceError:
    """The error for a file with neither conversation layout, naming its columns and the ones expected (the footers
    are read again: this is the failure path only)."""
    expected = (
        f"expected a {cfg.sft_messages_key!r} column (data.sft_messages_key), or {cfg.prompt_key!r} + "
        f"{cfg.sft_completion_key!r} columns (data.prompt_key, data.sft_completion_key)"
    )
    if infos is None:
        infos = inspect_files(expand_files(files, cfg.storage_options), cfg.storage_options)
    for info in infos:
        names = info.schema.names
        if cfg.sft_messages_key not in names and not {cfg.prompt_key, cfg.sft_completion_key} <= set(names):
            return SourceError(
                f"no conversation columns: found {', '.join(map(repr, names)) or 'none'}; {expected}",
                file=printable_path(info.path),
                column=cfg.sft_messages_key,
            )
    return SourceError(  # each file has one layout, but not all the same one
        f"the files mix the two conversation layouts; {expected}, the same in every file",
        file=printable_path(infos[0].path) if infos else None,
        column=cfg.sft_messages_key,
    )


def build_sft_dataset(
    files: FilesArg,
    tokenizer: Any,
    config: DataConfig | Mapping[str, Any] | None = None,
    processor: Any = None,
    *,
    epoch: int = 0,
    ledger=None,
    plan: InputPlan | None = None,
    role_to_mask: Callable[[Mapping[str, Any]], bool] | None = None,
    content_sft_roles: Collection[str] | None = None,
    no_target: str = "drop",
) -> ray.data.Dataset:
    """A Ray Dataset of SFT training rows for the conversations in ``files``.

    Input columns: ``messages`` (``sft_messages_key``: a message list, or its JSON string), else ``prompt`` +
    ``completion`` (message lists, or strings: one user / one assistant message); optional ``tools`` (list or JSON
    string), ``images`` (values for ``{"type": "image"}`` parts, or for ``<image>`` markers in string content:
    HF ``Image()`` structs, bytes or paths) and ``videos`` (frame lists).

    Output rows (Arrow, no Python objects): ``input_ids``, ``target_ids`` (the next token), ``loss_mask`` (aligned
    with ``target_ids``), ``seq_lens`` (the samples in the row; one entry unless ``sft_pack_token_budget`` > 0)
    and, with a ``processor``, ``mm_token_type_ids`` (null for text rows), ``image_placeholders`` /
    ``image_hashes`` / ``pixel_values`` / ``image_grid_thw``, the same for videos, and ``dropped_media`` (items cut
    off by ``sft_max_length``). ``SFTCollate`` turns batches into padded torch tensors, ``PrimeRLCollate`` into
    prime-rl's SFT micro batches.

    ``tokenizer`` / ``processor``: as ``build_dataset`` (a directory, hub name, None = the embedded Qwen2-VL
    tokenizer), or loaded transformers objects (a tokenizer, fast or slow; a processor, which as ``tokenizer`` is
    also the processor unless one is given). Objects are never pickled to the actors: a tokenizer loaded from a local
    directory and unchanged since is passed as that directory; anything else is saved once to a temporary model
    directory the actors load (``actors.sft.SavedModel``). ``role_to_mask`` / ``content_sft_roles``: as
    ``build_training_sample`` (``role_to_mask`` picklable; required for non-ChatML templates). ``no_target``:
    ``drop`` (default, prime-rl's rule) or ``keep`` samples whose window holds no trained target; dropped ones are
    counted as ``dropped_no_target``. ``ledger``: a ``RunLedger`` that receives per-batch counts (rows in = samples
    out + filtered + quarantined + dropped_no_target). Bad conversations are quarantined (``on_bad_row:
    quarantine``) or raise ``BadRowError``.
    """
    cfg = DataConfig.from_any(config)
    check_sft_config(cfg)
    if no_target not in NO_TARGET_POLICIES:
        raise ValueError(f"no_target must be one of {', '.join(NO_TARGET_POLICIES)}, got {no_target!r}")
    if processor is None and is_processor_object(tokenizer):
        processor = tokenizer  # create_renderer's reading of a processor given as the tokenizer
    for model, what in ((tokenizer, "tokenizer"), (processor, "processor")):
        if model is None or isinstance(model, str | os.PathLike):
            check_model_path(model, what)
    plan = plan or plan_sft_input(files, cfg, epoch=epoch, multimodal=processor is not None)
    from actors import SFTRenderActor, SFTVisionActor

    tokenizer = model_for_actors(tokenizer, "tokenizer")
    processor = model_for_actors(processor, "processor")
    context = plan.context(ledger)
    render = {
        "config": cfg,
        "context": context,
        "tokenizer": tokenizer,
        "processor": processor,
        "role_to_mask": role_to_mask,
        "content_sft_roles": frozenset(content_sft_roles) if content_sft_roles else None,
        "no_target": no_target,
    }
    # one read unit per call; the actor batches (and packs) by tokenizer_batch_size
    ds = read_units_into_pool(plan, cfg, context, SFTRenderActor, render, epoch=epoch)
    if processor is None:
        return ds
    return map_on_pool(ds, cfg, "vision", SFTVisionActor, {"config": cfg, "context": context, "processor": processor})


# saved tokenizer / processor objects of this driver: (what they looked like when saved, the SavedModel)
_SAVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_for_actors(model: Any, what: str = "tokenizer") -> Any:
    """What the actors load for ``model``: paths and names as they are (as strings); a transformers tokenizer loaded
    from a local directory and unchanged since (same chat template, special tokens, vocabulary and ids) as that
    directory; any other tokenizer or processor object saved once to a temporary directory (``SavedModel``).

    Objects are never pickled to the actors: a tokenizer can be large, can hold state that does not pickle, and its
    class may not even be importable where the actors run.
    """
    if model is None or isinstance(model, str | os.PathLike):
        return None if model is None else os.fspath(model)
    if isinstance(model, ChatTokenizer):
        return model.path
    if isinstance(model, HFChatTokenizer):
        model = model._hf
    if not (is_tokenizer_object(model) or is_processor_object(model) or hasattr(model, "save_pretrained")):
        raise TypeError(
            f"{what} must be a path, a hub name or a transformers {what} object, got {type(model).__name__}"
        )
    name = getattr(model, "name_or_path", "") or ""
    if is_tokenizer_object(model) and name and os.path.isdir(name) and _same_tokenizer(model, name):
        return name
    fingerprint = _fingerprint(model)
    try:
        saved = _SAVED.get(model)
    except TypeError:  # not weakly referenceable: no reuse
        saved = None
    if saved is not None and saved[0] == fingerprint:
        return saved[1]
    from actors.sft import SAVED_MODEL_MARKER, SavedModel

    directory = tempfile.mkdtemp(prefix=f"ray-ingest-{what}-")
    atexit.register(shutil.rmtree, directory, True)
    try:
        model.save_pretrained(directory)
    except Exception as exc:
        raise ValueError(
            f"cannot hand the {what} object ({type(model).__name__}) to the actors: its name_or_path {name!r} is not a "
            f"local directory holding the same {what}, and save_pretrained failed ({type(exc).__name__}: {exc}); "
            f"pass a {what} directory or hub name"
        ) from exc
    files = {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(Path(directory).rglob("*"))
        if path.is_file()
    }
    digest = hashlib.sha256()
    for rel, data in files.items():
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    (Path(directory) / SAVED_MODEL_MARKER).write_text(digest.hexdigest())
    from ingest.datasets.pools import ensure_ray

    ensure_ray()
    saved_model = SavedModel(directory, digest.hexdigest(), ray.put(files))
    try:
        _SAVED[model] = (fingerprint, saved_model)
    except TypeError:
        pass
    return saved_model


def _fingerprint(model: Any) -> tuple:
    """What a saved object looked like: a changed template or vocabulary means saving again."""
    tokenizer = getattr(model, "tokenizer", model)
    template = getattr(model, "chat_template", None)
    vocabulary = len(tokenizer) if is_tokenizer_object(tokenizer) else None
    special = sorted(getattr(tokenizer, "special_tokens_map", {}).items(), key=str) if vocabulary else None
    return (type(model).__name__, str(template), vocabulary, str(special))


def _same_tokenizer(model: Any, directory: str) -> bool:
    """Whether ``directory`` loads the tokenizer ``model`` is, as far as a render can tell: chat template, the eos
    token (the fallback's stop token) and the special tokens the template names, vocabulary size and the ids of a
    probe holding every added token.

    Other special tokens are not compared: transformers fills in class defaults the directory does not hold (a
    loaded Qwen2 tokenizer has ``unk_token`` ``<|endoftext|>``, its directory none), and a template that does not
    name them renders the same without them."""
    try:
        loaded = ChatTokenizer(directory)
    except Exception:
        return False
    ours = HFChatTokenizer(model)
    template = ours.chat_template
    if not isinstance(template, str) or template != loaded.chat_template:
        return False
    keys = {k for k in (*ours.special_tokens_map, *loaded.special_tokens_map) if k == "eos_token" or k in template}
    if any(ours.special_tokens_map.get(k) != loaded.special_tokens_map.get(k) for k in keys):
        return False
    backend = getattr(loaded, "_backend", None)
    size = backend.get_vocab_size(with_added_tokens=True) if backend is not None else len(loaded._hf)
    if size != len(model):
        return False
    added = "".join(str(t) for t in getattr(model, "added_tokens_decoder", {}).values())
    probe = f"Hello, world! 123 \u00fc\u4e2d\n\n  x{added}"
    return ours.encode_batch([probe]) == loaded.encode_batch([probe])


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat values, per-row lengths, per-row validity) of a list column (slices and nulls handled)."""
    array = contiguous(column)
    valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    lengths = np.asarray(array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    return array.flatten().to_numpy(zero_copy_only=False), lengths, valid


class SFTCollate(ArrowBatchCollateFn):
    """``iter_torch_batches(collate_fn=SFTCollate())``: rows of ``build_sft_dataset`` -> a dict of torch tensors.

    Right-padded to the batch's longest row (``pad_to``: a fixed length, an error when a row is longer;
    ``pad_to_multiple_of``: round up). ``input_ids`` (B, T) long padded with ``pad_token_id``; ``target_ids``
    padded with ``ignore_index``; ``loss_mask`` (B, T) bool, False on padding; ``attention_mask`` (B, T) long;
    ``position_ids`` (B, T) long, restarting at 0 for every packed sample (0 on padding); ``seq_lens`` (B, K) long,
    the samples per row, zero-padded. With a processor: ``mm_token_type_ids`` (B, T) long (0 for text rows),
    ``pixel_values`` / ``image_grid_thw`` (and the video ones) concatenated over the batch's rows in order, present
    when the batch has such media.
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        ignore_index: int = -100,
        pad_to: int | None = None,
        pad_to_multiple_of: int | None = None,
        device: str | None = None,
    ):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index
        self.pad_to = pad_to
        self.pad_to_multiple_of = pad_to_multiple_of
        self.device = device

    def __call__(self, batch: pa.Table) -> dict:
        import torch

        ids, lengths, _ = _flat(batch.column("input_ids"))
        n = batch.num_rows
        width = int(lengths.max()) if n else 0
        if self.pad_to is not None:
            if width > self.pad_to:
                raise ValueError(f"a row of {width} tokens does not fit pad_to={self.pad_to}")
            width = self.pad_to
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        real = np.arange(width)[None, :] < lengths[:, None]

        def padded(values: np.ndarray, fill, dtype, where=real) -> np.ndarray:
            out = np.full((n, width), fill, dtype=dtype)
            out[where] = values
            return out

        seq_lens, members, _ = _flat(batch.column("seq_lens"))
        starts = np.cumsum(seq_lens) - seq_lens
        positions = np.arange(int(seq_lens.sum()), dtype=np.int64) - np.repeat(starts, seq_lens)
        seq_table = np.zeros((n, int(members.max()) if n else 0), dtype=np.int64)
        seq_table[np.arange(seq_table.shape[1])[None, :] < members[:, None]] = seq_lens
        out = {
            "input_ids": padded(ids, self.pad_token_id, np.int64),
            "target_ids": padded(_flat(batch.column("target_ids"))[0], self.ignore_index, np.int64),
            "loss_mask": padded(_flat(batch.column("loss_mask"))[0], False, np.bool_),
            "attention_mask": real.astype(np.int64),
            "position_ids": padded(positions, 0, np.int64),
            "seq_lens": seq_table,
        }
        if "mm_token_type_ids" in batch.column_names:
            types, _, valid = _flat(batch.column("mm_token_type_ids"))
            out["mm_token_type_ids"] = padded(types, 0, np.int64, real & valid[:, None])
        tensors = {k: torch.from_numpy(v) for k, v in out.items()}
        for key in MEDIA_TENSOR_COLUMNS:
            if key in batch.column_names:
                records = [r for r in batch.column(key).to_pylist() if r is not None]
                if records:
                    tensors[key] = torch.from_numpy(np.concatenate([tensor_from_record(r) for r in records]))
        if self.device is not None:
            tensors = {k: v.to(self.device) for k, v in tensors.items()}
        return tensors


class PrimeRLCollate(ArrowBatchCollateFn):
    """``iter_torch_batches(batch_size=1, collate_fn=PrimeRLCollate(seq_len))``: one packed row -> the micro batch
    prime-rl's SFT trainer reads (its ``CatDataset`` pack finalized and ``cat_collate``d).

    ``input_ids`` / ``target_ids`` / ``position_ids`` (1, T) long and ``loss_mask`` (1, T) bool, right-padded to
    ``seq_len`` (None: no padding) with 0, 0, ``range(pad)`` and False; ``seq_lens`` (K,) long, the packed samples
    with the padding added to the last one (how prime-rl's varlen attention sees it); ``mm_kwargs``: the row's
    ``pixel_values`` / ``image_grid_thw`` (and video ones) or None; ``mm_token_type_ids`` (1, T) long, 0 on text
    members and padding, or None when the row has no media. Rows are packed with ``sft_pack_token_budget`` (=
    prime-rl's ``seq_len * micro_batch_size``); packing stays within one render-actor batch, where prime-rl's packs
    run across the whole stream.
    """

    def __init__(self, seq_len: int | None = None, device: str | None = None):
        super().__init__()
        self.seq_len = seq_len
        self.device = device

    def __call__(self, batch: pa.Table) -> dict:
        import torch

        if batch.num_rows != 1:
            raise ValueError(f"prime-rl's micro batch is one packed row: use batch_size=1, got {batch.num_rows} rows")
        ids = _flat(batch.column("input_ids"))[0].astype(np.int64)
        seq_lens = _flat(batch.column("seq_lens"))[0].astype(np.int64)
        n = len(ids)
        pad = 0 if self.seq_len is None else self.seq_len - n
        if pad < 0:
            raise ValueError(f"a row of {n} tokens does not fit seq_len={self.seq_len}")
        positions = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
        if pad:
            seq_lens = seq_lens.copy()
            seq_lens[-1] += pad

        def row(values: np.ndarray, fill, dtype, tail: np.ndarray | None = None) -> torch.Tensor:
            out = np.concatenate([values.astype(dtype), tail if tail is not None else np.full(pad, fill, dtype)])
            return torch.from_numpy(out).unsqueeze(0)

        out: dict[str, Any] = {
            "input_ids": row(ids, 0, np.int64),
            "position_ids": row(positions, 0, np.int64, np.arange(pad, dtype=np.int64)),
            "loss_mask": row(_flat(batch.column("loss_mask"))[0], False, np.bool_),
            "target_ids": row(_flat(batch.column("target_ids"))[0], 0, np.int64),
            "seq_lens": torch.from_numpy(seq_lens),
            "mm_kwargs": None,
            "mm_token_type_ids": None,
        }
        media = {}
        for key in MEDIA_TENSOR_COLUMNS:
            if key in batch.column_names and (record := batch.column(key)[0].as_py()) is not None:
                media[key] = torch.from_numpy(tensor_from_record(record))
        if media:
            out["mm_kwargs"] = media
            # prime-rl's packs carry mm_token_type_ids only once a member has media: a row whose images were all
            # cut off by the sequence limit has all-zero types here, and None there
            out["mm_token_type_ids"] = row(_flat(batch.column("mm_token_type_ids"))[0], 0, np.int64)
        if self.device is not None:
            for key, value in out.items():
                if isinstance(value, torch.Tensor):
                    out[key] = value.to(self.device)
                elif value is not None:
                    out[key] = {name: tensor.to(self.device) for name, tensor in value.items()}
        return out
