"""``row_format: verl-0.7`` against verl 0.7.1 itself (transformers 5.9 beside it, from 0.9.1's oracle): its
``raw_prompt`` rows are 0.9.1's, so what is checked here is where 0.7.1 parts from 0.9.1: its overlong filter
measures a media prompt as the template writes it (the media popped before measuring: one pad per placeholder), a
path-string image is a TypeError there, and ``<audio>`` is plain text. Text with the filter on and off (with and
without a processor), images of every kind (HF ``Image()`` columns, plain ``{bytes, path}`` structs; Qwen2-VL,
Qwen2.5-VL and Qwen3-VL processors), videos (Qwen2-VL, Qwen3-VL)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.demo import gsm8k_rows
from ingest.errors import BadRowError, find_ingest_error
from ingest.run import run_pipeline
from tests.support import formats
from tests.support.compare import assert_same_batches
from tests.support.media import write_path_string_image_rows
from tests.support.tiers import first_fast, first_in_matrix, slow
from tools.oracle import oracle_available
from tools.samples import (
    geo3k_rows,
    geo3k_schema,
    qwen3_vl_model_dir,
    qwen25_vl_model_dir,
    write_video_parquet,
)

ROW_FORMAT = "verl-0.7"
BATCH = 8
pytestmark = pytest.mark.skipif(
    not oracle_available(ROW_FORMAT), reason="verl 0.7.1 oracle not installed (make oracle)"
)
TEXT_CONFIGS = [
    {"filter_overlong_prompts": True},
    {"filter_overlong_prompts": True, "max_prompt_length": 97, "truncation": "left"},
    {"filter_overlong_prompts": False, "max_prompt_length": 97, "truncation": "error"},
]
# geo3k prompts are 80-100 tokens as written: at 82 the filter drops the rows with more placeholders; at 640 verl
# 0.9.1 drops the rows with large images (their grids), 0.7.1 none
IMAGE_CONFIGS = [
    {"filter_overlong_prompts": True, "max_prompt_length": 82},
    {"filter_overlong_prompts": True, "max_prompt_length": 640},
    {"filter_overlong_prompts": False, "max_prompt_length": 64},
]


def _ours(files, model_dir, config: dict, processor=None) -> list[dict]:
    return formats.ours(files, model_dir, config, ROW_FORMAT, BATCH, processor)


def _verl(files, model_dir, configs: list[dict], cache, processor=None) -> list[dict]:
    return formats.verl(files, model_dir, configs, cache, ROW_FORMAT, BATCH, processor)


@pytest.mark.parametrize("processor", first_fast([False, True], ids=["tokenizer", "processor"], matrix=True))
def test_text_rows_equal_verl_07(ray_session, variety_files, model_dir, tmp_path, processor):
    """Text prompts; with a processor verl 0.7.1 measures them through it (``processor(text=...)``)."""
    proc = model_dir if processor else None
    configs = TEXT_CONFIGS[1:2] if processor else TEXT_CONFIGS  # the processor measures text prompts only
    runs = _verl(variety_files, model_dir, configs, tmp_path / "verl-cache", processor=proc)
    for config, expected in zip(configs, runs, strict=True):
        assert "error" not in expected, expected.get("error")
        assert_same_batches(_ours(variety_files, model_dir, config, processor=proc), expected["batches"])


@pytest.fixture(scope="module")
def image_runs(geo3k_files, model_dir, tmp_path_factory):
    return _verl(geo3k_files, model_dir, IMAGE_CONFIGS, tmp_path_factory.mktemp("verl-cache"), processor=model_dir)


@slow
@pytest.mark.parametrize("index", first_in_matrix(range(len(IMAGE_CONFIGS)), ids=[str(c) for c in IMAGE_CONFIGS]))
def test_image_rows_equal_verl_07(ray_session, geo3k_files, model_dir, image_runs, index):
    """Every image kind (RGBA, L, P, CMYK, extreme sizes; several per row): the items are 0.9.1's, the filter
    counts each image as its one placeholder token."""
    expected = image_runs[index]
    assert "error" not in expected, expected.get("error")
    assert (len(expected["rows"]) < 48) == (index == 0)  # 640 tokens keeps every row (0.9.1's filter: 42)
    ours = _ours(geo3k_files, model_dir, IMAGE_CONFIGS[index], processor=model_dir)
    assert_same_batches(ours, expected["batches"])
    if index == 1 and formats.formats_allowed("verl-0.9"):  # (an installed verl 0.7.1 refuses verl-0.9 rows)
        as_09 = formats.ours(geo3k_files, model_dir, IMAGE_CONFIGS[1], "verl-0.9", BATCH, model_dir)
        assert sum(len(b["index"]) for b in as_09) < 48  # the dialect decides, not the limit


@slow
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_other_families_image_rows_equal_verl_07(ray_session, geo3k_files, model_dir, tmp_path_factory, family):
    """Qwen2.5-VL and Qwen3-VL processors built offline: 0.7.1 measures their image prompts through
    ``processor(text=...)`` without the images, so the family's grids do not count (at 640 every row stays)."""
    build = qwen25_vl_model_dir if family == "qwen2.5-vl" else qwen3_vl_model_dir
    model = build(tmp_path_factory.mktemp(family), model_dir)
    config = IMAGE_CONFIGS[1]
    expected = _verl(geo3k_files, model, [config], tmp_path_factory.mktemp("verl-cache"), processor=model)[0]
    assert "error" not in expected, expected.get("error")
    assert len(expected["rows"]) == 48
    assert_same_batches(_ours(geo3k_files, model, config, processor=model), expected["batches"])


