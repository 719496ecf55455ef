"""``row_format: verl-0.6`` against verl 0.6.1 itself: same keys, dtypes, shapes, values, row count and order, batch
by batch: text prompts, and image prompts with Qwen2-VL and Qwen2.5-VL processors ((4, M) positions)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest import DataConfig, VerlCollate, build_dataset
from ingest.demo import gsm8k_rows
from ingest.devtools.oracle import oracle_available
from ingest.devtools.samples import qwen25_vl_model_dir, write_video_parquet
from tests.support import formats
from tests.support.compare import assert_same_batches
from tests.test_parity_text import BATCH, CONFIGS

ROW_FORMAT = "verl-0.6"
pytestmark = pytest.mark.skipif(
    not oracle_available(ROW_FORMAT), reason="verl 0.6.1 oracle not installed (make oracle)"
)


def _ours(files, model_dir, config: dict, processor=None, batch_size: int = BATCH) -> list[dict]:
    return formats.ours(files, model_dir, config, ROW_FORMAT, batch_size, processor)


def _verl(files, model_dir, configs: list[dict], cache, processor=None, batch_size: int = BATCH) -> list[dict]:
    return formats.verl(files, model_dir, configs, cache, ROW_FORMAT, batch_size, processor)


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


def test_unknown_row_formats_are_refused():
    with pytest.raises(ValueError, match="row_format must be one of"):
        DataConfig(row_format="verl-0.7")
    with pytest.raises(ValueError, match="row_format must be one of"):
        VerlCollate(row_format="0.6")


IMAGE_CONFIGS = [
    {"truncation": "left", "filter_overlong_prompts": True, "return_raw_chat": True, "max_prompt_length": 640},
    {"truncation": "right", "filter_overlong_prompts": True, "return_full_prompt": True, "max_prompt_length": 1536},
    # verl 0.6's apply_chat_template_kwargs: the Qwen2-VL template's own variable numbers the pictures
    {"truncation": "left", "filter_overlong_prompts": True, "apply_chat_template_kwargs": {"add_vision_id": True}},
]


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_image_rows_equal_verl_06(ray_session, geo3k_files, model_dir, tmp_path_factory, family):
    """Every image kind through the processor path: (4, M) positions (a text row, pads 1, over the three rope rows),
    PIL images, ``pixel_values`` and grids exactly verl 0.6.1's; Qwen2.5-VL with its larger pixel budget."""
    model = model_dir if family == "qwen2-vl" else qwen25_vl_model_dir(tmp_path_factory.mktemp("qwen25-vl"), model_dir)
    runs = _verl(geo3k_files, model, IMAGE_CONFIGS, tmp_path_factory.mktemp("verl-cache"), model, batch_size=8)
    for config, expected in zip(IMAGE_CONFIGS, runs, strict=True):
        assert "error" not in expected, expected.get("error")
        ours = _ours(geo3k_files, model, config, processor=model, batch_size=8)
        assert ours[0]["position_ids"].shape[1] == 4
        assert_same_batches(ours, expected["batches"])


def test_videos_and_other_processors_are_refused_before_reading(ray_session, model_dir, tmp_path):
    """verl 0.6's video tuples and Qwen3-VL positions are not built: one error naming them, before any data is read."""
    files = write_video_parquet(tmp_path / "videos", 4, kind="frames")
    with pytest.raises(ValueError, match="video tuples are not built"):
        build_dataset(files, model_dir, {"row_format": ROW_FORMAT}, processor=model_dir)
    qwen3 = tmp_path / "qwen3-vl"
    qwen25_vl_model_dir(qwen3, model_dir)
    config = qwen3 / "processor_config.json"
    config.write_text(config.read_text().replace("Qwen2_5_VLProcessor", "Qwen3VLProcessor"))
    with pytest.raises(ValueError, match="is a Qwen3VLProcessor"):
        build_dataset(files, model_dir, {"row_format": ROW_FORMAT}, processor=str(qwen3))
