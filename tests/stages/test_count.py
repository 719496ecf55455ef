"""Counting an epoch (``DriverUnits(count_only=True)``, ``length.count_rows_here``): the same rows kept, filtered and
quarantined as the stages that make them (text rows with far fewer prompts encoded; image rows through the decode
stage), and the same error where a row raises."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.blocks import PROVENANCE_COLUMNS, ROW_COLUMN
from ingest.config import DataConfig
from ingest.datasets.local import DriverUnits
from ingest.datasets.plan import plan_input
from ingest.verl.length import count_rows_here
from tests.support.media import good_and_cut_video_files, write_media_rows


def _epoch(files: list[str], model_dir: str, config: DataConfig, *, count_only: bool) -> tuple[pa.Table, int]:
    """The kept rows' provenance over every unit, and how many prompts were encoded."""
    plan = plan_input(files, config)
    driver = DriverUnits(plan, config, plan.context(None, True), model_dir, count_only=count_only)
    tokenizer = driver.stage.tokenizer
    encode, encoded = tokenizer.encode_batch, []
    tokenizer.encode_batch = lambda texts: encoded.extend(texts) or encode(texts)
    blocks = [block.select(list(PROVENANCE_COLUMNS)) for unit in plan.units for block in driver(unit)]
    return pa.concat_tables(blocks), len(encoded)


@pytest.fixture(scope="module")
def files_with_bad_rows(variety_files, tmp_path_factory):
    """The variety rows, plus a file whose prompts are partly not chat messages (quarantined)."""
    rows = [{"prompt": [{"role": "user", "content": f"question {i} " * (i * 9)}], "data_source": "x"} for i in range(9)]
    rows[2]["prompt"] = []
    rows[6]["prompt"] = [{"role": "user", "content": None}]
    path = tmp_path_factory.mktemp("bad") / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return [*variety_files, str(path)]


@pytest.mark.parametrize("row_format", ["verl-0.5", "verl-0.6", "verl-0.7", "verl-0.9"])
@pytest.mark.parametrize(
    "settings",
    [
        {"filter_overlong_prompts": True, "max_prompt_length": 340},  # cuts through the prompts' lengths
        {"filter_overlong_prompts": True, "max_prompt_length": 1024},
        {"filter_overlong_prompts": False, "max_prompt_length": 340, "truncation": "left"},
    ],
)
def test_counting_keeps_the_rows_the_stage_keeps(files_with_bad_rows, model_dir, row_format, settings):
    config = DataConfig.from_any({"row_format": row_format, "shuffle": False, **settings})
    counted, counted_encoded = _epoch(files_with_bad_rows, model_dir, config, count_only=True)
    made, made_encoded = _epoch(files_with_bad_rows, model_dir, config, count_only=False)
    assert counted.equals(made)
    assert 0 < made.num_rows < 219  # quarantined rows, and filtered ones where the filter is on
    if config.raw_prompt_rows:  # those rows carry no ids: making them encodes only what counting does
        assert counted_encoded == made_encoded
    else:
        assert counted_encoded < made_encoded
    plan = plan_input(files_with_bad_rows, config)
    assert count_rows_here(plan, model_dir, config) == made.num_rows


def test_counting_an_overlong_prompt_with_truncation_error_raises_as_the_stage_does(variety_files, model_dir):
    config = DataConfig.from_any({"max_prompt_length": 340, "filter_overlong_prompts": False, "truncation": "error"})
    with pytest.raises(Exception, match="longer than max_prompt_length=340") as counted:
        _epoch(variety_files, model_dir, config, count_only=True)
    with pytest.raises(Exception, match="longer than max_prompt_length=340") as made:
        _epoch(variety_files, model_dir, config, count_only=False)
    assert str(counted.value) == str(made.value)  # the same file and row


@pytest.fixture(scope="module")
def images_with_corrupt_ones(geo3k_files, tmp_path_factory):
    """The geo3k rows, two of whose images are cut short after their headers (they fail only when decoded)."""
    table = pq.read_table(geo3k_files[0])
    rows = table.to_pylist()
    cut = [image for row in rows for image in row["images"] or [] if image["bytes"] and len(image["bytes"]) > 2000]
    for image in cut[1:3]:
        image["bytes"] = image["bytes"][:300]
    path = tmp_path_factory.mktemp("corrupt") / "corrupt.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    return [str(path), *geo3k_files[1:]]


# a limit that filters some image prompts (verl 0.7 measures them without their images: 80-100 tokens here)
@pytest.mark.parametrize("row_format,limit", [("verl-0.5", 400), ("verl-0.7", 84), ("verl-0.9", 400)])
def test_counting_media_rows_keeps_the_rows_their_stages_keep(images_with_corrupt_ones, model_dir, row_format, limit):
    # the corrupt images are quarantined by the decode stage
    config = DataConfig.from_any(
        {"row_format": row_format, "shuffle": False, "max_prompt_length": limit, "truncation": "left"}
    )
    plan = plan_input(images_with_corrupt_ones, config, multimodal=True)
    made = _media_epoch(plan, model_dir, config, count_only=False)
    assert 0 < made.num_rows < sum(info.num_rows for info in plan.infos) - 2
    assert _media_epoch(plan, model_dir, config, count_only=True).equals(made)
    assert count_rows_here(plan, model_dir, config, model_dir) == made.num_rows
    strict = DataConfig.from_any({**config.to_dict(), "on_bad_row": "raise"})
    with pytest.raises(Exception, match="bad image") as counted:
        count_rows_here(plan, model_dir, strict, model_dir)
    with pytest.raises(Exception, match="bad image") as making:
        driver = DriverUnits(plan, strict, plan.context(None, True), model_dir, model_dir)
        [block for unit in plan.units for block in driver(unit)]
    assert str(counted.value) == str(making.value)  # the first corrupt image's file and row, from either


def test_counting_video_rows_keeps_the_rows_their_stages_keep(model_dir, tmp_path):
    good, cut = good_and_cut_video_files(tmp_path)  # the cut one's header reads whole, its frames stop short
    rows = [
        ("<video>fine", [{"video": good}]),
        ("<video>cut short", [{"video": cut}]),
        ("<video>missing", [{"video": str(tmp_path / "missing.mp4")}]),
        ("<video><video>two placeholders", [{"video": good}]),
        ("<video>fine again", [{"video": good}]),
    ]
    path = write_media_rows(tmp_path / "videos.parquet", rows, "videos")
    config = DataConfig.from_any({"shuffle": False})
    plan = plan_input([path], config, multimodal=True)
    made = _media_epoch(plan, model_dir, config, count_only=False)
    assert made.column(ROW_COLUMN).to_pylist() == [0, 4]
    assert _media_epoch(plan, model_dir, config, count_only=True).equals(made)


def _media_epoch(plan, model_dir: str, config: DataConfig, *, count_only: bool) -> pa.Table:
    driver = DriverUnits(plan, config, plan.context(None, True), model_dir, model_dir, count_only=count_only)
    return pa.concat_tables(block.select(list(PROVENANCE_COLUMNS)) for unit in plan.units for block in driver(unit))


def test_videos_decoded_on_a_device_are_not_counted_in_the_driver(geo3k_files, model_dir):
    config = DataConfig.from_any({"vision_decode_video_on_device": True})
    plan = plan_input(geo3k_files, config, multimodal=True)
    with pytest.raises(ValueError, match="counted where decoded"):
        DriverUnits(plan, config, plan.context(), model_dir, model_dir, count_only=True)
