"""Video parity with verl 0.5.0 (qwen-vl-utils' fetch_video rules): frame lists, video files, videos next to images."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from ingest import build_dataset
from ingest.config import DataConfig, StageContext
from ingest.errors import BadRowError, find_ingest_error
from ingest.stats import RunLedger
from tests.support.batches import collect
from tests.support.compare import assert_same_batches
from tests.support.media import good_and_cut_video_files, needs_torchcodec, write_media_rows
from tests.support.tiers import first_in_matrix, slow
from tools.oracle import oracle_available, run_verl
from tools.samples import make_video_file, write_video_parquet

BATCH = 4
# (dataset kind, with images, config): the 700-token limit filters the two-video rows of the frame-list data
CASES = {
    "frames": ("frames", False, {"truncation": "left", "max_prompt_length": 700, "return_raw_chat": True}),
    "file": ("file", False, {"truncation": "right", "max_prompt_length": 1100, "return_full_prompt": True}),
    "frames+image": ("frames", True, {"truncation": "left", "max_prompt_length": 2048}),
}


@pytest.fixture(scope="module")
def video_runs(model_dir, tmp_path_factory):
    if not oracle_available():
        pytest.skip("verl 0.5.0 oracle not installed (make oracle)")
    runs = {}
    for name, (kind, images, config) in CASES.items():
        files = write_video_parquet(tmp_path_factory.mktemp(name.replace("+", "-")), 12, kind=kind, with_images=images)
        config = {**config, "filter_overlong_prompts": True, "cache_dir": str(tmp_path_factory.mktemp("verl-cache"))}
        expected = run_verl("rows", files, model_dir, None, configs=[config], batch_size=BATCH, processor=model_dir)
        runs[name] = (files, config, expected["runs"][0])
    return runs


@slow
@pytest.mark.parametrize("name", first_in_matrix(list(CASES)))
def test_video_rows_equal_verl(ray_session, model_dir, video_runs, name):
    files, config, expected = video_runs[name]
    assert "error" not in expected, expected.get("error")
    config = {k: v for k, v in config.items() if k != "cache_dir"}
    ds = build_dataset(files, model_dir, {**config, "shuffle": False}, processor=model_dir)
    assert_same_batches(collect(ds, BATCH), expected["batches"])


# video files decoded in the (GPU-scheduled; kernels on the CPU here, so PyAV decodes) vision actor
_VIDEO_IN_VISION_ACTOR = {
    "vision_decode_video_on_device": True,
    "vision_num_gpus": 0.5,
    "vision_pool_max_size": 1,
    "vision_device": "cpu",
}


@slow
@pytest.mark.parametrize("decoder", ["auto", "torchcodec"])
def test_video_files_decoded_by_the_vision_actor_equal_verl(ray_session, model_dir, video_runs, decoder):
    """``vision_decode_video_on_device``: video files skip the decode stage and are decoded in the vision actor; with
    no CUDA device "auto" is PyAV, the decode stage's decoder, and torchcodec on the CPU decodes the same frames:
    verl's rows either way."""
    if decoder == "torchcodec":
        needs_torchcodec()
    files, config, expected = video_runs["file"]
    config = {k: v for k, v in config.items() if k != "cache_dir"}
    config = {**config, "shuffle": False, **_VIDEO_IN_VISION_ACTOR, "vision_video_decoder": decoder}
    ds = build_dataset(files, model_dir, config, processor=model_dir)
    assert_same_batches(collect(ds, BATCH), expected["batches"])


