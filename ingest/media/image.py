"""Image values as they appear in Parquet, and their decoding to RGB exactly as verl does (PIL ``convert("RGB")``),
with libspng / libdeflate where they give the same pixels faster, and nvJPEG on a device.
"""

from __future__ import annotations

import io
import struct

import numpy as np

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# APNG's chunks: PIL takes the first frame's region and data from them, which neither libspng nor the checks here read
_ANIMATION_CHUNKS = (b"acTL", b"fcTL", b"fdAT")
# deflate's largest ratio (a 258-byte match in two bits): a stream shorter than 1 / 1032 of the size cannot fill it
_DEFLATE_MAX_RATIO = 1032
# where PIL's getexif finds a PNG's Orientation (an eXIf chunk, ImageMagick's exif text, XMP): a PNG with none of
# these names in its bytes has none, and is never decoded to be sure
_PNG_ORIENTATION_SOURCES = (b"eXIf", b"Raw profile type exif", b"XML:com.adobe.xmp")
# EXIF orientations whose turn swaps width and height (transpose, 270, transverse, 90 degrees)
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})


def exif_orientation(image, data: bytes) -> int | None:
    """The EXIF Orientation PIL's ``getexif()`` gives ``image`` (opened from ``data``) once loaded, as HF datasets
    asks it; None where there is none. A JPEG's header holds all of it (no decode); a PNG is decoded only where its
    bytes name a source of one."""
    from PIL import ExifTags

    if image.format == "PNG" and not any(source in data for source in _PNG_ORIENTATION_SOURCES):
        return None
    if image.format != "JPEG":
        image.load()
    return image.getexif().get(ExifTags.Base.Orientation)


def image_source(value) -> tuple[bytes | None, str | None]:
    """(encoded bytes, path) of one image value: an HF ``Image()`` struct ``{bytes, path}``, raw bytes or a path."""
    if isinstance(value, dict):
        return value.get("bytes"), value.get("path")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), None
    if isinstance(value, str):
        return None, value
    raise ValueError(f"unsupported image value of type {type(value).__name__}")


def read_image_bytes(value, storage_options: dict | None = None) -> bytes:
    data, path = image_source(value)
    if data:
        return data
    if not path:
        raise ValueError("image has neither bytes nor a path")
    from ingest.read.files import filesystem_for, protocol_of

    if protocol_of(path) == "file":
        with open(path.removeprefix("file://"), "rb") as f:
            return f.read()
    with filesystem_for(path, storage_options).open(path, "rb") as f:
        return f.read()


def _complete_jpeg(data: bytes) -> bool | None:
    """None when ``data`` is not a JPEG; else whether it ends with its end-of-image marker (trailing zeros allowed)."""
    if data[:2] != b"\xff\xd8":
        return None
    return data.rstrip(b"\x00")[-2:] == b"\xff\xd9"


def check_complete(data: bytes) -> None:
    """Raise ``OSError`` for an image file cut short, without decoding pixels: a PNG's chunks are read to ``IEND``
    with their CRCs checked (PIL ``verify``; stricter than decoding in one case: a PNG missing only ``IEND``), a JPEG
    must end with its end-of-image marker. For stages that hand images on encoded to a stage without per-row
    quarantine (the SFT vision actor). Other formats pass."""
    from PIL import Image

    if data[:8] == _PNG_SIGNATURE:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    elif _complete_jpeg(data) is False:
        raise OSError("truncated JPEG file (no end-of-image marker)")