@slow
def test_plain_image_struct_rows_equal_verl_07(ray_session, geo3k_files, model_dir, tmp_path):
    """Image structs read without an HF ``Image()`` feature: the items keep ``bytes`` and ``path`` beside
    ``Image.open``; the path-only structs (every 7th row) are quarantined here, dropped by verl 0.7.1's filter (its
    ``__getitem__`` opens null bytes)."""
    files = []
    for path in geo3k_files:
        target = tmp_path / path.rsplit("/", 1)[-1]
        pq.write_table(pq.read_table(path).replace_schema_metadata(None), target, row_group_size=12)
        files.append(str(target))
    config = {"filter_overlong_prompts": True, "max_prompt_length": 2048}
    expected = _verl(files, model_dir, [config], tmp_path / "verl-cache", processor=model_dir)[0]
    assert "error" not in expected, expected.get("error")
    assert len(expected["rows"]) == 48 - 7
    assert_same_batches(_ours(files, model_dir, config, processor=model_dir), expected["batches"])


@slow
def test_image_path_strings_refused_as_verl_07(ray_session, model_dir, tmp_path):
    """verl 0.7.1 takes no path-string image (``_build_messages`` raises TypeError): its filter drops every such row,
    its ``__getitem__`` raises without the filter. Ours quarantines them, naming file, row and reason, or raises."""
    path = write_path_string_image_rows(tmp_path)
    config = IMAGE_CONFIGS[1]
    runs = _verl([path], model_dir, [config, IMAGE_CONFIGS[2]], tmp_path / "verl-cache", processor=model_dir)
    assert runs[0]["rows"] == [] and "TypeError" in runs[1]["error"]
    summary = run_pipeline(
        [path],
        model_dir,
        {**config, "row_format": ROW_FORMAT},
        processor=model_dir,
        quarantine_dir=str(tmp_path / "quarantine"),
    )
    assert (summary.rows_in, summary.rows_out, summary.quarantined) == (16, 0, 16)
    reasons = {r["reason"] for r in pq.read_table(summary.quarantine_file).to_pylist()}
    assert all("image must be an image struct, got str" in reason for reason in reasons), reasons
    with pytest.raises(BadRowError) as info:
        _ours([path], model_dir, {**IMAGE_CONFIGS[2], "on_bad_row": "raise"}, processor=model_dir)
    assert find_ingest_error(info.value).file == path


@slow
def test_audio_placeholder_is_text_in_verl_07(ray_session, model_dir, tmp_path):
    """``<audio>`` in a media prompt is text to verl 0.7.1 (0.9.1 makes it an audio item, which ours refuses)."""
    rows = geo3k_rows(8, seed=3)
    for row in rows:
        row["prompt"][0]["content"] += " Answer as if reading <audio> aloud."
    path = tmp_path / "audio-text.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=geo3k_schema()), path)
    config = {"filter_overlong_prompts": True, "max_prompt_length": 2048}
    expected = _verl([str(path)], model_dir, [config], tmp_path / "verl-cache", processor=model_dir)[0]
    assert "error" not in expected, expected.get("error")
    assert len(expected["rows"]) == 8
    ours = _ours([str(path)], model_dir, config, processor=model_dir)
    assert_same_batches(ours, expected["batches"])
    texts = [item["text"] for m in ours[0]["raw_prompt"][0] for item in m["content"] if item["type"] == "text"]
    assert any("<audio>" in text for text in texts)


@slow
def test_audio_column_passes_through_in_verl_07(ray_session, model_dir, tmp_path):
    """An ``audios`` column is a column like any other to verl 0.7.1 (0.9.1 pops it): its values stay in the rows."""
    rows = [{**row, "audios": ["clip.wav"] if i == 5 else None} for i, row in enumerate(gsm8k_rows(16, variety=True))]
    path = tmp_path / "audio-column.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=8)
    expected = _verl([str(path)], model_dir, [TEXT_CONFIGS[0]], tmp_path / "verl-cache")[0]
    assert "error" not in expected, expected.get("error")
    ours = _ours([str(path)], model_dir, TEXT_CONFIGS[0])
    assert_same_batches(ours, expected["batches"])
    assert list(ours[0]["audios"][:6]) == [None] * 5 + [["clip.wav"]]


@slow
@pytest.mark.parametrize(
    "family,kind,limit",
    first_in_matrix([("qwen2-vl", "frames", 40), ("qwen2-vl", "file", 2048), ("qwen3-vl", "frames", 40)]),
)
def test_video_rows_equal_verl_07(ray_session, model_dir, tmp_path, family, kind, limit):
    """Video dicts (0.7.1 takes only those) become items of their own values; the filter counts each as its one
    placeholder, with no Qwen3-VL timestamps (at 40 tokens it drops the rows with two videos)."""
    model = qwen3_vl_model_dir(tmp_path / "qwen3-vl", model_dir) if family == "qwen3-vl" else model_dir
    files = write_video_parquet(tmp_path / "data", 12, kind=kind, with_images=kind == "frames")
    config = {"filter_overlong_prompts": True, "max_prompt_length": limit}
    expected = _verl(files, model, [config], tmp_path / "verl-cache", processor=model)[0]
    assert "error" not in expected, expected.get("error")
    assert (0 < len(expected["rows"]) < 12) == (limit == 40), len(expected["rows"])
    assert_same_batches(_ours(files, model, config, processor=model), expected["batches"])
