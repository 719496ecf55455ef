"""Image decode (``ingest/media/image.py``): which JPEGs are left to the device decoder, libspng for plain PNGs, the
PNG image data inflated by libdeflate; pixels and ``info`` always PIL's ``convert("RGB")`` (what verl gets)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tools.samples import encode_image, make_image


def test_only_complete_baseline_jpegs_are_left_to_the_device():
    import random

    from PIL import Image

    from ingest.media.image import decode_rgb, deferrable_jpeg

    rng = random.Random(5)
    jpeg = encode_image(*make_image("jpeg", rng))
    size, info = deferrable_jpeg(jpeg)
    rgb, rgb_info = decode_rgb(jpeg)
    assert size.shape[:2] == rgb.shape[:2] and size.size == 0 and info == rgb_info
    gray = io.BytesIO()
    Image.new("L", (40, 30), 7).save(gray, "JPEG")
    assert deferrable_jpeg(gray.getvalue())[1] == decode_rgb(gray.getvalue())[1]
    progressive, cmyk = io.BytesIO(), io.BytesIO()
    Image.fromarray(rgb).save(progressive, "JPEG", progressive=True)
    Image.new("CMYK", (40, 30)).save(cmyk, "JPEG")
    png = encode_image(*make_image("png", rng))
    # the rest decodes on the CPU in the decode stage, where a truncated file becomes a quarantine record
    assert all(deferrable_jpeg(data) is None for data in (progressive.getvalue(), cmyk.getvalue(), png, jpeg[:-300]))


def _png_chunks(data: bytes) -> list[list[bytes]]:
    """[kind, payload] per chunk of a PNG file."""
    import struct

    chunks, position = [], 8
    while position < len(data):
        (length,) = struct.unpack_from(">I", data, position)
        chunks.append([data[position + 4 : position + 8], data[position + 8 : position + 8 + length]])
        position += 12 + length
    return chunks


def _png_file(chunks: list[list[bytes]]) -> bytes:
    import struct
    import zlib

    body = [struct.pack(">I", len(p)) + k + p + struct.pack(">I", zlib.crc32(k + p)) for k, p in chunks]
    return b"\x89PNG\r\n\x1a\n" + b"".join(body)


def _pil_rgb(data: bytes):
    """What verl gets: PIL's ``convert("RGB")`` pixels and ``info``."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        return np.asarray(rgb), dict(rgb.info)