def image_size(data: bytes, *, turned: bool = False) -> tuple[int, int]:
    """(width, height) from the header only (no pixel decode); ``turned``: of the image as HF datasets' ``Image()``
    decode gives it, turned by its EXIF Orientation (``decode_rgb(turned=True)``)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        if turned and exif_orientation(image, data) in _SWAPPING_ORIENTATIONS:
            width, height = height, width
    if width < 1 or height < 1:
        raise ValueError(f"image has zero size ({width}x{height})")
    return width, height


def decode_rgb(data: bytes, *, pixels: bool = True, turned: bool = False) -> tuple[np.ndarray, dict]:
    """Decode and convert to RGB exactly as verl does (``PIL.Image.convert("RGB")``): (H, W, 3) uint8 + PIL info.
    ``pixels=False`` (a count: only whether it decodes matters): the same verdict, but an empty (H, W, 0) array
    instead of the copy of the pixels, and no decode at all where ``png_decodes`` knows the answer. ``turned``: the
    image HF datasets' ``Image()`` decode gives verl (2.19 and later): loaded, then where it has an EXIF Orientation,
    ``ImageOps.exif_transpose``'s (turned, the tag taken out of its info)."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as image:
        if turned and exif_orientation(image, data) is not None:
            image.load()
            return _pil_rgb(ImageOps.exif_transpose(image), pixels)
        inflated = _inflated_png(data) if image.format == "PNG" else None
        if not pixels and inflated is not None and _sound_png_decodes(data, image, *inflated):
            return np.empty((image.height, image.width, 0), dtype=np.uint8), dict(image.info)
        stored = None if inflated is None else _stored(data, *inflated)
        if stored is None:  # not a PNG, or one whose data is not sound: PIL accepts or rejects it, as verl's would
            return _pil_rgb(image, pixels)
        # libspng only on data that inflated soundly: it accepts some corrupt streams that PIL rejects
        if image.mode in ("RGB", "RGBA") and plain_png(data):  # gray and palette PNGs: libspng is no faster
            rgb = _spng_rgb(stored)
            if rgb is not None:  # PIL's header gave the info: nothing after the image data adds to it
                return rgb, dict(image.info)
        with Image.open(io.BytesIO(stored)) as restored:  # the same chunks around the data: same pixels and info
            return _pil_rgb(restored, pixels)


def _pil_rgb(image, pixels: bool = True) -> tuple[np.ndarray, dict]:
    # for an RGB image convert("RGB") is a copy (same pixels, same info): skip it (a fifth of decode's CPU here)
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    if not pixels:
        rgb.load()  # the decode, where a bad image fails; the pixels' copy into an array cannot
        return np.empty((rgb.height, rgb.width, 0), dtype=np.uint8), dict(rgb.info)
    return np.asarray(rgb), dict(rgb.info)  # asarray loads the pixels first, as convert does


def fetched_image(image, patch_size: int):
    """qwen-vl-utils' ``fetch_image`` of a PIL image: its ``to_rgb`` (RGBA composited on white), then its resize to
    ``fetch_image_size``."""
    from PIL import Image

    from ingest.media.geometry import fetch_image_size

    if image.mode == "RGBA":
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
    else:  # an RGB image as it is: its convert would be a copy of the same pixels
        rgb = image if image.mode == "RGB" else image.convert("RGB")
    return rgb.resize(fetch_image_size(*rgb.size, patch_size))


