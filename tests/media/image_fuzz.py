"""Mutated PNGs and JPEGs against PIL: the fuzzing behind ``tests/media/test_image_fuzz.py``.

Every case is made from its number alone (``mutated_image(case)``: a seeded random base image, then one to three
seeded mutations), so a failing case is reproduced by its number. ``disagreement(data)`` holds the image paths that
read untrusted bytes to PIL's ``Image.open(...).convert("RGB")``, what verl gets: ``decode_rgb`` (libdeflate, the
stored re-encode, libspng, PIL) must decode exactly what PIL decodes, to the same pixels and ``info``, and fail where
PIL fails, with the same exception type; the count's ``decode_rgb(pixels=False)`` must give the same verdict and size;
``png_decodes`` may vouch only for what PIL decodes.

``python -m tests.media.image_fuzz FIRST COUNT`` checks cases FIRST .. FIRST + COUNT - 1 and prints one JSON line:
the disagreements, the cases slower than ``--case-seconds``, and the counts of each kind. The tests run it in a
subprocess under a timeout, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import struct
import sys
import time
import warnings
import zlib
from functools import cache

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BASE_IMAGES = 48  # base images of each format; case n mutates one of them
# PIL's decompression-bomb limit while fuzzing (its default is 89M pixels): a flipped bit in a header's height makes
# images of millions of pixels that decode for seconds. Both sides open the file with PIL, so both refuse the same
# ones; tests/media/test_image_fuzz.py checks a header claiming far more than its data at the default limit.
FUZZ_MAX_IMAGE_PIXELS = 1_000_000


# --- base images ----------------------------------------------------------------------------------------------------


def _picture(rng: random.Random, width: int, height: int):
    """An RGB PIL image: flat areas, noise and lines (what compresses, and what does not)."""
    from PIL import Image, ImageDraw

    noise = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(noise // rng.choice([1, 4, 64]) + rng.randrange(64))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        (x0, x1), (y0, y1) = sorted(rng.randrange(width) for _ in "xx"), sorted(rng.randrange(height) for _ in "yy")
        draw.rectangle([x0, y0, x1, y1], fill=tuple(rng.randrange(256) for _ in "rgb"))
    return image


def _size(rng: random.Random) -> tuple[int, int]:
    # mostly small (fast cases); one in eight above 64 KB of RGB image data (several stored blocks after re-encode)
    if rng.random() < 0.125:
        return rng.randint(160, 240), rng.randint(100, 140)
    return rng.randint(1, 72), rng.randint(1, 56)


@cache
def base_png(index: int) -> bytes:
    """One of ``BASE_IMAGES`` valid PNGs: every colour type and bit depth PIL writes, text chunks before and after the
    image data, transparency, several image data chunks, APNG."""
    from PIL import Image, PngImagePlugin

    rng = random.Random(f"png base {index}")
    width, height = _size(rng)
    image = _picture(rng, width, height)
    kind = ["RGB", "RGBA", "L", "LA", "P", "P4", "1", "I;16", "RGB tRNS", "P tRNS", "L tRNS", "APNG"][index % 12]
    options: dict = {"compress_level": rng.choice([0, 1, 6, 9]), "optimize": rng.random() < 0.2}
    if rng.random() < 0.4:
        info = PngImagePlugin.PngInfo()
        info.add_text("comment", "before the pixels", zip=rng.random() < 0.5)
        info.add_itxt("title", "ünïcode", lang="en", tkey="title")
        options["pnginfo"] = info
    if kind == "RGBA":
        image.putalpha(image.convert("L"))
    elif kind in ("L", "LA", "L tRNS"):
        image = image.convert("L")
        if kind == "LA":
            image = Image.merge("LA", (image, image.point(lambda v: 255 - v)))
        if kind == "L tRNS":
            options["transparency"] = int(np.asarray(image)[0, 0])
    elif kind in ("P", "P4", "P tRNS"):
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=16 if kind == "P4" else 200)
        if kind == "P4":
            options["bits"] = 4
        if kind == "P tRNS":
            options["transparency"] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == "1":
        image = image.convert("1")
    elif kind == "I;16":
        image = Image.fromarray((np.asarray(image.convert("L"), dtype=np.uint16) * 257).astype(np.uint16))
    elif kind == "RGB tRNS":
        options["transparency"] = tuple(int(v) for v in np.asarray(image)[0, 0])
    buffer = io.BytesIO()
    if kind == "APNG":
        frames = [image, _picture(rng, width, height)]
        image.save(buffer, "PNG", save_all=True, append_images=frames[1:], default_image=rng.random() < 0.5)
    else:
        image.save(buffer, "PNG", **options)
    data = buffer.getvalue()
    if rng.random() < 0.3:  # the image data over several chunks, as other encoders write it
        data = _split_idat(data, rng)
    if kind == "RGB" and rng.random() < 0.5:  # text after the pixels (PIL reads it while loading)
        chunks = png_chunks(data)
        chunks.insert(len(chunks) - 1, [b"tEXt", b"comment\x00after the pixels", None])
        data = png_file(chunks)
    return data


@cache
def base_jpeg(index: int) -> bytes:
    """One of ``BASE_IMAGES`` valid JPEGs: baseline and progressive, colour and gray, CMYK, each subsampling, restart
    markers, EXIF, ICC and comment segments."""
    rng = random.Random(f"jpeg base {index}")
    width, height = _size(rng)
    image = _picture(rng, width, height)
    mode = ["RGB", "RGB", "L", "CMYK"][index % 4]
    options: dict = {
        "quality": rng.choice([30, 75, 95]),
        "progressive": index % 3 == 1,
        "optimize": rng.random() < 0.3,
    }
    if mode == "RGB":
        options["subsampling"] = rng.choice([0, 1, 2])
    if rng.random() < 0.3:
        options["restart_marker_blocks"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        options["comment"] = "a comment"
    if rng.random() < 0.2:
        options["exif"] = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\x00\x00"
    if rng.random() < 0.2:
        options["icc_profile"] = bytes(rng.randrange(256) for _ in range(rng.randint(10, 300)))
    buffer = io.BytesIO()
    image.convert(mode).save(buffer, "JPEG", **options)
    return buffer.getvalue()


# --- PNG structure --------------------------------------------------------------------------------------------------


def png_chunks(data: bytes) -> list[list]:
    """[kind, payload, crc or None] of each whole chunk after the signature; a cut or unparsable tail becomes one
    entry [None, tail bytes, None] (written back as it was)."""
    chunks, position = [], 8
    while position < len(data):
        if position + 12 > len(data):
            break
        (length,) = struct.unpack_from(">I", data, position)
        end = position + 12 + length
        if end > len(data):
            break
        chunks.append([data[position + 4 : position + 8], data[position + 8 : end - 4], data[end - 4 : end]])
        position = end
    if position < len(data):
        chunks.append([None, data[position:], None])
    return chunks


def png_file(chunks: list[list], signature: bytes = PNG_SIGNATURE) -> bytes:
    """Chunks back to bytes: a CRC of None is computed, one given is kept (right or wrong)."""
    out = [signature]
    for kind, payload, crc in chunks:
        if kind is None:
            out.append(payload)
            continue
        crc = crc if crc is not None else struct.pack(">I", zlib.crc32(kind + payload))
        out.append(struct.pack(">I", len(payload)) + kind + payload + crc)
    return b"".join(out)


def _with_fresh_crcs(chunks: list[list]) -> list[list]:
    return [[k, p, None if k is not None else c] for k, p, c in chunks]


def _idat_stream(chunks: list[list]) -> bytes:
    return b"".join(p for k, p, _ in chunks if k == b"IDAT")


def _replace_idat(chunks: list[list], pieces: list[bytes]) -> list[list]:
    """The chunks with the image data chunks (where the first was) replaced by ``pieces``, one chunk each."""
    first = next((i for i, (k, _, _) in enumerate(chunks) if k == b"IDAT"), None)
    rest = [c for c in chunks if c[0] != b"IDAT"]
    if first is None:
        first = len(rest) - 1 if rest and rest[-1][0] == b"IEND" else len(rest)
    else:
        first = sum(1 for c in chunks[:first] if c[0] != b"IDAT")
    return rest[:first] + [[b"IDAT", piece, None] for piece in pieces] + rest[first:]


def _pieces(stream: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.randint(1, 5)))
    bounds = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _split_idat(data: bytes, rng: random.Random) -> bytes:
    chunks = png_chunks(data)
    return png_file(_replace_idat(chunks, _pieces(_idat_stream(chunks), rng)))


def _inflated(stream: bytes) -> bytes:
    """As much of a zlib stream as inflates before its first error."""
    inflater, out = zlib.decompressobj(), []
    for start in range(0, len(stream), 256):
        try:
            out.append(inflater.decompress(stream[start : start + 256]))
        except zlib.error:
            break
    return b"".join(out)


# --- PNG mutations: each (data, rng) -> bytes -----------------------------------------------------------------------


def _flip_bits(data: bytes, rng: random.Random, start: int = 0, end: int | None = None) -> bytes:
    end = len(data) if end is None else min(end, len(data))
    if end <= start:
        return data
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        out[rng.randrange(start, end)] ^= 1 << rng.randrange(8)
    return bytes(out)


def truncate(data: bytes, rng: random.Random) -> bytes:
    """Cut anywhere (mostly), or just a few bytes short of the end; PNGs and JPEGs alike."""
    return data[: rng.randrange(len(data))] if rng.random() < 0.7 else data[: max(0, len(data) - rng.randint(1, 24))]


def png_flip(data: bytes, rng: random.Random) -> bytes:
    return _flip_bits(data, rng, 8 if rng.random() < 0.9 else 0)


def png_flip_payload(data: bytes, rng: random.Random) -> bytes:
    """Bits flipped inside one chunk's payload (the image data most often), its CRC made right again."""
    chunks = png_chunks(data)
    whole = [i for i, c in enumerate(chunks) if c[0] is not None and c[1]]
    if not whole:
        return png_flip(data, rng)
    idat = [i for i in whole if chunks[i][0] == b"IDAT"]
    i = rng.choice(idat if idat and rng.random() < 0.6 else whole)
    chunks[i] = [chunks[i][0], _flip_bits(chunks[i][1], rng), None]
    return png_file(chunks)