def test_deferred_video_files_give_the_same_block_as_the_decode_stage(model_dir, tmp_path):
    """In-process: the decode stage leaves video files encoded (frame lists it decodes), the vision stage decodes
    them; the output block equals the one of the CPU decode stage, byte for byte."""
    from actors.tokenize import TokenizeActor
    from ingest.blocks import DEFERRED_VIDEO_COLUMN
    from ingest.datasets.plan import plan_input
    from ingest.read.files import unify_schemas
    from ingest.read.units import read_unit
    from ingest.stages.decode import DecodeStage
    from ingest.stages.vision import VisionStage

    cfg = DataConfig.from_any({"max_prompt_length": 4096, "shuffle": False})
    vision = VisionStage(model_dir, DataConfig(vision_device="cpu"))
    deferred = decoded = 0
    for kind, rows in (("file", 6), ("frames", 4)):
        files = write_video_parquet(tmp_path / kind, rows, kind=kind)
        plan = plan_input(files, cfg, multimodal=True)
        schema = unify_schemas(plan.infos)
        tokenize = TokenizeActor(cfg, StageContext(files), model_dir, model_dir)
        for unit in plan.units:
            for table in tokenize(read_unit(unit, plan.files[unit.file_index], schema, {}, None)):
                left = DecodeStage(DataConfig(vision_decode_video_on_device=True))(table).table
                entries = [x for row in left.column(DEFERRED_VIDEO_COLUMN).to_pylist() if row for x in row]
                deferred += sum(x is not None for x in entries)
                decoded += sum(x is None for x in entries)  # frame lists: decoded by the decode stage as before
                assert vision(left).equals(vision(DecodeStage(DataConfig(on_bad_row="raise"))(table).table))
    assert deferred >= 6 and decoded >= 4


def _cut_video_file(tmp_path):
    """Rows with a video file cut short after its header (``good_and_cut_video_files``)."""
    good, cut = good_and_cut_video_files(tmp_path)
    rows = [
        ("<video>fine", [{"video": good}]),
        ("<video>cut short", [{"video": cut}]),
        ("<video><video>fine, then cut short", [{"video": good}, {"video": cut}]),
        ("<video>fine again", [{"video": good}]),
    ]
    return write_media_rows(tmp_path / "cut-videos.parquet", rows, "videos")


_VIDEO_DECODE_PLACES = {
    "decode stage": {},
    "vision actor": _VIDEO_IN_VISION_ACTOR,
    "vision actor, no decode pool": {**_VIDEO_IN_VISION_ACTOR, "decode_pool_max_size": 0},
    "vision actor, torchcodec": {**_VIDEO_IN_VISION_ACTOR, "vision_video_decoder": "torchcodec"},
}


@slow
@pytest.mark.parametrize("place", list(_VIDEO_DECODE_PLACES))
def test_video_file_that_fails_to_decode_is_quarantined_and_counted(ray_session, model_dir, tmp_path, place):
    if "torchcodec" in place:
        needs_torchcodec()
    path = _cut_video_file(tmp_path)
    ledger = RunLedger.remote()
    config = {"shuffle": False, **_VIDEO_DECODE_PLACES[place]}
    batches = collect(build_dataset(path, model_dir, config, processor=model_dir, ledger=ledger))
    assert [int(i) for b in batches for i in b["index"]] == [0, 3]
    assert not any(name.startswith("_") for name in batches[0])
    counts = ray.get(ledger.get.remote())
    assert (counts["rows_in"], counts["rows_out"], counts["quarantined"]) == (4, 2, 2)
    assert counts["prompt_tokens"] == sum(int(m.sum()) for b in batches for m in b["attention_mask"])
    records = ray.get(ledger.quarantine.remote())
    assert [(r["file"], r["row"], r["column"]) for r in records] == [(path, 1, "videos"), (path, 2, "videos")]
    assert all("fewer frames than its header says" in r["reason"] for r in records)


@slow
def test_video_file_that_fails_to_decode_in_the_vision_actor_raises_naming_file_and_row(
    ray_session, model_dir, tmp_path
):
    path = _cut_video_file(tmp_path)
    config = {"shuffle": False, "on_bad_row": "raise", **_VIDEO_IN_VISION_ACTOR}
    with pytest.raises(BadRowError) as info:
        collect(build_dataset(path, model_dir, config, processor=model_dir))
    err = find_ingest_error(info.value)
    assert (err.file, err.row, err.column) == (path, 1, "videos") and err.reason.startswith("bad video: ")


