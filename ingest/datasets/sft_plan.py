"""``plan_sft_input``: ``plan_input`` for conversations, which come in one of two column layouts."""

from __future__ import annotations

import dataclasses

from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan, plan_input
from ingest.errors import SourceError
from ingest.read.files import expand_files, inspect_files, printable_path


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