def png_length(data: bytes, rng: random.Random) -> bytes:
    chunks = png_chunks(data)
    whole = [i for i, c in enumerate(chunks) if c[0] is not None]
    if not whole:
        return truncate(data, rng)
    position = 8 + sum(12 + len(c[1]) for c in chunks[: rng.choice(whole)])
    (length,) = struct.unpack_from(">I", data, position)
    length = rng.choice([0, 1, length - 1, length + 1, length + rng.randint(2, 64), 2**31 - 1, 2**32 - 1, length // 2])
    return data[:position] + struct.pack(">I", max(0, length) & 0xFFFFFFFF) + data[position + 4 :]


def png_crc(data: bytes, rng: random.Random) -> bytes:
    chunks = png_chunks(data)
    whole = [i for i, c in enumerate(chunks) if c[0] is not None]
    if not whole:
        return png_flip(data, rng)
    i = rng.choice(whole)
    chunks[i][2] = _flip_bits(chunks[i][2], rng)
    return png_file(chunks)


def png_header(data: bytes, rng: random.Random) -> bytes:
    """One IHDR field changed (width, height, bit depth, colour type, compression, filter, interlace), CRC right
    (mostly)."""
    chunks = png_chunks(data)
    if not chunks or chunks[0][0] != b"IHDR" or len(chunks[0][1]) != 13:
        return png_flip(data, rng)
    width, height, depth, color, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    field = rng.randrange(7)
    if field == 0:
        width = rng.choice([0, 1, width - 1, width + 1, width * 2, rng.randint(1, 300), 2**31 - 1, 2**32 - 1])
    elif field == 1:
        height = rng.choice([0, 1, height - 1, height + 1, height * 2, rng.randint(1, 300), 2**31 - 1, 100_000])
    elif field == 2:
        depth = rng.choice([0, 1, 2, 3, 4, 8, 16, 32, 255])
    elif field == 3:
        color = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 255])
    elif field == 4:
        compression = rng.choice([1, 8, 255])
    elif field == 5:
        filtering = rng.choice([1, 64, 255])
    else:
        interlace = rng.choice([1, 2, 255])
    values = (width & 0xFFFFFFFF, height & 0xFFFFFFFF, depth, color, compression, filtering, interlace)
    chunks[0] = [b"IHDR", struct.pack(">IIBBBBB", *values), None if rng.random() < 0.9 else chunks[0][2]]
    return png_file(chunks)


