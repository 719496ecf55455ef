"""``row_format: verl-0.6`` against verl 0.6.1 itself: same keys, dtypes, shapes, values, row count and order, batch
by batch (text prompts; the processor path is not built yet and says so)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest import DataConfig, VerlCollate, build_dataset
from ingest.demo import gsm8k_rows
from ingest.devtools.oracle import oracle_available, run_verl
from tests.support.compare import assert_same_batches
from tests.test_parity_text import BATCH, CONFIGS

ROW_FORMAT = "verl-0.6"
pytestmark = pytest.mark.skipif(
    not oracle_available(ROW_FORMAT), reason="verl 0.6.1 oracle not installed (make oracle)"
)


def _ours(files, model_dir, config: dict) -> list[dict]:
    ds = build_dataset(files, model_dir, {**config, "shuffle": False, "row_format": ROW_FORMAT})
    return list(ds.iter_torch_batches(batch_size=BATCH, collate_fn=VerlCollate(row_format=ROW_FORMAT)))


def _verl(files, model_dir, configs: list[dict], cache) -> list[dict]:
    configs = [{**c, "cache_dir": str(cache)} for c in configs]
    return run_verl("rows", files, model_dir, None, configs=configs, batch_size=BATCH, row_format=ROW_FORMAT)["runs"]


@pytest.fixture(scope="module")
def oracle_runs(variety_files, model_dir, tmp_path_factory):
    return _verl(variety_files, model_dir, CONFIGS, tmp_path_factory.mktemp("verl-cache"))


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[str(c) for c in CONFIGS])
def test_text_rows_equal_verl_06(ray_session, variety_files, model_dir, oracle_runs, index):
    expected = oracle_runs[index]
    assert "error" not in expected, expected.get("error")
    assert_same_batches(_ours(variety_files, model_dir, CONFIGS[index]), expected["batches"])


def test_rows_without_or_with_null_extra_info_equal_verl_06(ray_session, model_dir, tmp_path):
    """verl 0.6.1 gives every row an ``extra_info`` dict, ``{}`` where the column is missing or the value null (0.5.0
    leaves a missing column out and crashes on a null one)."""
    rows = gsm8k_rows(40, variety=True, long_every=9)
    without = [{k: v for k, v in row.items() if k != "extra_info"} for row in rows]
    with_nulls = [{**row, "extra_info": None} if i % 3 == 0 else row for i, row in enumerate(rows)]
    files = []
    for name, table_rows in (("no-extra-info", without), ("null-extra-info", with_nulls)):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(table_rows), path, row_group_size=16)
        files.append(str(path))
    config = {"truncation": "left", "filter_overlong_prompts": True}
    for path in files:
        expected = _verl([path], model_dir, [config], tmp_path / "verl-cache")[0]
        assert "error" not in expected, expected.get("error")
        assert_same_batches(_ours([path], model_dir, config), expected["batches"])


def test_the_processor_path_is_refused_until_it_is_built(model_dir):
    with pytest.raises(ValueError, match="row_format verl-0.6 is built for text prompts so far"):
        build_dataset(["unused.parquet"], model_dir, {"row_format": ROW_FORMAT}, processor=model_dir)


def test_unknown_row_formats_are_refused():
    with pytest.raises(ValueError, match="row_format must be one of"):
        DataConfig(row_format="verl-0.7")
    with pytest.raises(ValueError, match="row_format must be one of"):
        VerlCollate(row_format="0.6")
