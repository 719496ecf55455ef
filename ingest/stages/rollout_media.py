"""The vision stage of verl 0.7 / 0.9 rows with ``media_handoff``: each prompt's media made once for the rollout.

verl's agent loop makes a prompt's media again for every sample (``ingest/rollout_media.py`` says what and where).
Here the vision actors make them once per prompt: image prompts with the pipeline's kernels
(``ingest.rollout_media_kernels``), the rest with verl's own functions (``PromptMediaMaker``, loaded on first need).
Each prompt's payload goes to the read's ``MediaStore`` actor (which outlives this actor and owns what it holds)
under a fresh key, with the prompt's file and row. The row's media items become that payload's URIs, the key goes in
a column of its own (the loader tells the store which rows it took) and the decoded images leave the block. The store
may make this actor wait (it bounds the media made ahead of the loader). A prompt that cannot be made (the kernels',
the processor's or qwen-vl-utils' error) is a bad row, quarantined or raised with file, row and reason, as in the
other stages.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pyarrow as pa

from ingest.accounting import BatchCounts, StageResult, processed_row
from ingest.blocks import (
    FILE_COLUMN,
    MEDIA_KEY_COLUMN,
    MULTI_MODAL_DATA,
    PROMPT_TOKENS_COLUMN,
    ROW_COLUMN,
    STRUCT_IMAGE_BYTES_COLUMN,
    drop_internal_columns,
)
from ingest.config import DataConfig, StageContext
from ingest.rowformat.collate import filled_raw_prompt
from ingest.stages.bad_rows import BadRows


def verl_data_section(config: DataConfig) -> dict:
    """What verl's media functions read of its ``data:`` section."""
    return {
        "apply_chat_template_kwargs": dict(config.apply_chat_template_kwargs),
        "mm_processor_kwargs": dict(config.mm_processor_kwargs),
    }


class RolloutMediaStage:
    """Decoded verl 0.9 rows -> the same rows with media URIs, each prompt's payload in the object store."""

    def __init__(
        self,
        processor_path: str,
        config: DataConfig,
        context: StageContext,
        adopt: Callable[[list[tuple[str, int, int]], list[dict]], None] | None = None,
    ):
        from ingest.rollout_media import check_handoff_release
        from ingest.rollout_media_kernels import KernelMediaMaker

        if context.media_store is None:
            raise ValueError("media_handoff: the run has no media store (made by the loader that reads these rows)")
        check_handoff_release()
        self.processor_path, self.data = processor_path, verl_data_section(config)
        self.kernels = KernelMediaMaker.for_model(processor_path, self.data)
        self._verl_maker = None  # PromptMediaMaker, loaded for the first prompt the kernels do not make
        self.store_name = context.media_store
        self.files, self.on_bad_row = list(context.files), config.on_bad_row
        self.keep_provenance = context.keep_provenance
        self._store = None
        # where a block's payloads go: the store's adopt_many (default), or the store's own hold where it runs this
        self.adopt = adopt or self._adopt_remotely

    def payloads(self, prompts: list[list[dict]]) -> list[dict | Exception]:
        """Media prompts' payloads (``encode_payload``'s form), or each one's error: the kernels' where they make
        them, else verl's."""
        from ingest.rollout_media import PromptMediaMaker, encode_payload

        made = self.kernels.make_many(prompts) if self.kernels is not None else [None] * len(prompts)
        for i, payload in enumerate(made):
            if payload is None:
                try:
                    if self._verl_maker is None:
                        self._verl_maker = PromptMediaMaker(self.processor_path, self.data)
                    made[i] = encode_payload({**self._verl_maker.make(prompts[i]), "made_by": "verl"})
                except Exception as exc:
                    made[i] = exc
        return made

    @property
    def store(self):
        if self._store is None:
            import ray

            from ingest.rollout_media import NAMESPACE

            self._store = ray.get_actor(self.store_name, namespace=NAMESPACE)
        return self._store

    def _adopt_remotely(self, held: list[tuple[str, int, int]], payloads: list[dict]) -> None:
        import ray

        ray.get(self.store.adopt_many.remote(held, [ray.put(payloads)]))  # one put per block: each costs ~1 ms

    def process(self, table: pa.Table) -> StageResult:
        from ingest.rollout_media import handle_items, media_items

        bad = BadRows(self.files, table, "raw_prompt")
        rows = filled_raw_prompt(table)
        held: list[tuple[str, int, int]] = []
        payloads: list[dict] = []
        keys: list[str | None] = [None] * len(rows)
        files, file_rows = table.column(FILE_COLUMN).to_pylist(), table.column(ROW_COLUMN).to_pylist()
        media_rows = [i for i, messages in enumerate(rows) if media_items(messages)]  # text prompts: none to make
        for i, payload in zip(media_rows, self.payloads([rows[i] for i in media_rows]), strict=True):
            if isinstance(payload, Exception):
                bad.add(i, f"the rollout's media could not be made: {type(payload).__name__}: {payload}")
                continue
            keys[i] = uuid.uuid4().hex
            held.append((keys[i], files[i], file_rows[i]))
            payloads.append(payload)
            handle_items(rows[i], self.store_name, keys[i])
        bad.raise_first(self.on_bad_row)
        if held:  # registered before any consumer can see the rows
            self.adopt(held, payloads)
        kept = bad.kept()
        # the decode stage left the rows to this one to count (media_handoff): rows out and their prompt tokens
        tokens = table.column(PROMPT_TOKENS_COLUMN).to_numpy()
        counts = BatchCounts(rows_out=len(kept), quarantined=len(bad), prompt_tokens=int(tokens[kept].sum()))
        quarantine = bad.quarantine(processed_row)
        media_columns = (MULTI_MODAL_DATA, STRUCT_IMAGE_BYTES_COLUMN)
        out = table.drop_columns([c for c in media_columns if c in table.column_names])
        if len(kept) < table.num_rows:  # a bad row's messages still hold its decoded media: none go on
            out = out.take(kept)
        messages = pa.array([json.dumps(rows[i], ensure_ascii=False) for i in kept], pa.string())
        out = out.set_column(out.column_names.index("raw_prompt"), "raw_prompt", messages)
        out = out.append_column(MEDIA_KEY_COLUMN, pa.array([keys[i] for i in kept], pa.string()))
        return StageResult(drop_internal_columns(out, self.keep_provenance), counts, quarantine)
