"""A dataset's rows as verl batches."""

from __future__ import annotations


def collect(ds, batch_size=16, **collate_kwargs):
    from ingest import VerlCollate

    return list(ds.iter_torch_batches(batch_size=batch_size, collate_fn=VerlCollate(**collate_kwargs)))
