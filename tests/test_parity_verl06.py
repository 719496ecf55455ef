"""``row_format: verl-0.6`` against verl 0.6.1 itself: same keys, dtypes, shapes, values, row count and order, batch
by batch: text prompts; image prompts with Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors and video prompts (frame lists
and files) with Qwen2-VL, Qwen2.5-VL and Qwen3-VL ((4, M) positions; Qwen3-VL's per-frame timestamps)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest import DataConfig, VerlCollate, build_dataset
from ingest.demo import gsm8k_rows
from tests.support import formats
from tests.support.compare import assert_same_batches
from tests.support.tiers import first_fast, first_in_matrix, slow
from tests.test_parity_text import BATCH, CONFIGS
from tools.oracle import oracle_available
from tools.samples import qwen3_vl_model_dir, qwen25_vl_model_dir, write_video_parquet

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


@pytest.mark.parametrize("index", first_fast(range(len(CONFIGS)), ids=[str(c) for c in CONFIGS], matrix=True))
def test_text_rows_equal_verl_06(ray_session, variety_files, model_dir, oracle_runs, index):
    expected = oracle_runs[index]
    assert "error" not in expected, expected.get("error")
    assert_same_batches(_ours(variety_files, model_dir, CONFIGS[index]), expected["batches"])


@slow
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
        DataConfig(row_format="verl-0.8")
    with pytest.raises(ValueError, match="row_format must be one of"):
        VerlCollate(row_format="0.6")


IMAGE_CONFIGS = [
    {"truncation": "left", "filter_overlong_prompts": True, "return_raw_chat": True, "max_prompt_length": 640},
    {"truncation": "right", "filter_overlong_prompts": True, "return_full_prompt": True, "max_prompt_length": 1536},
    # verl 0.6's apply_chat_template_kwargs: the Qwen2-VL template's own variable numbers the pictures
    {"truncation": "left", "filter_overlong_prompts": True, "apply_chat_template_kwargs": {"add_vision_id": True}},
]


_FAMILIES = {"qwen2.5-vl": qwen25_vl_model_dir, "qwen3-vl": qwen3_vl_model_dir}


@slow
@pytest.mark.parametrize("family", first_in_matrix(["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]))
def test_image_rows_equal_verl_06(ray_session, geo3k_files, model_dir, tmp_path_factory, family):
    """Every image kind through the processor path: (4, M) positions (a text row, pads 1, over the three rope rows),
    PIL images, ``pixel_values`` and grids exactly verl 0.6.1's; Qwen2.5-VL with its larger pixel budget, Qwen3-VL
    with its 16-pixel patches, mean / std and own rope index."""
    build = _FAMILIES.get(family)
    model = model_dir if build is None else build(tmp_path_factory.mktemp(family), model_dir)
    runs = _verl(geo3k_files, model, IMAGE_CONFIGS, tmp_path_factory.mktemp("verl-cache"), model, batch_size=8)
    for config, expected in zip(IMAGE_CONFIGS, runs, strict=True):
        assert "error" not in expected, expected.get("error")
        ours = _ours(geo3k_files, model, config, processor=model, batch_size=8)
        assert ours[0]["position_ids"].shape[1] == 4
        assert_same_batches(ours, expected["batches"])


# (dataset kind, with images, processor family, config; the filter on unless it says): the 700-token limit filters
# the two-video frame-list rows, Qwen3-VL's (fewer tokens per frame) at 400 tokens its two longest rows
FILTERING_LIMITS = (400, 700)
VIDEO_CASES = {
    "frames": ("frames", False, "qwen2-vl", {"truncation": "left", "max_prompt_length": 700, "return_raw_chat": True}),
    "file": ("file", False, "qwen2-vl", {"truncation": "right", "max_prompt_length": 1100}),
    "file qwen2.5-vl": ("file", False, "qwen2.5-vl", {"truncation": "left", "max_prompt_length": 1100}),
    "frames+image": ("frames", True, "qwen2-vl", {"truncation": "left", "max_prompt_length": 2048}),
    # Qwen3-VL: a timestamp before each temporal patch, the rope index over per-patch grids, the 3-D pixel budget
    "frames+image qwen3-vl": ("frames", True, "qwen3-vl", {"truncation": "left", "max_prompt_length": 2048}),
    "frames qwen3-vl filtered": ("frames", False, "qwen3-vl", {"truncation": "right", "max_prompt_length": 400}),
    "file qwen3-vl": ("file", False, "qwen3-vl", {"truncation": "left", "max_prompt_length": 1100}),
    "file qwen3-vl unfiltered": (
        "file",
        True,
        "qwen3-vl",
        {"truncation": "left", "max_prompt_length": 4096, "filter_overlong_prompts": False},
    ),
}


def _with_reader(batches: list[dict], reader: str) -> list[dict]:
    """``batches`` with every video file's metadata naming ``reader``."""
    for batch in batches:
        for media in batch.get("multi_modal_data", ()):
            for _, metadata in media.get("video", ()):
                if "video_backend" in metadata:
                    metadata["video_backend"] = reader
    return batches


@slow
@pytest.mark.parametrize("name", first_in_matrix(list(VIDEO_CASES)))
def test_video_rows_equal_verl_06(ray_session, model_dir, tmp_path_factory, name):
    """verl 0.6's video rows: ``(frames, metadata)`` pairs with fetch_video's metadata (a file's fps, sampled frame
    numbers and frame count; a frame list's stand-in clock), the processor's video inputs and (4, M) positions. The
    one value that differs by design: a file's ``video_backend`` names the reader that decoded it, PyAV here (verl's
    is whichever reader qwen-vl-utils finds installed)."""
    kind, images, family, config = VIDEO_CASES[name]
    build = _FAMILIES.get(family)
    model = model_dir if build is None else build(tmp_path_factory.mktemp(family), model_dir)
    files = write_video_parquet(tmp_path_factory.mktemp("videos"), 12, kind=kind, with_images=images)
    config = {"filter_overlong_prompts": True, **config}
    expected = _verl(files, model, [config], tmp_path_factory.mktemp("verl-cache"), model, batch_size=4)[0]
    assert "error" not in expected, expected.get("error")
    assert (len(expected["rows"]) < 12) == (config["max_prompt_length"] in FILTERING_LIMITS)
    ours = _ours(files, model, config, processor=model, batch_size=4)
    videos = [v for b in ours for media in b["multi_modal_data"] for v in media.get("video", ())]
    assert videos and all(isinstance(v, tuple) and v[0].dtype == np.float32 for v in videos)
    readers = {metadata.get("video_backend") for _, metadata in videos}
    assert readers == ({"pyav"} if kind == "file" else {None})
    assert_same_batches(ours, _with_reader(expected["batches"], "pyav"))


def test_other_processors_are_refused_before_reading(ray_session, model_dir, tmp_path):
    """Processors outside verl 0.6's Qwen-VL rope branch are not built: one error naming them, before any data is
    read."""
    files = write_video_parquet(tmp_path / "videos", 4, kind="frames")
    other = tmp_path / "other"
    qwen25_vl_model_dir(other, model_dir)
    for name in ("processor_config.json", "preprocessor_config.json"):  # transformers 4 writes only the second
        if (config := other / name).is_file():
            config.write_text(config.read_text().replace("Qwen2_5_VLProcessor", "Glm4vProcessor"))
    with pytest.raises(ValueError, match="is a Glm4vProcessor"):
        build_dataset(files, model_dir, {"row_format": ROW_FORMAT}, processor=str(other))
