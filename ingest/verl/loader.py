"""``VerlDataLoader``: what verl's ``RayPPOTrainer`` gets as ``train_dataloader`` / ``val_dataloader``.

verl uses three things of its ``StatefulDataLoader``: iteration (collated batches, one epoch per ``iter()``),
``len()`` (batches per epoch: ``total_training_steps = len(train_dataloader) * total_epochs``, the optimizers'
schedules, the epoch of a resumed step) and ``state_dict()`` / ``load_state_dict()`` (``torch.save`` to each
checkpoint's ``data.pt``, ``torch.load`` on resume). ``PromptStream`` gives the first and the last; ``len()`` is the
exact epoch count (``length.count_rows``), never a footer bound that the filter or quarantine could undercut.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg
from ingest.stream import PromptStream


class VerlDataLoader(PromptStream):
    """Collated batches of ``config.row_format`` over ``files`` for verl's trainer, with ``len()`` and a ``data.pt``
    state.

    ``batch_size``: verl's ``gen_batch_size or train_batch_size`` (train) or ``val_batch_size`` (val; None: the whole
    set in one batch, as verl). ``drop_last``: True for training, as verl. ``num_rows``: rows per epoch when known (a
    previous run's summary ``rows_out``); else counted once and cached (``length.count_rows``). The order is the
    pipeline's seeded order (``shuffle`` / ``seed``), not torch's ``RandomSampler``'s; with ``shuffle`` off it is the
    input order, as verl's sequential sampler.
    """

    def __init__(
        self,
        files: FilesArg,
        tokenizer: str | os.PathLike | None,
        config: DataConfig | Mapping[str, Any] | None,
        batch_size: int | None,
        processor: str | os.PathLike | None = None,
        *,
        drop_last: bool = True,
        num_rows: int | None = None,
        collate_fn=None,
        ledger=None,
    ):
        super().__init__(
            files,
            tokenizer,
            config,
            batch_size or 1,
            processor,
            collate_fn=collate_fn,
            drop_last=drop_last,
            ledger=ledger,
        )
        self._num_rows = num_rows
        # verl 0.5 to 0.7's fit updates a curriculum sampler after each step if the loader has one; the order here is
        # the pipeline's (seeded per epoch), so there is none
        self.sampler = None
        if batch_size is None:  # verl's val loader: every row in one batch
            self.batch_size = max(1, self.num_rows)

    @property
    def num_rows(self) -> int:
        """Rows one epoch yields (after the filter and quarantine): given, else counted once and cached."""
        if self._num_rows is None:
            from ingest.verl.length import count_rows

            self._num_rows = count_rows(self.files, self.tokenizer, self.config, self.processor)
        return self._num_rows

    def __len__(self) -> int:
        rows = self.num_rows
        return rows // self.batch_size if self.drop_last else math.ceil(rows / self.batch_size)