def png_raw(data: bytes, rng: random.Random) -> bytes:
    """The inflated image data edited (a filter type byte, a sample, bytes cut or added), then deflated again into
    a sound stream: the soundness check passes and only the unfilter or the size can tell."""
    chunks = png_chunks(data)
    raw = bytearray(_inflated(_idat_stream(chunks)))
    edit = rng.randrange(5)
    if raw and edit == 0:  # a row's filter type: 0-4 are PNG's, the rest are not
        header = chunks[0][1] if chunks and chunks[0][0] == b"IHDR" and len(chunks[0][1]) == 13 else None
        height = struct.unpack_from(">I", header, 4)[0] if header else 1
        stride = max(1, len(raw) // max(1, height))
        raw[stride * rng.randrange(max(1, len(raw) // stride)) % len(raw)] = rng.choice([4, 5, 7, 128, 255])
    elif raw and edit == 1:
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif edit == 2:
        del raw[len(raw) - rng.randint(1, 1 + len(raw) // 4) :]
    elif edit == 3:
        raw += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    else:
        raw = raw[: len(raw) // 2] + bytes(4) + raw[len(raw) // 2 :]
    stream = zlib.compress(bytes(raw), rng.choice([0, 1, 6, 9]))
    return png_file(_replace_idat(chunks, _pieces(stream, rng) if rng.random() < 0.3 else [stream]))


def png_resplit(data: bytes, rng: random.Random) -> bytes:
    """The image data over other chunk boundaries (empty chunks included), or other chunks between its chunks."""
    chunks = png_chunks(data)
    chunks = _replace_idat(chunks, _pieces(_idat_stream(chunks), rng))
    if rng.random() < 0.4:
        idat = [i for i, c in enumerate(chunks) if c[0] == b"IDAT"]
        if idat:
            chunks.insert(rng.choice(idat) + 1, [rng.choice([b"tEXt", b"abcD", b"IEND"]), b"k\x00v", None])
    return png_file(chunks)


_ANCILLARY = [
    (b"tEXt", b"comment\x00some text"),
    (b"tEXt", b"no separator"),
    (b"zTXt", b"comment\x00\x00" + zlib.compress(b"compressed text")),
    (b"zTXt", b"comment\x00\x00not deflate"),
    (b"iTXt", b"title\x00\x00\x00en\x00title\x00text"),
    (b"tRNS", b"\x00\x01"),
    (b"tRNS", b"\x00\x01\x00\x02\x00\x03"),
    (b"tRNS", b"\xff" * 300),
    (b"PLTE", b"\x00\x10\x20" * 4),
    (b"PLTE", b"\x00\x10"),
    (b"gAMA", (45455).to_bytes(4, "big")),
    (b"gAMA", b"\x00"),
    (b"pHYs", b"\x00\x00\x0b\x13\x00\x00\x0b\x13\x01"),
    (b"pHYs", b"\x00\x00\x00\x00\x00\x00\x00\x00\x01"),
    (b"sRGB", b"\x00"),
    (b"iCCP", b"icc\x00\x00" + zlib.compress(b"not a profile")),
    (b"eXIf", b"MM\x00\x2a\x00\x00\x00\x08\x00\x00"),
    (b"tIME", b"\x07\xe8\x01\x01\x00\x00\x00"),
    (b"sBIT", b"\x08\x08\x08"),
    (b"bKGD", b"\x00\x00"),
    (b"cHRM", bytes(32)),
    (b"acTL", b"\x00\x00\x00\x02\x00\x00\x00\x00"),
    (b"fcTL", bytes(26)),
    (b"abcD", b"private"),
    (b"ABCD", b"critical, unknown"),
    (b"IEND", b""),
    (b"IDAT", b""),
    (b"IDAT", b"\x78\x01\x03\x00\x00\x00\x00\x01"),
    (b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0)),
]


def png_insert(data: bytes, rng: random.Random) -> bytes:
    chunks = png_chunks(data)
    kind, payload = rng.choice(_ANCILLARY)
    crc = None if rng.random() < 0.85 else b"\x00\x00\x00\x00"
    chunks.insert(rng.randint(0, len(chunks)), [kind, payload, crc])
    return png_file(chunks)


def png_remove(data: bytes, rng: random.Random) -> bytes:
    chunks = png_chunks(data)
    if len(chunks) > 1:
        del chunks[rng.randrange(len(chunks))]
    return png_file(chunks)


def png_duplicate(data: bytes, rng: random.Random) -> bytes:
    chunks = png_chunks(data)
    if chunks:
        chunks.insert(rng.randint(0, len(chunks)), list(chunks[rng.randrange(len(chunks))]))
    return png_file(chunks)


def png_move(data: bytes, rng: random.Random) -> bytes:
    chunks = png_chunks(data)
    if len(chunks) > 1:
        chunk = chunks.pop(rng.randrange(len(chunks)))
        chunks.insert(rng.randint(0, len(chunks)), chunk)
    return png_file(chunks)


def png_trailing(data: bytes, rng: random.Random) -> bytes:
    return data + rng.choice([b"\x00" * rng.randint(1, 9), bytes(rng.randrange(256) for _ in range(17)), data[8:40]])


def png_stream(data: bytes, rng: random.Random) -> bytes:
    """The zlib stream's own fields (header, a stored block's LEN / NLEN, the Adler-32, bytes after its end), each
    chunk's CRC right."""
    chunks = png_chunks(data)
    stream = bytearray(_idat_stream(chunks))
    if not stream:
        return png_flip(data, rng)
    edit = rng.randrange(5)
    if edit == 0:
        stream[rng.randrange(min(2, len(stream)))] ^= 1 << rng.randrange(8)
    elif edit == 1:
        stream[-1 - rng.randrange(min(4, len(stream)))] ^= 1 << rng.randrange(8)
    elif edit == 2:
        stream += bytes(rng.randrange(256) for _ in range(rng.randint(1, 12)))
    elif edit == 3:  # stored blocks, then the first one's LEN or NLEN edited
        stream = bytearray(zlib.compress(_inflated(bytes(stream)), 0))
        if len(stream) > 7:
            stream[rng.randrange(3, 7)] ^= 1 << rng.randrange(8)
    else:
        stream = bytearray(zlib.compress(_inflated(bytes(stream)), rng.choice([0, 9])))
        stream[2] = stream[2] & 0xFE  # the first block not final: the stream ends without its final block
    return png_file(_replace_idat(chunks, _pieces(bytes(stream), rng) if rng.random() < 0.3 else [bytes(stream)]))


PNG_MUTATIONS = [
    truncate,
    png_flip,
    png_flip_payload,
    png_length,
    png_crc,
    png_header,
    png_raw,
    png_resplit,
    png_insert,
    png_remove,
    png_duplicate,
    png_move,
    png_trailing,
    png_stream,
]


# --- JPEG structure and mutations -----------------------------------------------------------------------------------


def jpeg_segments(data: bytes) -> list[tuple[int, int]]:
    """(offset, end) of each marker segment from SOI up to and including the first SOS (its header only); a segment
    cut short ends with the data."""
    segments, position = [], 2
    while position + 4 <= len(data) and data[position] == 0xFF:
        marker = data[position + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            segments.append((position, position + 2))
            position += 2
            continue
        (length,) = struct.unpack_from(">H", data, position + 2)
        segments.append((position, min(position + 2 + length, len(data))))
        position += 2 + length
        if marker == 0xDA:
            break
    return segments


def jpeg_flip(data: bytes, rng: random.Random) -> bytes:
    return _flip_bits(data, rng, 2 if rng.random() < 0.9 else 0)


def jpeg_flip_scan(data: bytes, rng: random.Random) -> bytes:
    segments = jpeg_segments(data)
    start = segments[-1][1] if segments else 2
    return _flip_bits(data, rng, start, max(start, len(data) - 2))


def jpeg_flip_header(data: bytes, rng: random.Random) -> bytes:
    segments = jpeg_segments(data)
    end = segments[-1][1] if segments else len(data)
    return _flip_bits(data, rng, 2, end)


def jpeg_length(data: bytes, rng: random.Random) -> bytes:
    segments = [s for s in jpeg_segments(data) if s[1] - s[0] > 2]
    if not segments:
        return jpeg_flip(data, rng)
    start, end = rng.choice(segments)
    length = end - start - 2
    length = rng.choice([0, 1, 2, length - 1, length + 1, length + rng.randint(2, 64), 0xFFFF, length // 2])
    return data[: start + 2] + struct.pack(">H", max(0, length) & 0xFFFF) + data[start + 4 :]


def jpeg_remove(data: bytes, rng: random.Random) -> bytes:
    segments = jpeg_segments(data)
    if rng.random() < 0.2 or not segments:  # the end-of-image marker
        return data[:-2] if data.endswith(b"\xff\xd9") else data
    start, end = rng.choice(segments)
    return data[:start] + data[end:]


def jpeg_duplicate(data: bytes, rng: random.Random) -> bytes:
    segments = jpeg_segments(data)
    if not segments:
        return jpeg_flip(data, rng)
    start, end = rng.choice(segments)
    at = rng.choice(segments)[rng.randrange(2)]
    return data[:at] + data[start:end] + data[at:]


def jpeg_frame(data: bytes, rng: random.Random) -> bytes:
    """One field of the frame header (SOF): precision, height, width, component count, a component's sampling
    factors or quantization table."""
    frames = [s for s in jpeg_segments(data) if 0xC0 <= data[s[0] + 1] <= 0xCF and data[s[0] + 1] not in (0xC4, 0xCC)]
    if not frames:
        return jpeg_flip_header(data, rng)
    start, end = frames[0]
    end = min(end, len(data))
    if end < start + 10:
        return jpeg_flip_header(data, rng)
    out = bytearray(data)
    field = rng.randrange(6)
    if field == 0:
        out[start + 4] = rng.choice([0, 1, 7, 12, 16, 255])
    elif field in (1, 2):
        value = rng.choice([0, 1, 2, 7, 8, 9, 15, 16, 17, 100, 1000, 4096])
        out[start + 5 + 2 * (field - 1) : start + 7 + 2 * (field - 1)] = struct.pack(">H", value)
    elif field == 3:
        out[start + 9] = rng.choice([0, 1, 2, 3, 4, 5, 255])
    elif end - start > 12:
        component = start + 10 + 3 * rng.randrange(max(1, (end - start - 10) // 3))
        if component + 2 < end:
            out[component + (1 if field == 4 else 2)] = rng.choice([0, 0x11, 0x12, 0x21, 0x22, 0x44, 0x55, 0xFF, 4])
    return bytes(out)


_MARKERS = [0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC9, 0xCF, 0xC4, 0xCC, 0xDB, 0xDD, 0xDA, 0xD9, 0xD8, 0xD0, 0xE0, 0xE1]
_MARKERS += [0xEE, 0xFE, 0x01, 0xFF, 0x00]


def jpeg_marker(data: bytes, rng: random.Random) -> bytes:
    segments = jpeg_segments(data)
    if not segments:
        return jpeg_flip(data, rng)
    start, _ = rng.choice(segments)
    return data[: start + 1] + bytes([rng.choice(_MARKERS)]) + data[start + 2 :]


def jpeg_scan_insert(data: bytes, rng: random.Random) -> bytes:
    """Markers and bytes in the entropy-coded data: restart markers, fill bytes, a stuffed zero, an early EOI."""
    segments = jpeg_segments(data)
    start = segments[-1][1] if segments else 2
    at = rng.randint(start, max(start, len(data) - 2))
    junk = rng.choice([b"\xff\xd0", b"\xff\xd7", b"\xff\xff\xff", b"\xff\x00", b"\xff\xd9", b"\x00" * 5, b"\xff\xc4"])
    return data[:at] + junk + data[at:]


def jpeg_scan_header(data: bytes, rng: random.Random) -> bytes:
    """A field of the scan header (SOS): component count or selector, tables, spectral selection, approximation."""
    scans = [s for s in jpeg_segments(data) if data[s[0] + 1] == 0xDA]
    if not scans:
        return jpeg_flip_header(data, rng)
    start, end = scans[0]
    end = min(end, len(data))
    if end <= start + 4:
        return jpeg_flip_header(data, rng)
    out = bytearray(data)
    out[rng.randrange(start + 4, end)] = rng.choice([0, 1, 2, 3, 4, 0x11, 0x3F, 0x40, 0xFF])
    return bytes(out)


def jpeg_ending(data: bytes, rng: random.Random) -> bytes:
    body = data[:-2] if data.endswith(b"\xff\xd9") else data
    endings = [b"", b"\xff\xd9\xff\xd9", b"\xff\xd9" + bytes(7), b"\xff\xd9garbage", bytes(3), b"\xff"]
    return body + rng.choice(endings)


def jpeg_restart_interval(data: bytes, rng: random.Random) -> bytes:
    """A DRI segment (restart interval) inserted or changed: the decoder then expects markers the data may lack."""
    segments = jpeg_segments(data)
    if not segments:
        return jpeg_flip(data, rng)
    at = rng.choice(segments)[0]
    return data[:at] + b"\xff\xdd\x00\x04" + struct.pack(">H", rng.choice([0, 1, 2, 7, 0xFFFF])) + data[at:]


JPEG_MUTATIONS = [
    truncate,
    jpeg_flip,
    jpeg_flip_scan,
    jpeg_flip_header,
    jpeg_length,
    jpeg_remove,
    jpeg_duplicate,
    jpeg_frame,
    jpeg_marker,
    jpeg_scan_insert,
    jpeg_scan_header,
    jpeg_ending,
    jpeg_restart_interval,
]


# --- cases and the check --------------------------------------------------------------------------------------------


def mutated_image(case: int) -> tuple[str, bytes, list[str]]:
    """(format, bytes, the mutations applied) of case number ``case``: even cases PNGs, odd ones JPEGs; one in
    sixteen left unmutated (the valid bases go through the fast paths)."""
    rng = random.Random(f"image fuzz case {case}")
    is_png = case % 2 == 0
    data = (base_png if is_png else base_jpeg)(rng.randrange(BASE_IMAGES))
    applied: list[str] = []
    if rng.random() >= 1 / 16:
        mutations = PNG_MUTATIONS if is_png else JPEG_MUTATIONS
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            mutation = rng.choice(mutations)
            data = mutation(data, rng)
            applied.append(mutation.__name__)
    return ("png" if is_png else "jpeg"), data, applied


def _outcome(decode, data: bytes):
    """(pixels, info, None) or (None, None, the exception's type name)."""
    try:
        pixels, info = decode(data)
    except Exception as error:
        return None, None, type(error).__name__
    return pixels, info, None


def _pil_rgb(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        return np.asarray(rgb), dict(rgb.info)


def disagreement(data: bytes) -> tuple[str | None, bool]:
    """(where the image paths part from PIL on ``data``, in words, or None where they agree; whether PIL decodes
    it)."""
    pil_pixels, pil_info, pil_error = _outcome(_pil_rgb, data)
    return _problem(data, pil_pixels, pil_info, pil_error), pil_error is None


def _problem(data: bytes, pil_pixels, pil_info, pil_error: str | None) -> str | None:
    from PIL import Image

    from ingest.media.image import decode_rgb, plain_png, png_decodes, stored_png

    pixels, info, error = _outcome(decode_rgb, data)
    if (pil_error is None) != (error is None):
        return f"decode_rgb: {error or 'decodes'}, PIL: {pil_error or 'decodes'}"
    if error != pil_error:
        return f"decode_rgb fails with {error}, PIL with {pil_error}"
    if error is None:
        if pixels.dtype != np.uint8 or pixels.shape != pil_pixels.shape or not np.array_equal(pixels, pil_pixels):
            return f"decode_rgb pixels {pixels.shape} differ from PIL's {pil_pixels.shape}"
        if info != pil_info:
            return f"decode_rgb info {info!r} differs from PIL's {pil_info!r}"
    counted, counted_info, counted_error = _outcome(lambda d: decode_rgb(d, pixels=False), data)
    if counted_error != pil_error:
        return f"decode_rgb(pixels=False): {counted_error or 'decodes'}, PIL: {pil_error or 'decodes'}"
    if counted_error is None and (counted.shape[:2] != pil_pixels.shape[:2] or counted_info != pil_info):
        return f"decode_rgb(pixels=False) gives {counted.shape[:2]} and {counted_info!r}, PIL {pil_pixels.shape[:2]}"
    if data[:8] == PNG_SIGNATURE:
        plain_png(data)  # a verdict on any bytes, no exception
        try:
            with Image.open(io.BytesIO(data)) as image:
                vouched = png_decodes(data, image)
        except Exception:  # PIL cannot open it: png_decodes is never asked
            vouched = False
        if vouched and pil_error is not None:
            return f"png_decodes vouches for a PNG PIL rejects ({pil_error})"
        stored = stored_png(data)
        if stored is not None and pil_error is None and not np.array_equal(_pil_rgb(stored)[0], pil_pixels):
            return "stored_png's pixels differ from the file's"
    return None


def check_cases(first: int, count: int, case_seconds: float = 2.0) -> dict:
    """Cases ``first`` .. ``first + count - 1``: the disagreements and slow cases by number, and tallies. A case is
    slow past ``case_seconds`` of CPU time (not wall time: the machine may be shared); a hang that burns none is the
    caller's timeout's to catch."""
    from PIL import Image

    failures, slow = {}, {}
    tally = {"png": 0, "jpeg": 0, "pil_decodes": 0, "pil_fails": 0}
    started = time.perf_counter()
    Image.MAX_IMAGE_PIXELS = FUZZ_MAX_IMAGE_PIXELS
    with warnings.catch_warnings():  # PIL's warnings on odd files (EXIF, decompression bomb) are not verdicts
        warnings.simplefilter("ignore")
        for case in range(first, first + count):
            kind, data, applied = mutated_image(case)
            case_started = time.process_time()
            try:
                problem, pil_decodes = disagreement(data)
            except Exception as error:  # the check itself crashed: a path raised where it must not
                problem, pil_decodes = f"crash: {type(error).__name__}: {error}", False
            seconds = time.process_time() - case_started
            if problem is not None:
                failures[case] = f"{kind} {'+'.join(applied) or 'unmutated'}: {problem}"
            if seconds > case_seconds:
                slow[case] = round(seconds, 2)
            tally[kind] += 1
            tally["pil_decodes" if pil_decodes else "pil_fails"] += 1
    return {"failures": failures, "slow": slow, "tally": tally, "seconds": round(time.perf_counter() - started, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.media.image_fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--case-seconds", type=float, default=2.0, help="a case using more CPU seconds fails")
    parser.add_argument("--cases", type=int, nargs="*", help="these case numbers instead of the range")
    args = parser.parse_args(argv)
    if args.cases:
        results = [check_cases(case, 1, args.case_seconds) for case in args.cases]
        merged = {"failures": {}, "slow": {}, "tally": {}, "seconds": sum(r["seconds"] for r in results)}
        for result in results:
            merged["failures"].update(result["failures"])
            merged["slow"].update(result["slow"])
            for key, value in result["tally"].items():
                merged["tally"][key] = merged["tally"].get(key, 0) + value
        print(json.dumps(merged))
    else:
        print(json.dumps(check_cases(args.first, args.count, args.case_seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
