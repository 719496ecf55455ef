"""The Triton kernels of ``ingest.media.triton_resize`` (a module of their own: importing triton costs, and only a
process that resizes on a GPU with them needs it). Every table they read is int32; ``triton_resize.PARAM_NAMES`` names
the columns of ``table``: 0-3 the source offset and strides, 4-7 the sizes in and out, 8-9 the scratch and patch
offsets, 10-13 the width axis, 14-17 the height axis (each: axis offset, weights offset, taps, precision)."""

import triton
import triton.language as tl


@triton.jit
def tile(starts, images, table, height_column, BLOCK: tl.constexpr, PARAMS: tl.constexpr):
    """This program's values of a pass's output, (y, c, x) with x fastest: its image's row of ``table`` (a binary
    search of the per-image first tiles), the values' flat index, mask, y, c, x, and the output width."""
    t = tl.program_id(0)
    lo = t * 0
    hi = lo + images
    for _ in tl.static_range(17):  # up to 2^17 images a block
        middle = (lo + hi) // 2
        right = tl.load(starts + middle) <= t
        lo = tl.where(right, middle, lo)
        hi = tl.where(right, hi, middle)
    e = (t - tl.load(starts + lo)) * BLOCK + tl.arange(0, BLOCK)
    row = lo * PARAMS
    out_w = tl.load(table + row + 7)
    mask = e < tl.load(table + row + height_column) * 3 * out_w
    return row, e, mask, e // (3 * out_w), (e // out_w) % 3, e % out_w, out_w


@triton.jit
def resample(values, start, step, row, axis_column, at, mask, table, axes, weights, BLOCK: tl.constexpr):
    """One pass's output values: clamp((2^(precision-1) + sum over the taps of value * weight) >> precision, 0, 255)
    as uint8, where the taps of output index ``at`` read ``values[start + (first + j) * step]`` (the axis' columns of
    ``table`` from ``axis_column``)."""
    axis = tl.load(table + row + axis_column) + at
    first = tl.load(axes + 2 * axis, mask=mask, other=0)
    count = tl.load(axes + 2 * axis + 1, mask=mask, other=0)
    taps = tl.load(table + row + axis_column + 2)
    precision = tl.load(table + row + axis_column + 3)
    tap_weights = tl.load(table + row + axis_column + 1) + at * taps
    acc = tl.zeros([BLOCK], dtype=tl.int32) + (1 << (precision - 1))
    for j in range(0, taps):
        take = mask & (j < count)
        value = tl.load(values + start + (first + j) * step, mask=take, other=0).to(tl.int32)
        acc += value * tl.load(weights + tap_weights + j, mask=take, other=0)
    return tl.minimum(tl.maximum(acc >> precision, 0), 255).to(tl.uint8)


@triton.jit
def across(src, mid, table, starts, images, axes, weights, BLOCK: tl.constexpr, PARAMS: tl.constexpr):
    """The width pass: each image's (in_h, 3, out_w) scratch image."""
    row, e, mask, y, c, x, out_w = tile(starts, images, table, 4, BLOCK, PARAMS)
    start = tl.load(table + row) + y * tl.load(table + row + 1) + c * tl.load(table + row + 3)
    value = resample(src, start, tl.load(table + row + 2), row, 10, x, mask, table, axes, weights, BLOCK)
    tl.store(mid + tl.load(table + row + 8) + e, value, mask=mask)


@triton.jit
def down(
    mid,
    out,
    table,
    starts,
    images,
    axes,
    weights,
    BLOCK: tl.constexpr,
    PARAMS: tl.constexpr,
    PATCH: tl.constexpr,
    MERGE: tl.constexpr,
):
    """The height pass over the scratch images, each value written into the processor's patch order,
    (grid_h/m, grid_w/m, m, m, C, P, P) (``scatter_row`` of ``_resize.c``)."""
    row, e, mask, y, c, x, out_w = tile(starts, images, table, 6, BLOCK, PARAMS)
    start = tl.load(table + row + 8) + c * out_w + x
    value = resample(mid, start, 3 * out_w, row, 14, y, mask, table, axes, weights, BLOCK)
    by = y // PATCH
    bx = x // PATCH
    index = ((by // MERGE) * (out_w // (PATCH * MERGE)) + bx // MERGE) * (MERGE * MERGE)
    index += (by % MERGE) * MERGE + bx % MERGE
    target = tl.load(table + row + 9) + index * (3 * PATCH * PATCH) + c * (PATCH * PATCH)
    tl.store(out + target + (y % PATCH) * PATCH + x % PATCH, value, mask=mask)
