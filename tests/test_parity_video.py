"""Video parity with verl 0.5.0 (qwen-vl-utils' fetch_video rules): frame lists, video files, videos next to images."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from ingest import build_dataset
from ingest.config import DataConfig, StageContext
from ingest.devtools.oracle import oracle_available, run_verl
from ingest.devtools.samples import make_video_file, write_video_parquet
from ingest.errors import BadRowError, find_ingest_error
from ingest.media.video import (
    decode_video_file,
    frame_indices,
    probe_video,
    pyav_ffmpeg_libdir,
    smart_nframes,
    torchcodec_error,
    torchcodec_loads,
    video_file_decoder,
    video_size,
)
from ingest.stats import RunLedger
from tests.conftest import collect
from tests.helpers import assert_same_batches, write_media_rows

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


@pytest.mark.parametrize("name", list(CASES))
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


def needs_torchcodec():
    """Skip where torchcodec's video decoder does not load (``make test`` gives it PyAV's FFmpeg libraries)."""
    if not torchcodec_loads():
        pytest.skip(f"torchcodec does not load here ({torchcodec_error()}); `make test` sets LD_LIBRARY_PATH for it")


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


def test_torchcodec_decodes_pyavs_frames_on_the_cpu(tmp_path):
    """torchcodec (the vision actors' decoder on CUDA, here its CPU decoder with PyAV's FFmpeg) against PyAV: the
    same frames, bit for bit, sizes that are and are not a multiple of 16 / 32; a file cut short is the same error."""
    needs_torchcodec()
    assert video_file_decoder("cpu") == "pyav" and video_file_decoder("cpu", "torchcodec") == "torchcodec"
    for frames, width, height, fps in ((6, 64, 64, 5), (40, 192, 96, 30), (17, 100, 70, 12)):
        path = make_video_file(tmp_path / f"clip-{frames}.mp4", frames, width, height, fps, seed=frames)
        plan = probe_video({"video": path})
        pyav = decode_video_file(plan.data[0], plan.indices, "cpu", "pyav")
        torchcodec = decode_video_file(plan.data[0], plan.indices, "cpu", "torchcodec")
        assert pyav.shape == (len(plan.indices), 3, height, width) and torch.equal(torchcodec, pyav)
    good = make_video_file(tmp_path / "good.mp4", 24, 64, 64, 10, faststart=True)
    cut = open(good, "rb").read()
    cut = cut[: int(len(cut) * 0.6)]
    for decoder in ("pyav", "torchcodec"):
        with pytest.raises(ValueError, match="fewer frames than its header says"):
            decode_video_file(cut, list(range(0, 24, 2)), "cpu", decoder)


def test_an_explicit_torchcodec_that_does_not_load_fails_at_actor_start(model_dir, monkeypatch):
    from ingest.media import video
    from ingest.stages.vision import VisionStage

    monkeypatch.setattr(video, "torchcodec_error", lambda: "it found no FFmpeg libraries it can load")
    with pytest.raises(RuntimeError, match=r"torchcodec does not load here .*ingest ffmpeg-libdir"):
        VisionStage(
            model_dir,
            DataConfig(vision_device="cpu", vision_video_decoder="torchcodec", vision_decode_video_on_device=True),
        )
    assert (
        VisionStage(model_dir, DataConfig(vision_device="cpu")).video_decoder == "auto"
    )  # "auto" falls back to PyAV instead


def test_ffmpeg_libdir_lends_torchcodec_pyavs_libraries(tmp_path):
    """``python -m ingest ffmpeg-libdir``: a process started with that directory on LD_LIBRARY_PATH loads torchcodec's
    video decoder from PyAV's FFmpeg (here, where the system has none, only then)."""
    import os
    import subprocess
    import sys

    libdir = subprocess.run(
        [sys.executable, "-m", "ingest", "ffmpeg-libdir", "--dest", str(tmp_path / "ffmpeg")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert libdir == str(tmp_path / "ffmpeg") and pyav_ffmpeg_libdir(libdir) == libdir  # again: no error
    names = os.listdir(libdir)
    assert {"libavcodec", "libavformat", "libavutil", "libswscale"} <= {n.split(".so.")[0] for n in names}
    assert all(os.path.exists(os.path.join(libdir, n)) for n in names)  # no dangling link
    probe = [sys.executable, "-c", "from ingest.media.video import torchcodec_error as e; print(e())"]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    try:
        import torchcodec  # noqa: F401
    except ImportError:
        pytest.skip("torchcodec is not installed")
    lent = subprocess.run(probe, env={**env, "LD_LIBRARY_PATH": libdir}, capture_output=True, text=True, check=True)
    assert lent.stdout.strip() == "None", lent.stdout + lent.stderr[-2000:]
    if not _system_has_ffmpeg():
        bare = subprocess.run(probe, env=env, capture_output=True, text=True, check=True)
        assert "FFmpeg" in bare.stdout, bare.stdout


def _system_has_ffmpeg() -> bool:
    import subprocess

    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return "libavutil.so" in listing


def test_deferred_video_files_give_the_same_block_as_the_decode_stage(model_dir, tmp_path):
    """In-process: the decode stage leaves video files encoded (frame lists it decodes), the vision stage decodes
    them; the output block equals the one of the CPU decode stage, byte for byte."""
    from actors.tokenize import TokenizeActor
    from ingest.blocks import DEFERRED_VIDEO_COLUMN
    from ingest.config import DataConfig
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
    """Rows with a video file whose index reads whole (faststart) but whose frames stop at 60% of the file: the
    tokenize stage plans it from the header, decoding comes up short."""
    good = make_video_file(tmp_path / "good.mp4", 24, 64, 64, 10, faststart=True)
    data = open(good, "rb").read()
    (tmp_path / "cut.mp4").write_bytes(data[: int(len(data) * 0.6)])
    rows = [
        ("<video>fine", [{"video": good}]),
        ("<video>cut short", [{"video": str(tmp_path / "cut.mp4")}]),
        ("<video><video>fine, then cut short", [{"video": good}, {"video": str(tmp_path / "cut.mp4")}]),
        ("<video>fine again", [{"video": good}]),
    ]
    return write_media_rows(tmp_path / "cut-videos.parquet", rows, "videos")


_VIDEO_DECODE_PLACES = {
    "decode stage": {},
    "vision actor": _VIDEO_IN_VISION_ACTOR,
    "vision actor, no decode pool": {**_VIDEO_IN_VISION_ACTOR, "decode_pool_max_size": 0},
    "vision actor, torchcodec": {**_VIDEO_IN_VISION_ACTOR, "vision_video_decoder": "torchcodec"},
}


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


def test_video_file_that_fails_to_decode_in_the_vision_actor_raises_naming_file_and_row(
    ray_session, model_dir, tmp_path
):
    path = _cut_video_file(tmp_path)
    config = {"shuffle": False, "on_bad_row": "raise", **_VIDEO_IN_VISION_ACTOR}
    with pytest.raises(BadRowError) as info:
        collect(build_dataset(path, model_dir, config, processor=model_dir))
    err = find_ingest_error(info.value)
    assert (err.file, err.row, err.column) == (path, 1, "videos") and err.reason.startswith("bad video: ")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_video_decode_is_close_to_pyav(tmp_path):
    """torchcodec (NVDEC) against PyAV on the same file. The same frames (index and count exact); NVDEC's YUV -> RGB
    conversion is not FFmpeg's swscale, so pixels are compared within a bound: on an H100 (2026-11-26,
    ``ingest/devtools/gpu/video_check.py``) this clip was 1.55 levels off on average, at most 21; five clips
    1.13-2.25 and at
    most 26, 25-40% of values equal."""
    needs_torchcodec()
    assert video_file_decoder("cuda") == "torchcodec"
    path = make_video_file(tmp_path / "clip.mp4", 40, 96, 64, 10)
    plan = probe_video({"video": path})
    cpu = decode_video_file(plan.data[0], plan.indices, "cpu")
    gpu = decode_video_file(plan.data[0], plan.indices, "cuda")
    assert gpu.device.type == "cuda" and gpu.shape == cpu.shape and gpu.dtype == torch.uint8
    diff = (gpu.cpu().int() - cpu.int()).abs().float()
    assert diff.mean() <= 2.5 and diff.max() <= 32, f"mean difference {diff.mean():.2f} levels, max {diff.max():.0f}"


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


def test_sampling_rules_match_fetch_video():
    # 2 fps, at least 4 frames, at most 768 / the frame count, rounded down to an even count
    assert smart_nframes({}, total_frames=25, video_fps=10) == 4
    assert smart_nframes({}, total_frames=300, video_fps=10) == 60
    assert smart_nframes({}, total_frames=5, video_fps=30) == 4
    assert smart_nframes({"nframes": 7}, total_frames=20, video_fps=10) == 8
    assert smart_nframes({"fps": 1, "max_frames": 6}, total_frames=200, video_fps=10) == 6
    with pytest.raises(ValueError):
        smart_nframes({"fps": 1, "nframes": 4}, total_frames=20, video_fps=10)
    assert frame_indices({}, 25, 10) == [0, 8, 16, 24]
    assert frame_indices({"video_start": 1.0, "video_end": 2.0}, 30, 10) == [10, 13, 17, 20]
    # the pixel budget: 128..768 tokens per frame (factor 28)
    assert video_size(4, 64, 96, {}) == (280, 392)
    h, w = video_size(4, 1080, 1920, {})
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 768 * 28 * 28


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
