"""Mutated PNGs and JPEGs (``tests/media/image_fuzz.py``: truncations, bit flips, chunk and segment edits) through the
image paths that read untrusted bytes: each decodes exactly what PIL decodes, to PIL's pixels and ``info``, fails
where PIL fails, and neither crashes nor hangs. Each run is a subprocess under a timeout, so a hang fails the test."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
FIXED_CASES = 400  # the fast tier's seeded set: cases 0..399, PNGs and JPEGs alternating
# cases the fuzzing found: APNG frame control chunks before the image data (PIL lays the first frame out from them,
# and reads its data from an fdAT chunk there may be; png_decodes vouched for such files and libspng decoded their
# IDAT), and a second IHDR (PIL takes the last; png_decodes had read the first)
FOUND_CASES = (1406, 1684, 5380, 6406, 21098, 38708)
SLOW_FIRST, SLOW_CASES = 100_000, 20_000  # the full tier's set, apart from the fixed one


def _fuzz(first: int, count: int, timeout: float, cases: tuple[int, ...] = ()) -> dict:
    command = [sys.executable, "-m", "tests.media.image_fuzz", str(first), str(count)]
    if cases:
        command += ["--cases", *map(str, cases)]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_agrees(result: dict) -> None:
    reproduce = "reproduce with: python -m tests.media.image_fuzz 0 1 --cases N"
    assert not result["failures"], f"{len(result['failures'])} disagreements ({reproduce}): {result['failures']}"
    assert not result["slow"], f"cases over 2 s of CPU each: {result['slow']}"


def test_fixed_mutated_images_decode_as_pil_does():
    """The seeded set of the fast tier (PNG and JPEG mutations, the cases fuzzing found) agrees with PIL."""
    result = _fuzz(0, FIXED_CASES, timeout=300)
    found = _fuzz(0, 0, timeout=120, cases=FOUND_CASES)
    _assert_agrees(result)
    _assert_agrees(found)
    assert result["tally"]["png"] == result["tally"]["jpeg"] == FIXED_CASES // 2
    assert min(result["tally"]["pil_decodes"], result["tally"]["pil_fails"]) > FIXED_CASES // 5  # both verdicts


@pytest.mark.slow
def test_twenty_thousand_mutated_images_decode_as_pil_does():
    """20,000 more cases, in two processes (one per core) under a timeout."""
    half = SLOW_CASES // 2
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda first: _fuzz(first, half, timeout=900), (SLOW_FIRST, SLOW_FIRST + half)))
    for result in runs:
        _assert_agrees(result)
    assert sum(r["tally"]["png"] + r["tally"]["jpeg"] for r in runs) == SLOW_CASES


def test_a_png_header_claiming_more_than_its_data_allocates_nothing():
    """A PNG whose header claims 81M pixels (under PIL's bomb limit) over a few bytes of data: the soundness check
    and the re-encode refuse it without allocating the claimed size (deflate's 1032:1 ratio bounds what the data can
    hold); PIL decides, as for any data that is not sound."""
    import struct
    import tracemalloc
    import zlib

    from PIL import Image

    from ingest.media.image import png_decodes, stored_png

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 9000, 9000, 8, 6, 0, 0, 0))
    data = b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(bytes(5000))) + chunk(b"IEND", b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data)) as image:
            tracemalloc.start()
            try:
                assert stored_png(data) is None and not png_decodes(data, image)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    assert peak < 1 << 20, peak  # the claimed image data is 324 MB


def test_apng_first_frames_decode_as_pil_does():
    """APNGs go to PIL as they are: its first frame follows the frame control chunks (a default image in or out of
    the animation), which libspng and the soundness check do not read."""
    from PIL import Image

    from ingest.media.image import decode_rgb, plain_png, png_decodes, stored_png

    frames = [Image.fromarray(np.full((20, 30, 3), value, dtype=np.uint8)) for value in (40, 200)]
    for default_image in (False, True):
        buffer = io.BytesIO()
        frames[0].save(buffer, "PNG", save_all=True, append_images=frames[1:], default_image=default_image)
        data = buffer.getvalue()
        with Image.open(io.BytesIO(data)) as image:
            assert not png_decodes(data, image)
            expected = np.asarray(image.convert("RGB"))
        assert stored_png(data) is None and not plain_png(data)
        assert np.array_equal(decode_rgb(data)[0], expected)
        assert decode_rgb(data, pixels=False)[0].shape[:2] == expected.shape[:2]
