"""Bad media at scale: ~1% corrupt / truncated / zero-size / huge-header images and videos, spread
over several files and row groups of a 1,224-row dataset, through ``run_pipeline`` on the session's real local Ray.

Checked against a reference built with the data: every bad row is quarantined once, with its file, row, column and
a reason for its kind; every good row comes out once, in input order; rows in = out + filtered + quarantined; and no
actor of the run died or was restarted. The last check is needed because the ledger counts a retried batch once:
an actor killed by memory (or crashed by a decoder) would be restarted by Ray and the counts would still add up.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from ingest.run import run_pipeline
from tests.support.media import header_only_png, write_media_rows
from tests.support.tiers import slow
from tools.samples import encode_image, make_video_file

IMAGE_FILES, IMAGE_ROWS_PER_FILE, ROW_GROUP = 3, 400, 50
HUGE = (20_000, 20_000)  # 400M pixels: over PIL's decompression-bomb limit (2 x 89.5M), refused on open
# 81M pixels: under PIL's limit, so the header reads and the grid is planned (~1,280 tokens: overlong at the default
# max_prompt_length 1024); with the overlong filter off it reaches the decode stage with only a few bytes of data
NEAR_LIMIT = (9_000, 9_000)
# the bad image rows' global positions (3 files x 400 rows, row groups of 50): 14 of 1,200, about 1%, at the first
# read unit, row-group and file boundaries and the last row
BAD_IMAGE_AT = (3, 49, 50, 170, 333, 399, 400, 512, 640, 777, 801, 950, 1100, 1199)
VIDEO_ROWS = 24
BAD_VIDEO_AT = (0, 11, 23)  # the first, a middle and the last row of the video file


def _small_images(seed: int = 0) -> list[tuple[bytes, str]]:
    """Good images of 32-64 px (grid 1x4x4 at Qwen2-VL's 56x56 minimum: cheap to decode and patch) in the modes
    verl meets: RGB PNG, JPEG, gray, palette, RGBA."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for k, (mode, fmt) in enumerate([("RGB", "PNG"), ("RGB", "JPEG"), ("L", "PNG"), ("P", "PNG"), ("RGBA", "PNG")]):
        w, h = 32 + 8 * k, 64 - 6 * k
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        if mode == "P":
            image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        elif mode != "RGB":
            image = image.convert(mode)
        out.append((encode_image(image, fmt), fmt))
    return out


def _cut(data: bytes, fraction: float) -> bytes:
    return data[: int(len(data) * fraction)]


@dataclass
class Reference:
    """What the run must give: the good rows' indexes in input order, the rows filtered as overlong, and per bad row
    (file, row in file) its column and the start of its reason."""

    files: list[str] = field(default_factory=list)
    good: list[int] = field(default_factory=list)
    filtered: list[int] = field(default_factory=list)
    bad: dict[tuple[str, int], tuple[int, str, str]] = field(default_factory=dict)  # -> (index, column, reason)


def _struct(data: bytes) -> dict:
    return {"bytes": data, "path": None}


def _image_faults(good_png: bytes, good_jpeg: bytes) -> list[tuple[str, list[dict], str]]:
    """(prompt, images, reason prefix) of each bad image kind. The near-limit header's reason is for runs without
    the overlong filter (with it the row is filtered, never decoded)."""
    return [
        ("<image>corrupt bytes", [_struct(b"\x89PNG\r\n\x1a\n not really a png")], "bad image: UnidentifiedImageError"),
        ("<image>zero-size bytes", [_struct(b"")], "bad image: ValueError: image has neither bytes nor a path"),
        ("<image>truncated png", [_struct(_cut(good_png, 0.6))], "bad image: OSError: image file is truncated"),
        ("<image>truncated jpeg", [_struct(_cut(good_jpeg, 0.6))], "bad image: OSError: image file is truncated"),
        ("<image>huge header", [_struct(header_only_png(*HUGE))], "bad image: DecompressionBombError"),
        (
            "<image>near-limit header",
            [_struct(header_only_png(*NEAR_LIMIT))],
            "bad image: OSError: image file is truncated",
        ),
        (
            "<image><image>fine, then truncated",
            [_struct(good_png), _struct(_cut(good_png, 0.5))],
            "bad image: OSError: image file is truncated",
        ),
    ]


def _image_files(out: Path, ref: Reference, *, filter_overlong: bool) -> None:
    """3 files of 400 image rows (row groups of 50), ``BAD_IMAGE_AT`` bad; appends to ``ref``."""
    images = _small_images()
    good_png, good_jpeg = images[0][0], images[1][0]
    faults = _image_faults(good_png, good_jpeg)
    bad_at = {position: faults[k % len(faults)] for k, position in enumerate(BAD_IMAGE_AT)}
    for f in range(IMAGE_FILES):
        rows, path = [], str(out / f"images-{f}.parquet")
        for r in range(IMAGE_ROWS_PER_FILE):
            index = f * IMAGE_ROWS_PER_FILE + r
            if index in bad_at:
                text, media, reason = bad_at[index]
                if "near-limit" in text and filter_overlong:
                    ref.filtered.append(index)
                else:
                    ref.bad[(path, r)] = (index, "images", reason)
            else:
                count = 2 if index % 9 == 4 else 1  # some rows with two images
                media = [_struct(images[(index + k) % len(images)][0]) for k in range(count)]
                text = "<image>" * count + f"What is in figure {index}?"
                ref.good.append(index)
            rows.append((text, media))
        write_media_rows(path, rows, first_index=f * IMAGE_ROWS_PER_FILE, row_group_size=ROW_GROUP)
        ref.files.append(path)


def _video_file_rows(out: Path, ref: Reference, first_index: int) -> None:
    """``VIDEO_ROWS`` rows of mp4 files (``nframes`` 2: the processor still scales each frame up to its ~100k-pixel
    minimum, so few frames keep the pixel values small); ``BAD_VIDEO_AT`` are a corrupt, a cut and a zero-size file."""
    media = out / "media"
    media.mkdir(exist_ok=True)
    good = [make_video_file(media / f"clip-{k}.mp4", 12, 64, 64, 10, seed=k) for k in range(2)]
    whole = Path(make_video_file(media / "whole.mp4", 24, 64, 64, 10, faststart=True)).read_bytes()
    (media / "cut.mp4").write_bytes(_cut(whole, 0.6))  # the index reads whole (faststart), the frames stop short
    (media / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video at all")
    (media / "empty.mp4").write_bytes(b"")
    faults = [
        ("corrupt.mp4", "bad video: InvalidDataError"),
        ("cut.mp4", "bad video: ValueError: video has fewer frames than its header says"),
        ("empty.mp4", "bad video: ValueError: video file is empty"),
    ]
    bad = [str(media / name) for name, _ in faults]
    _video_rows(out / "videos.parquet", ref, first_index, bad, good, faults, {"nframes": 2})


def _frame_list_rows(out: Path, ref: Reference, first_index: int) -> None:
    """``VIDEO_ROWS`` rows of frame lists (2-4 frames of 48 px); ``BAD_VIDEO_AT`` hold a huge-header frame (20,000
    x 20,000) first, a zero-size frame last, and a huge-header frame between good ones."""
    from PIL import Image

    frames = out / "frames"
    frames.mkdir(exist_ok=True)
    rng = np.random.default_rng(7)
    paths = []
    for k in range(4):
        path = frames / f"frame-{k}.png"
        Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    (frames / "huge.png").write_bytes(header_only_png(*HUGE))
    (frames / "empty.png").write_bytes(b"")
    huge, empty = str(frames / "huge.png"), str(frames / "empty.png")
    bad = [[huge, paths[0]], [paths[0], empty], [paths[0], paths[1], huge, paths[2]]]
    reasons = [
        ("huge", "bad video: DecompressionBombError"),
        ("empty", "bad video: UnidentifiedImageError"),
        ("huge", "bad video: DecompressionBombError"),
    ]
    good = [paths[: 2 + k % 3] for k in range(3)]
    _video_rows(out / "frames.parquet", ref, first_index, bad, good, reasons, {})


def _video_rows(
    path: Path, ref: Reference, first_index: int, bad: list, good: list, faults: list, options: dict
) -> None:
    """``VIDEO_ROWS`` rows of one video each (``options`` added to every video dict), ``BAD_VIDEO_AT`` the ``bad``
    sources in turn, the others the ``good`` ones; appends to ``ref``."""
    rows = []
    for r in range(VIDEO_ROWS):
        index = first_index + r
        if r in BAD_VIDEO_AT:
            k = BAD_VIDEO_AT.index(r)
            video = bad[k]
            ref.bad[(str(path), r)] = (index, "videos", faults[k][1])
        else:
            video = good[r % len(good)]
            ref.good.append(index)
        rows.append((f"<video>What happens in clip {index}?", [{"video": video, **options}]))
    write_media_rows(path, rows, "videos", first_index=first_index, row_group_size=8)
    ref.files.append(str(path))


# --- actors that died or restarted ---------------------------------------------------------------------------------

# deaths that are a shutdown, not a failure: Ray Data's pool actors end with REF_DELETED once a dataset is done
_SHUTDOWN = ("RAY_KILL", "OUT_OF_SCOPE", "REF_DELETED")


def actor_failures() -> dict[str, str]:
    """Actor id -> what happened, for every actor of the cluster that was restarted or died of anything but a
    shutdown (an OOM kill, a worker crash, a failed constructor). From the GCS actor table: ``ray.util.state`` needs
    the dashboard, which the test session does not start."""
    from ray._private.state import actors
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    failures = {}
    for actor_id, info in actors().items():
        cause = info["DeathCause"]
        kind = cause.WhichOneof("context")  # None while the actor lives
        if kind == "actor_died_error_context":
            kind = ActorDiedErrorContext.Reason.Name(cause.actor_died_error_context.reason)
        if info["NumRestarts"] or (info["State"] == "DEAD" and kind is not None and kind not in _SHUTDOWN):
            what = str(cause).replace("\n", " ")[:300]
            failures[actor_id] = (
                f"{info['ActorClassName']} {info['State']} restarts={info['NumRestarts']} {kind}: {what}"
            )
    return failures


def test_actor_failures_sees_a_worker_that_died(ray_session):
    """The check the bad-media runs rely on: an actor whose process exits is reported (an actor killed by memory
    dies with an OOM context, or as here as a worker that died: either is reported)."""

    @ray.remote(num_cpus=0, max_restarts=0)
    class Doomed:
        def die(self) -> None:
            os._exit(1)

    before = actor_failures()
    doomed = Doomed.remote()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed.die.remote(), timeout=60)
    actor_id = doomed._actor_id.hex()
    deadline = time.monotonic() + 30
    while actor_id not in actor_failures() and time.monotonic() < deadline:  # the GCS hears of the death shortly
        time.sleep(0.2)
    assert set(actor_failures()) - set(before) == {actor_id}
    assert "WORKER_DIED" in actor_failures()[actor_id]


# --- the runs ------------------------------------------------------------------------------------------------------


def _dataset(out: Path, *, video: str, filter_overlong: bool) -> Reference:
    ref = Reference()
    out.mkdir()
    _image_files(out, ref, filter_overlong=filter_overlong)
    first = IMAGE_FILES * IMAGE_ROWS_PER_FILE
    (_video_file_rows if video == "files" else _frame_list_rows)(out, ref, first)
    return ref


def _output_indexes(output: Path) -> list[int]:
    parts = sorted(output.glob("part-*.parquet"))
    return [i for part in parts for i in pq.read_table(part, columns=["index"]).column("index").to_pylist()]


# (video kind, config): one run with verl's defaults (overlong filter on at 1,024 tokens, truncation "error"; this
# 4-CPU session lays every stage out in the tokenizer actors), one with the filter off, where near-limit headers reach
# the decode stage, here in a decode pool of its own as on a cluster. Its 2,048 tokens hold their ~1,280: a cut
# through an image's tokens (truncation left / right) fails the rope positions, in verl 0.5.0 as here
NO_FILTER = {"filter_overlong_prompts": False, "max_prompt_length": 2048}
RUNS: dict[str, tuple[str, dict]] = {
    "video files, defaults": ("files", {}),
    "frame lists, no overlong filter, three pools": (
        "frames",
        {**NO_FILTER, "decode_pool_max_size": 1, "vision_pool_max_size": 1},
    ),
}


@slow
@pytest.mark.parametrize("name", list(RUNS))
def test_bad_media_at_scale_quarantined_exactly(ray_session, model_dir, tmp_path, name):
    video, extra = RUNS[name]
    config = {"shuffle": False, **extra}
    ref = _dataset(tmp_path / "data", video=video, filter_overlong=config.get("filter_overlong_prompts", True))
    rows = IMAGE_FILES * IMAGE_ROWS_PER_FILE + VIDEO_ROWS
    assert len(ref.good) + len(ref.filtered) + len(ref.bad) == rows and 0.005 < len(ref.bad) / rows < 0.02
    failures_before = actor_failures()

    started = time.perf_counter()
    output = tmp_path / "out"
    summary = run_pipeline(ref.files, model_dir, config, processor=model_dir, output=str(output))
    elapsed = time.perf_counter() - started

    assert (summary.rows_in, summary.rows_out) == (rows, len(ref.good))
    assert (summary.filtered_overlong, summary.quarantined) == (len(ref.filtered), len(ref.bad))
    assert summary.rows_in == summary.rows_out + summary.filtered_overlong + summary.quarantined and summary.accounted
    assert summary.files_quarantined == 0  # the bad media cost their rows, never a whole file
    assert _output_indexes(output) == ref.good  # exactly the good rows, each once, in input order

    records = pq.read_table(summary.quarantine_file).to_pylist()
    located = [(r["file"], r["row"]) for r in records]
    assert len(set(located)) == len(located) == len(ref.bad)  # one record per bad row, none twice
    assert set(located) == set(ref.bad)
    for record in records:
        index, column, reason = ref.bad[(record["file"], record["row"])]
        assert record["column"] == column and record["rows"] == 1
        assert record["reason"].startswith(reason), (index, record["reason"])
        assert f'"index": {index}' in record["original"]  # the original row is the one the location names

    new_failures = {k: v for k, v in actor_failures().items() if k not in failures_before}
    assert not new_failures, new_failures  # no actor killed (by memory or a crash) or restarted during the run
    print(f"{name}: {rows} rows in {elapsed:.1f} s ({summary.rows_out} out, {summary.quarantined} quarantined)")