def test_png_fast_decode_gives_pils_pixels_and_info():
    """8-bit RGB / RGBA PNGs decode with libspng; everything else, and whatever libspng refuses, with PIL. Either
    way the pixels and ``info`` are what PIL's ``convert("RGB")`` gives (what verl gets)."""
    import random

    from PIL import Image

    from ingest.media.image import decode_rgb, plain_png

    rng = random.Random(11)
    buf = io.BytesIO()
    make_image("png", rng)[0].convert("RGB").save(buf, "PNG", dpi=(72, 72))
    rgb = buf.getvalue()
    rgba = encode_image(*make_image("rgba", rng))
    chunks = _png_chunks(rgb)
    text = [b"tEXt", b"comment\x00after the pixels"]
    text_after_pixels = _png_file([*chunks[:-1], text, chunks[-1]])
    unknown_chunk = _png_file([chunks[0], [b"ABCD", b"x"], *chunks[1:]])  # PIL skips it; libspng refuses the file
    gamma = _png_file([chunks[0], [b"gAMA", (45455).to_bytes(4, "big")], *chunks[1:]])  # neither decoder applies it
    deep = encode_image(Image.fromarray(np.full((30, 40), 300, dtype=np.uint16)), "PNG")  # 16-bit gray
    assert plain_png(rgb) and plain_png(rgba) and plain_png(unknown_chunk) and plain_png(gamma)
    assert not plain_png(text_after_pixels) and not plain_png(deep) and not plain_png(rgb[: len(rgb) // 2])
    cases = {"rgb": rgb, "rgba": rgba, "text": text_after_pixels, "unknown": unknown_chunk, "gamma": gamma}
    cases["16-bit"] = deep
    for name, data in cases.items():
        ours, theirs = decode_rgb(data), _pil_rgb(data)
        assert ours[0].dtype == np.uint8 and np.array_equal(ours[0], theirs[0]), name
        assert ours[1] == theirs[1], name
    assert decode_rgb(text_after_pixels)[1]["comment"] == "after the pixels"


def test_png_image_data_inflated_by_libdeflate_decodes_to_pils_pixels():
    """``stored_png``: the image data inflated by libdeflate and stored uncompressed, every other chunk kept, for
    every PNG kind (split image data, text after it included); ``decode_rgb`` then gives PIL's pixels and info.
    Whatever is not sound (a wrong CRC, data that does not inflate to the header's size, interlacing) is left to
    the decoder as it is, so it accepts or rejects it as PIL does."""
    import random
    import struct
    import zlib

    from PIL import Image

    from ingest.media.image import decode_rgb, stored_png

    rng = random.Random(12)
    kinds = {kind: encode_image(*make_image(kind, rng)) for kind in ("png", "gray", "palette", "rgba", "wide")}
    rgb = kinds["png"]
    kinds["16-bit"] = encode_image(Image.fromarray(np.full((30, 41), 300, dtype=np.uint16)), "PNG")
    kinds["1-bit"] = encode_image(Image.fromarray(np.eye(29, dtype=bool)), "PNG")
    chunks = _png_chunks(rgb)
    data = b"".join(p for k, p in chunks if k == b"IDAT")
    thirds = [data[: len(data) // 3], data[len(data) // 3 : 2 * len(data) // 3], data[2 * len(data) // 3 :]]
    kinds["split"] = _png_file([chunks[0], *([b"IDAT", t] for t in thirds), chunks[-1]])
    kinds["text after"] = _png_file([*chunks[:-1], [b"tEXt", b"comment\x00after"], chunks[-1]])
    for name, png in kinds.items():
        stored = stored_png(png)
        assert stored is not None and [k for k, _ in _png_chunks(stored)].count(b"IDAT") == 1, name
        assert [c for c in _png_chunks(stored) if c[0] != b"IDAT"] == [c for c in _png_chunks(png) if c[0] != b"IDAT"]
        ours, theirs = decode_rgb(png), _pil_rgb(png)
        assert np.array_equal(ours[0], theirs[0]) and ours[1] == theirs[1], name
        assert np.array_equal(_pil_rgb(stored)[0], theirs[0]), name
    assert decode_rgb(kinds["text after"])[1]["comment"] == "after"

    idat = next(k for k, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    bad_crc = bytearray(rgb)
    bad_crc[8 + sum(12 + len(p) for _, p in chunks[: idat + 1]) - 1] ^= 1  # the first IDAT chunk's CRC
    flipped = bytearray(chunks[idat][1])
    flipped[len(flipped) // 2] ^= 0x55  # inside the deflate stream, CRC recomputed: inflate or checksum fails
    bad_data = _png_file([*chunks[:idat], [b"IDAT", bytes(flipped)], *chunks[idat + 1 :]])
    short = _png_file([*chunks[:idat], [b"IDAT", zlib.compress(zlib.decompress(data)[:-7])], *chunks[idat + 1 :]])
    interlaced = rgb[:28] + b"\x01" + rgb[29:]
    for name, png in {"crc": bytes(bad_crc), "data": bad_data, "short": short, "interlaced": interlaced}.items():
        assert stored_png(png) is None, name
        try:
            expected = _pil_rgb(png)
        except Exception as error:  # PIL rejects it: so does decode_rgb
            with pytest.raises(type(error)):
                decode_rgb(png)
        else:
            assert np.array_equal(decode_rgb(png)[0], expected[0]), name
    assert struct.unpack_from(">I", stored_png(rgb), 8)[0] == 13  # IHDR first, untouched


def test_a_count_decodes_as_the_epoch_does_without_the_pixels_copy():
    """``decode_rgb(pixels=False)``: where PIL decodes, the same decode (a truncated image fails the same way) and
    ``info``, the size in an empty (H, W, 0) array instead of the pixels."""
    import random

    from ingest.media.image import decode_rgb

    rng = random.Random(13)
    for kind in ("png", "gray", "palette", "rgba", "jpeg"):
        data = encode_image(*make_image(kind, rng))
        pixels, info = decode_rgb(data)
        counted, counted_info = decode_rgb(data, pixels=False)
        assert counted.shape[:2] == pixels.shape[:2] and counted_info == info, kind
        if counted.shape[2] == 0:  # PIL decoded it (libspng's plain RGB PNGs keep their array)
            assert counted.dtype == np.uint8, kind
        cut = data[: len(data) // 2]
        with pytest.raises(Exception) as full:
            decode_rgb(cut)
        with pytest.raises(Exception) as count:
            decode_rgb(cut, pixels=False)
        assert (type(count.value), str(count.value)) == (type(full.value), str(full.value)), kind


def test_a_count_knows_sound_pngs_decode_and_decodes_the_rest():
    """``png_decodes``: a sound PNG (data inflating to the header's size, only ``IEND`` after it, <= 8-bit samples,
    valid row filters) is known to decode without unfiltering it; the verdict of ``decode_rgb(pixels=False)`` is the
    full decode's on every kind, including those it leaves to the decoder (a bad filter byte in sound data, text
    after the pixels, 16-bit samples, transparency to convert, no ``IEND``)."""
    import random
    import zlib

    from PIL import Image

    from ingest.media.image import decode_rgb, png_decodes

    rng = random.Random(14)
    kinds = {kind: encode_image(*make_image(kind, rng)) for kind in ("png", "gray", "palette", "rgba", "tall")}
    kinds["1-bit"] = encode_image(Image.fromarray(np.eye(29, dtype=bool)), "PNG")
    rgb = kinds["png"]
    chunks = _png_chunks(rgb)
    idat = next(k for k, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    known = set(kinds)
    kinds["16-bit"] = encode_image(Image.fromarray(np.full((30, 41), 300, dtype=np.uint16)), "PNG")
    gray = _png_chunks(encode_image(Image.fromarray(np.arange(192, dtype=np.uint8).reshape(8, 24)), "PNG"))
    kinds["gray, transparent"] = _png_file([gray[0], [b"tRNS", b"\x01\x2c"], *gray[1:]])  # 300: beyond 8 bits
    kinds["text after"] = _png_file([*chunks[:-1], [b"tEXt", b"comment\x00after"], chunks[-1]])
    kinds["no IEND"] = _png_file(chunks[:-1])
    raw = bytearray(zlib.decompress(b"".join(p for k, p in chunks if k == b"IDAT")))
    raw[3 * (len(raw) // Image.open(io.BytesIO(rgb)).height)] = 7  # the fourth row's filter type: no such filter
    kinds["bad filter"] = _png_file([*chunks[:idat], [b"IDAT", zlib.compress(bytes(raw))], chunks[-1]])
    kinds["cut"] = rgb[: len(rgb) // 2]
    failed = set()
    for name, data in kinds.items():
        with Image.open(io.BytesIO(data)) as image:
            assert png_decodes(data, image) == (name in known), name
        try:
            pixels, info = decode_rgb(data)
        except Exception as error:
            with pytest.raises(type(error)):
                decode_rgb(data, pixels=False)
            failed.add(name)
        else:
            counted, counted_info = decode_rgb(data, pixels=False)
            assert counted.shape[:2] == pixels.shape[:2] and counted_info == info, name
    assert failed == {"bad filter", "cut"}
