"""Video (``ingest/media/video.py``): qwen-vl-utils' sampling rules, torchcodec against PyAV on the CPU and (with
CUDA) NVDEC, ``python -m ingest ffmpeg-libdir``."""

from __future__ import annotations

import pytest
import torch

from ingest.media.video import (
    decode_video_file,
    frame_indices,
    probe_video,
    pyav_ffmpeg_libdir,
    smart_nframes,
    video_file_decoder,
    video_size,
)
from tests.support.media import needs_torchcodec
from tools.samples import make_video_file


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


@pytest.mark.gpu
def test_cuda_video_decode_is_close_to_pyav(tmp_path):
    """torchcodec (NVDEC) against PyAV on the same file. The same frames (index and count exact); NVDEC's YUV -> RGB
    conversion is not FFmpeg's swscale, so pixels are compared within a bound: on an H100 (2026-11-26,
    ``tools/gpu/video_check.py``) this clip was 1.55 levels off on average, at most 21; five clips
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
