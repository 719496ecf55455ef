"""The SFT render actor: renderers' renderer built once (reads are fused into it).

Models reach the actors as paths or hub names, never as pickled objects. A tokenizer or processor object given on the
driver arrives as a ``SavedModel``: the directory the driver saved it to once, which an actor on another node (where
that directory does not exist) rebuilds from the files the driver put in the object store.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ingest.config import DataConfig, StageContext
from ingest.memory import use_arrow_memory_pool
from ingest.sft.engine import SampleBuilder
from ingest.stages.sft import SFTRenderStage
from ingest.stats import stage_unit
from ingest.tokenizer.offline import resolve_model_path

SAVED_MODEL_MARKER = ".ray-ingest-saved-model"  # holds the digest of the directory's files


@dataclass(frozen=True)
class SavedModel:
    """A model directory the driver saved a tokenizer / processor object to: ``path`` on the driver's node,
    ``digest`` of its files, ``files`` an object ref of ``{relative path: bytes}`` for actors on other nodes."""

    path: str
    digest: str
    files: Any


def local_model_path(model: str | SavedModel | None) -> str | None:
    """A path or name this actor can load: a ``SavedModel``'s directory where this node has it, else the same files
    written once per node (under the temp directory, named by their digest; concurrent actors race harmlessly)."""
    if not isinstance(model, SavedModel):
        return model
    if _holds(Path(model.path), model.digest):
        return model.path
    out = Path(tempfile.gettempdir()) / "ray-ingest-models" / model.digest
    if _holds(out, model.digest):
        return str(out)
    import ray

    files = ray.get(model.files)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    for name, data in files.items():
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (tmp / SAVED_MODEL_MARKER).write_text(model.digest)
    try:
        tmp.rename(out)
    except OSError:  # another actor on this node wrote the same files first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _holds(path: Path, digest: str) -> bool:
    marker = path / SAVED_MODEL_MARKER
    return marker.is_file() and marker.read_text() == digest


class SFTRenderActor:
    """``tokenizer``: the directory (or hub name) the renderer's tokenizer loads from; a multimodal renderer loads its
    processor from the same place (renderers' rule). ``renderer_config``: a renderers config."""

    def __init__(
        self,
        config: DataConfig,
        context: StageContext,
        tokenizer: str | SavedModel | None,
        renderer_config: Any,
        role_to_mask: Callable | None = None,
        content_sft_roles: Collection[str] | None = None,
        ensure_final_stop: bool = False,
        no_target: str = "drop",
    ):
        from transformers import AutoTokenizer

        use_arrow_memory_pool(config.arrow_memory_pool)
        path = resolve_model_path(local_model_path(tokenizer))
        hf = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        build = SampleBuilder(
            hf,
            renderer_config,
            role_to_mask=role_to_mask,
            content_sft_roles=content_sft_roles,
            ensure_final_stop=ensure_final_stop,
        )
        self.stage = SFTRenderStage(
            build, config, context, media=build.renderers.is_multimodal(build.renderer), no_target=no_target
        )
        self.ledger = context.ledger
        self.batch_size = config.tokenizer_batch_size

    def __call__(self, unit: pa.Table) -> Iterator[pa.Table]:
        return stage_unit(self.stage, unit, self.batch_size, self.ledger)