def decode_fetched(data: bytes, patch_size: int, *, pixels: bool = True) -> tuple[np.ndarray, dict]:
    """What verl 0.6 makes of a plain ``{bytes, path}`` struct's image: ``Image.open`` of the bytes, then
    qwen-vl-utils' ``fetch_image`` (``fetched_image``): (H, W, 3) uint8 at the fetched size + PIL info (``pixels``
    as ``decode_rgb``'s)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.load()
        rgb = fetched_image(image, patch_size)
        if not pixels:
            return np.empty((rgb.height, rgb.width, 0), dtype=np.uint8), dict(rgb.info)
        return np.asarray(rgb), dict(rgb.info)


def stored_png(data: bytes) -> bytes | None:
    """``data``, a PNG, with its image data inflated by libdeflate (``deflate``; about twice zlib's speed on the bench's
    images) and stored back uncompressed: one ``IDAT`` chunk holding stored deflate blocks, every other chunk as it was.
    A PNG decoder (libspng, PIL) then copies the data and only unfilters it: the same pixels (PNG is lossless) for less
    CPU than inflating with zlib (docs/design.md). None, and the decoder gets ``data`` itself (and accepts or rejects it
    as it would), where ``deflate`` is missing, the image is interlaced or animated (APNG), has a second header, an
    ``IDAT`` chunk's CRC is wrong, or the data does not inflate (checksum included) to exactly the size the header
    gives."""
    inflated = _inflated_png(data)
    return None if inflated is None else _stored(data, *inflated)


def _stored(data: bytes, raw: bytes, first: int, last: int) -> bytes:
    """``data`` with the chunks from ``first`` to ``last`` replaced by one ``IDAT`` of ``raw`` in stored blocks."""
    import deflate

    size = len(raw)
    body = [b"IDAT\x78\x01"]  # zlib header: deflate, 32K window, no preset dictionary (0x7801 % 31 == 0)
    for start in range(0, size, 0xFFFF):  # stored blocks: final flag, then LEN and NLEN little-endian
        block = memoryview(raw)[start : start + 0xFFFF]
        body += [struct.pack("<BHH", start + 0xFFFF >= size, len(block), len(block) ^ 0xFFFF), block]
    body.append(struct.pack(">I", deflate.adler32(raw)))
    chunk = b"".join(body)
    length, crc = struct.pack(">I", len(chunk) - 4), struct.pack(">I", deflate.crc32(chunk))
    view = memoryview(data)
    return b"".join([view[:first], length, chunk, crc, view[last:]])


def _inflated_png(data: bytes) -> tuple[bytes, int, int] | None:
    """(the image data inflated, offset of the first ``IDAT`` chunk, end of the last) of a PNG whose data is sound
    (``stored_png``'s conditions), else None."""
    try:
        import deflate
    except ImportError:
        return None
    if data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR" or len(data) < 33 or data[28] != 0:
        return None
    width, height, depth, color = struct.unpack_from(">IIBB", data, 16)
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(color)
    if channels is None:
        return None
    size = height * (1 + (width * channels * depth + 7) // 8)  # each row: its filter byte, then the samples
    view, position, pieces, first, last = memoryview(data), 8, [], None, None
    while position + 12 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        end = position + 12 + length
        if kind == b"IDAT":
            if last not in (None, position) or end > len(data):  # other chunks between image data chunks; cut short
                return None
            if deflate.crc32(view[position + 4 : end - 4]) != int.from_bytes(view[end - 4 : end], "big"):
                return None
            pieces.append(view[position + 8 : end - 4])
            first, last = first or position, end
        elif kind in _ANIMATION_CHUNKS or (kind == b"IHDR" and position > 8):  # PIL takes the last IHDR: unread here
            return None
        elif kind == b"IEND" or end > len(data):
            break
        position = end
    if first is None:
        return None
    compressed = sum(len(piece) for piece in pieces)
    if size > _DEFLATE_MAX_RATIO * compressed:  # a header claiming more than the data can hold: allocate nothing
        return None
    try:
        raw = deflate.zlib_decompress(b"".join(pieces), size)
    except deflate.DeflateError:
        return None
    if len(raw) != size:
        return None
    return raw, first, last


def png_decodes(data: bytes, image) -> bool:
    """True where the PNG ``data`` (opened by PIL as ``image``) certainly decodes to RGB, known without unfiltering
    it (a count's question): its data is sound (``stored_png``'s conditions), nothing but ``IEND`` follows it, samples
    of at most 8 bits, no transparency to convert (but in RGB / RGBA), and every row's filter type is one of PNG's
    five, the one thing a decoder still checks in sound data. False: not known, decode it."""
    inflated = _inflated_png(data)
    return inflated is not None and _sound_png_decodes(data, image, *inflated)


def _sound_png_decodes(data: bytes, image, raw: bytes, first: int, last: int) -> bool:
    """``png_decodes`` for a PNG whose data inflated soundly to ``raw`` (``_inflated_png``)."""
    if data[24:25] > b"\x08" or ("transparency" in image.info and image.mode not in ("RGB", "RGBA")):
        return False
    if not raw or data[last + 4 : last + 8] != b"IEND":
        return False
    stride = len(raw) // image.height
    return int(np.frombuffer(raw, dtype=np.uint8)[::stride].max()) <= 4


def plain_png(data: bytes) -> bool:
    """An 8-bit RGB or RGBA PNG with nothing but image data from its first ``IDAT`` to ``IEND``: there libspng's RGB8
    output is PIL's ``convert("RGB")`` (lossless decode; alpha dropped, no gamma applied) and PIL's header parse has
    all of the image's ``info`` (PIL adds text and EXIF chunks found after the image data only while loading it). Not
    an APNG (PIL's first frame follows its frame control chunks, which libspng ignores), nor a file with a second
    ``IHDR`` (PIL takes the last)."""
    if data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR" or len(data) < 33:
        return False
    if data[24] != 8 or data[25] not in (2, 6):  # bit depth 8; color type RGB or RGBA
        return False
    position, seen_data = 8, False
    while position + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        if kind == b"IEND":
            return seen_data
        if kind in _ANIMATION_CHUNKS or (kind == b"IHDR" and position > 8):
            return False
        if kind == b"IDAT":
            seen_data = True
        elif seen_data:
            return False
        position += 12 + length
    return False  # cut short: PIL decides (and names the error)


def _spng_rgb(data: bytes) -> np.ndarray | None:
    """(H, W, 3) uint8 from libspng (pyspng): faster than PIL's PNG decoder and one copy fewer (no 4-byte pixels);
    None where pyspng is missing or refuses the file (an unknown critical chunk, say): PIL then decodes it, so what
    fails is what PIL fails."""
    try:
        import pyspng
    except ImportError:
        return None
    try:
        return pyspng.load(data, format="RGB")
    except Exception:
        return None


def deferrable_jpeg(data: bytes, *, turned: bool = False) -> tuple[np.ndarray, dict] | None:
    """For a JPEG a device decoder can take (baseline, YCbCr or grayscale, complete): an empty (H, W, 0) array (the
    size) and the PIL ``info`` that ``decode_rgb`` would give, from the header alone; None for anything else (PNG,
    progressive or CMYK JPEG, a file without its end marker, one to turn by its EXIF Orientation (``turned``): those
    decode on the CPU, where bad data is caught)."""
    from PIL import Image

    if not _complete_jpeg(data):
        return None
    with Image.open(io.BytesIO(data)) as image:
        if image.format != "JPEG" or image.mode not in ("RGB", "L") or image.info.get("progressive"):
            return None
        if turned and exif_orientation(image, data) is not None:
            return None
        width, height = image.size
        return np.empty((height, width, 0), dtype=np.uint8), dict(image.info)


def decode_jpegs(jpegs: list[bytes], device: str) -> list:
    """JPEG bytes -> (3, H, W) uint8 RGB tensors on ``device``: one batched ``torchvision.io.decode_jpeg`` call
    (nvJPEG on cuda). Where the device decoder refuses an image, PIL decodes it on the CPU (then uploaded); where
    PIL fails too, that image's entry is the exception (the caller makes its row a bad row). On the CPU, PIL's
    (H, W, 3) arrays (``decode_rgb``, the decode stage's decoder: the same pixels, and no torch import)."""
    if device == "cpu":
        return [_pil_jpeg(jpeg) for jpeg in jpegs]
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    data = [torch.frombuffer(bytearray(jpeg), dtype=torch.uint8) for jpeg in jpegs]
    try:
        return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:  # one image the device decoder cannot take fails the batch: decode one by one
        out = []
        for jpeg, tensor in zip(jpegs, data, strict=True):
            try:
                out.append(decode_jpeg(tensor, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                rgb = _pil_jpeg(jpeg)
                if not isinstance(rgb, Exception):
                    rgb = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).to(device)
                out.append(rgb)
        return out


def _pil_jpeg(jpeg: bytes):
    """PIL's (H, W, 3) RGB of a JPEG (the decode stage's decoder), or the exception that stopped it."""
    try:
        return decode_rgb(jpeg)[0]
    except Exception as exc:
        return exc
