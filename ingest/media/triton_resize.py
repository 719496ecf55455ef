"""Qwen2-VL image patches on a GPU in two Triton kernels per block: torch's uint8 antialiased bicubic resize, to
the bit, then the processor's patch order.

The arithmetic is the CPU uint8 kernel's (``ingest/media/_resize.c``, aten's ``UpSampleKernel.cpp``): per axis, Keys
cubic weights over the antialiasing support in double, normalized, scaled to integers with the largest precision that
keeps the biggest weight below 2^15; each output value is clamp((2^(precision-1) + sum(pixel * weight)) >> precision, 0,
255), the width pass first into a uint8 image, then the height pass. The weights are computed here on the host
(``axis_weights``, a port of ``axis_init``), the sums in int32 on the device, where integer sums are exact in any order:
so the patches are the CPU kernel's, where the float two-pass resize of ``ingest.media.pixels.resize_bicubic`` (the
``torch`` device resize) is within 2 levels of them.

Why: that float path launches several kernels per image (a float copy, two resize passes, clamp and round after each,
the uint8 cast, the patch-order copy), each tiny; on a GPU shared by several actors' processes, which the driver
time-slices, those launches and their gaps are what the pool runs out of (``docs/benchmarks.md``). Here a block of any
number of images of any sizes is two launches (the width pass into a (H, 3, W') scratch image per image, the height pass
writing straight into the patch layout), plus the upload of their parameters and weights.

``TRITON_INTERPRET=1`` (set before triton is imported) runs the same kernels on CPU tensors: the tests do.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import numpy as np

# output values per program; the interpreter (TRITON_INTERPRET=1, the tests) runs each program as numpy calls, so
# there fewer, bigger tiles
BLOCK = 65536 if os.environ.get("TRITON_INTERPRET") == "1" else 1024
# per-image parameters, one int32 row each (PARAMS columns), in this order
PARAM_NAMES = (
    "src",  # offset of the image's first value in the source buffer
    "stride_y",  # source strides (values): (H, W, 3) arrays give W * 3, 3, 1; (3, H, W) tensors W, 1, H * W
    "stride_x",
    "stride_c",
    "in_h",
    "in_w",
    "out_h",
    "out_w",
    "mid",  # offset of the image's (in_h, 3, out_w) scratch image
    "out",  # offset of its first patch value
    "across",  # offset of its width axis (first / count per output column) in the axis table
    "across_weights",  # offset of its width weights (taps per output column)
    "across_taps",
    "across_precision",
    "down",
    "down_weights",
    "down_taps",
    "down_precision",
)
PARAMS = len(PARAM_NAMES)


def _cubic(x: np.ndarray) -> np.ndarray:
    """torch's ``aa_filter`` for bicubic (a = -0.5), the C code's expressions in the same order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@lru_cache(maxsize=4096)
def axis_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(first input index, input count, (out_size, taps) int32 weights, precision) of one axis, exactly as
    ``axis_init`` of ``ingest/media/_resize.c`` (torch's ``_compute_index_ranges_int16_weights``). Vectorized over the
    outputs; the sums over taps run in tap order, as there."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    first = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C's (int64_t) cast: toward zero
    last = np.minimum((center + support + 0.5).astype(np.int64), in_size)
    count = np.clip(last - first, 0, taps)
    j = np.arange(taps)
    inside = j[None, :] < count[:, None]
    w = np.where(
        inside, _cubic(((j[None, :] + first[:, None]).astype(np.float64) - center[:, None] + 0.5) * invscale), 0
    )
    total = np.zeros(out_size)
    for k in range(taps):  # in tap order, as the C loop adds them
        total += w[:, k]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    wt_max = max(float(w[total != 0.0].max(initial=0.0)), 0.0)
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * (1 << precision)
    weights = np.where(v < 0, np.trunc(-0.5 + v), np.trunc(0.5 + v)).astype(np.int32)
    return first.astype(np.int32), count.astype(np.int32), weights, precision


@lru_cache(maxsize=1)
def _kernels():
    """The two kernels (``ingest.media._triton_kernels``), imported on first use."""
    from ingest.media._triton_kernels import across, down

    return across, down


def block_patches(
    source,
    layouts: list[tuple[int, int, int, int, int, int]],
    sizes: list[tuple[int, int]],
    out,
    patch: int,
    merge: int,
) -> None:
    """Resize every image of a block and write its patches into ``out`` (uint8, (patches, 3, P, P), on the source's
    device) in two kernel launches. ``source``: one 1-D uint8 tensor holding every image; ``layouts``: per image
    (offset, stride_y, stride_x, stride_c, height, width) in values; ``sizes``: per image the (height, width) to
    resize to, multiples of ``patch * merge``, whose patches follow each other in ``out`` in image order."""
    import torch

    rows, axes, weights = [], [], []
    axes_len = weights_len = mid_len = out_len = 0
    tiles_across, tiles_down = [0], [0]
    for (offset, sy, sx, sc, in_h, in_w), (out_h, out_w) in zip(layouts, sizes, strict=True):
        row = [offset, sy, sx, sc, in_h, in_w, out_h, out_w, mid_len, out_len]
        for in_size, out_size in ((in_w, out_w), (in_h, out_h)):
            first, count, w, precision = axis_weights(in_size, out_size)
            row += [axes_len, weights_len, w.shape[1], precision]
            axes.append(np.stack([first, count], axis=1).reshape(-1))
            weights.append(w.reshape(-1))
            axes_len += out_size
            weights_len += w.size
        rows.append(row)
        tiles_across.append(tiles_across[-1] + _tiles(in_h * 3 * out_w))
        tiles_down.append(tiles_down[-1] + _tiles(out_h * 3 * out_w))
        mid_len += in_h * 3 * out_w
        out_len += out_h * out_w * 3
    if not rows:
        return
    if out_len != out.numel():
        raise ValueError(f"the patch buffer holds {out.numel()} values, the images' patches {out_len}")
    if max(mid_len, out_len, source.numel()) >= 2**31:
        raise ValueError("a block over 2^31 values: the kernels index in int32")
    # every table in one upload: parameters, both passes' first tiles, axes, weights
    parts = [np.asarray(rows, dtype=np.int32).reshape(-1), tiles_across, tiles_down, *axes, *weights]
    sizes_of = [len(p) for p in parts[:3]] + [2 * axes_len, weights_len]
    tables = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])).to(source.device)
    table, starts_across, starts_down, axes_dev, weights_dev = torch.split(tables, sizes_of)
    mid = torch.empty(mid_len, dtype=torch.uint8, device=source.device)
    across, down = _kernels()
    images = len(rows)
    across[(tiles_across[-1],)](
        source, mid, table, starts_across, images, axes_dev, weights_dev, BLOCK=BLOCK, PARAMS=PARAMS
    )
    down[(tiles_down[-1],)](
        mid,
        out.view(-1),
        table,
        starts_down,
        images,
        axes_dev,
        weights_dev,
        BLOCK=BLOCK,
        PARAMS=PARAMS,
        PATCH=patch,
        MERGE=merge,
    )


def _tiles(values: int) -> int:
    return -(-values // BLOCK)


def triton_available() -> str | None:
    """None where triton imports here, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
