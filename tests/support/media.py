"""Media test data: Parquet rows of media, the sample images the pixel tests run on, the torchcodec skip."""

from __future__ import annotations

import numpy as np
import pytest


def write_media_rows(
    path,
    rows: list[tuple[str, list]],
    column: str = "images",
    *,
    first_index: int = 0,
    row_group_size: int | None = None,
) -> str:
    """Parquet of (user prompt, media) rows, the media in ``column``, ``extra_info.index`` numbering them from
    ``first_index`` (so rows spread over several files keep one numbering), ``row_group_size`` rows per row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [
            {"prompt": [{"role": "user", "content": text}], column: media, "extra_info": {"index": first_index + i}}
            for i, (text, media) in enumerate(rows)
        ]
    )
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def write_path_string_image_rows(directory, rows: int = 16, seed: int = 2) -> str:
    """Parquet of geo3k rows whose image values are path strings (each image written to a file of its own)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tools.samples import geo3k_rows

    table_rows = geo3k_rows(rows, seed=seed)
    for row in table_rows:
        paths = []
        for k, image in enumerate(row["images"]):
            target = directory / "images" / f"{row['extra_info']['index']}-{k}.img"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(image["bytes"])
            paths.append(str(target))
        row["images"] = paths
    path = directory / "path-strings.parquet"
    pq.write_table(pa.Table.from_pylist(table_rows), path, row_group_size=8)
    return str(path)


def good_and_cut_video_files(directory) -> tuple[str, str]:
    """A video file, and a copy of it whose index reads whole (faststart) but whose frames stop at 60% of the file:
    the tokenize stage plans it from the header, decoding comes up short."""
    from tools.samples import make_video_file

    good = make_video_file(directory / "good.mp4", 24, 64, 64, 10, faststart=True)
    data = open(good, "rb").read()
    (directory / "cut.mp4").write_bytes(data[: int(len(data) * 0.6)])
    return str(good), str(directory / "cut.mp4")


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header (valid signature, IHDR, CRCs) claims ``width`` x ``height`` RGB but whose image data are a
    few bytes: a reader that trusts the header would plan (or allocate) the whole image before finding out."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def sample_rgbs() -> list[np.ndarray]:
    """RGB arrays of every image kind of the parity data (two each) and one over the pixel budget."""
    import random

    from tools.samples import IMAGE_KINDS, make_image

    rng = random.Random(3)
    images = [make_image(kind, rng)[0].convert("RGB") for kind in IMAGE_KINDS for _ in range(2)]
    big = np.asarray(make_image("png", rng)[0].convert("RGB").resize((1400, 1100)))  # over the pixel budget
    return [np.asarray(image) for image in images] + [big]


def needs_torchcodec():
    """Skip where torchcodec's video decoder does not load (``make test`` gives it PyAV's FFmpeg libraries)."""
    from ingest.media.video import torchcodec_error, torchcodec_loads

    if not torchcodec_loads():
        pytest.skip(f"torchcodec does not load here ({torchcodec_error()}); `make test` sets LD_LIBRARY_PATH for it")