@slow
def test_video_data_covers_the_cases(video_runs):
    frames_rows = video_runs["frames"][2]["rows"]
    assert len(frames_rows) < 12, "the frame-list limit should filter some rows"
    assert any(len(r["multi_modal_data"]["video"]) == 2 for r in video_runs["file"][2]["rows"])
    videos = [v for r in frames_rows for v in r["multi_modal_data"]["video"]]
    assert all(v.dtype == np.float32 and v.ndim == 4 and v.shape[1] == 3 and v.shape[0] % 2 == 0 for v in videos)
    mixed = video_runs["frames+image"][2]["rows"][0]
    assert set(mixed["multi_modal_data"]) == {"image", "video"}
    assert list(mixed["multi_modal_inputs"]) == [
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
    ]


def _bad_video_file(tmp_path):
    good = make_video_file(tmp_path / "good.mp4", 12, 64, 64, 10)
    (tmp_path / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video at all")
    rows = [
        ("<video>fine", [{"video": good}]),
        ("<video>missing", [{"video": str(tmp_path / "missing.mp4")}]),
        ("<video>corrupt", [{"video": str(tmp_path / "corrupt.mp4")}]),
        ("<video><video>two placeholders", [{"video": good}]),
        ("<video>fine again", [{"video": good}]),
    ]
    return write_media_rows(tmp_path / "bad-videos.parquet", rows, "videos")


def test_bad_videos_are_quarantined_and_counted(ray_session, model_dir, tmp_path):
    path = _bad_video_file(tmp_path)
    ledger = RunLedger.remote()
    batches = collect(build_dataset(path, model_dir, {"shuffle": False}, processor=model_dir, ledger=ledger))
    assert [int(i) for b in batches for i in b["index"]] == [0, 4]
    counts = ray.get(ledger.get.remote())
    assert counts["rows_in"] == 5 == counts["rows_out"] + counts["filtered_overlong"] + counts["quarantined"]
    records = ray.get(ledger.quarantine.remote())
    assert [r["row"] for r in records] == [1, 2, 3] and all(r["column"] == "videos" for r in records)
    assert "missing.mp4" in records[0]["reason"] and "bad video" in records[1]["reason"]
    assert records[2]["reason"] == "2 <video> placeholders for 1 videos"
    video = batches[0]["multi_modal_data"][0]["video"][0]
    assert video.dtype == np.float32 and video.shape == (4, 3, 336, 336)
    assert isinstance(batches[0]["multi_modal_inputs"][0]["pixel_values_videos"], torch.Tensor)


@slow
def test_video_frame_that_fails_to_decode_is_quarantined(ray_session, model_dir, tmp_path):
    """A frame whose header reads (the tokenize stage plans the video) but whose data do not decode: the decode
    stage quarantines the row, and the counts still add up."""
    import io

    from PIL import Image

    frames = []
    for k in range(4):
        buffer = io.BytesIO()
        Image.fromarray(np.full((56, 56, 3), 40 * k, dtype=np.uint8)).save(buffer, format="PNG")
        data = buffer.getvalue()
        frames.append(tmp_path / f"frame-{k}.png")
        frames[-1].write_bytes(data[: len(data) // 2] if k == 2 else data)
    good = [str(f) for i, f in enumerate(frames) if i != 2] + [str(frames[0])]
    rows = [("<video>fine", [{"video": good}]), ("<video>third frame truncated", [{"video": [str(f) for f in frames]}])]
    path = write_media_rows(tmp_path / "frames.parquet", rows, "videos")
    ledger = RunLedger.remote()
    batches = collect(build_dataset(path, model_dir, {"shuffle": False}, processor=model_dir, ledger=ledger))
    assert [int(i) for b in batches for i in b["index"]] == [0]
    counts = ray.get(ledger.get.remote())
    assert (counts["rows_in"], counts["rows_out"], counts["quarantined"]) == (2, 1, 1)
    [record] = ray.get(ledger.quarantine.remote())
    assert (record["file"], record["row"], record["column"]) == (path, 1, "videos")
    assert record["reason"].startswith("bad video: ")
