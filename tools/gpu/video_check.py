"""On the GPU machine (tools/gpu/video.sh runs it): torchcodec's video decoder on CUDA (NVDEC) against PyAV on
the CPU, on clips made here with PyAV. Per clip: the frames of ``probe_video``'s sampling from each decoder, their
difference from PyAV's in levels (NVDEC's YUV -> RGB conversion is not FFmpeg's swscale), and the time per video of
``decode_video_file`` with each (best of 5, after one warm-up). Writes one JSON line per clip and a summary to stdout,
and the whole to $OUT/video_check.json. ``VIDEO_CHECK_DEVICE=cpu`` runs it on a CPU machine (a dry run: torchcodec's CPU
decoder in place of NVDEC)."""

import ctypes
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.getcwd())
from ingest.media.video import decode_video_file, probe_video, torchcodec_error  # noqa: E402
from tools.samples import make_video_file  # noqa: E402

DEVICE = os.environ.get("VIDEO_CHECK_DEVICE", "cuda")
# (frames, width, height, fps): the parity test's sizes, a width that is no multiple of 16, then larger clips
CLIPS = [(40, 96, 64, 10), (17, 100, 70, 12), (300, 320, 240, 30), (120, 640, 480, 30), (60, 1280, 720, 30)]


def timed(fn, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    report: dict = {"device": DEVICE, "torch": torch.__version__, "torchcodec_error": torchcodec_error()}
    try:
        import torchcodec

        report["torchcodec"] = torchcodec.__version__
    except Exception as exc:
        report["torchcodec"] = f"{type(exc).__name__}: {exc}"
    try:
        ctypes.CDLL("libnvcuvid.so.1")
        report["libnvcuvid"] = True
    except OSError as exc:
        report["libnvcuvid"] = str(exc)
    if DEVICE != "cpu":
        report["gpu"] = torch.cuda.get_device_name(0)
    print(json.dumps(report), flush=True)
    clips = []
    work = tempfile.mkdtemp()
    for frames, width, height, fps in CLIPS:
        path = make_video_file(os.path.join(work, f"clip-{frames}-{width}.mp4"), frames, width, height, fps, seed=1)
        plan = probe_video({"video": path})
        data, indices = plan.data[0], plan.indices
        clip = {"frames": frames, "size": [width, height], "fps": fps, "sampled": len(indices)}
        pyav = decode_video_file(data, indices, "cpu", "pyav")
        clip["pyav_ms"] = round(1000 * timed(lambda: decode_video_file(data, indices, "cpu", "pyav")), 2)  # noqa: B023
        try:
            device = decode_video_file(data, indices, DEVICE, "torchcodec")
            diff = (device.cpu().int() - pyav.int()).abs().float()
            clip.update(
                shape_equal=list(device.shape) == list(pyav.shape),
                on=str(device.device),
                mean_levels=round(float(diff.mean()), 3),
                max_levels=int(diff.max()),
                equal_fraction=round(float((diff == 0).float().mean()), 4),
            )
            clip["torchcodec_ms"] = round(
                1000 * timed(lambda: decode_video_file(data, indices, DEVICE, "torchcodec")),  # noqa: B023
                2,
            )
        except Exception as exc:
            clip["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(json.dumps(clip), flush=True)
        clips.append(clip)
    report["clips"] = clips
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "video_check.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
