"""``VerlCollate`` (``ingest/rowformat/collate.py``) on a plain Arrow table: verl's defaults, one-dimensional arrays."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ingest import VerlCollate


def test_collate_defaults_and_one_dimensional_arrays():
    table = pa.table({"raw_prompt_ids": [[1, 2], [3, 4]], "data_source": ["a", "b"]})
    verl_style = VerlCollate()(table)
    assert verl_style["raw_prompt_ids"].shape == (2, 2)  # verl 0.5.0: np.array(values, dtype=object)
    flat = VerlCollate(one_dimensional=True)(table)
    assert flat["raw_prompt_ids"].shape == (2,) and flat["raw_prompt_ids"][0] == [1, 2]
    assert list(verl_style["index"]) == [0, 0] and list(verl_style["tools_kwargs"]) == [{}, {}]
    assert verl_style["tools_kwargs"][0] is not verl_style["tools_kwargs"][1]
    assert isinstance(verl_style["data_source"], np.ndarray) and verl_style["data_source"].dtype == object
