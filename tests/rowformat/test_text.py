"""Text rows (``ingest/rowformat/text.py``): padding and positions as verl computes them."""

from __future__ import annotations

import numpy as np


def test_pad_flat_matches_verls_padding_and_positions():
    from ingest.rowformat.text import flatten_ids, pad_flat

    rows = [[5, 6, 7], [], [1, 2, 3, 4, 5, 6], [9]]
    input_ids, mask, positions = pad_flat(*flatten_ids(rows), 6, 0)
    for ids, row, row_mask, row_positions in zip(rows, input_ids, mask, positions, strict=True):
        expected_mask = [0] * (6 - len(ids)) + [1] * len(ids)
        assert row.tolist() == [0] * (6 - len(ids)) + ids and row_mask.tolist() == expected_mask
        # verl's compute_position_id_with_mask
        assert row_positions.tolist() == np.clip(np.cumsum(expected_mask) - 1, 0, None).tolist()
    assert input_ids.dtype == mask.dtype == positions.dtype == np.int64
