"""The Triton kernels of ``ingest.triton_resize`` (a module of their own: importing triton costs, and only a process
that resizes on a GPU with them needs it). Every table they read is int32; see ``triton_resize.PARAM_NAMES`` for
the columns of ``params``."""

import triton
import triton.language as tl


@triton.jit
def tile(params, starts, images, BLOCK: tl.constexpr, PARAMS: tl.constexpr):
    """This program's image (a binary search of the per-image first tiles) and its output values (y, c, x),
    x fastest."""
    t = tl.program_id(0)
    lo = t * 0
    hi = lo + images
    for _ in tl.static_range(17):  # up to 2^17 images a block
        middle = (lo + hi) // 2
        right = tl.load(starts + middle) <= t
        lo = tl.where(right, middle, lo)
        hi = tl.where(right, hi, middle)
    e = (t - tl.load(starts + lo)) * BLOCK + tl.arange(0, BLOCK)
    return lo * PARAMS, e


@triton.jit
def across(src, mid, params, starts, images, axes, weights, BLOCK: tl.constexpr, PARAMS: tl.constexpr):
    row, e = tile(params, starts, images, BLOCK, PARAMS)
    in_h = tl.load(params + row + 4)
    out_w = tl.load(params + row + 7)
    mask = e < in_h * 3 * out_w
    y = e // (3 * out_w)
    c = (e // out_w) % 3
    x = e % out_w
    axis = tl.load(params + row + 10) + x
    first = tl.load(axes + 2 * axis, mask=mask, other=0)
    count = tl.load(axes + 2 * axis + 1, mask=mask, other=0)
    taps = tl.load(params + row + 12)
    precision = tl.load(params + row + 13)
    base = tl.load(params + row) + y * tl.load(params + row + 1) + c * tl.load(params + row + 3)
    stride_x = tl.load(params + row + 2)
    tap_weights = tl.load(params + row + 11) + x * taps
    acc = tl.zeros([BLOCK], dtype=tl.int32) + (1 << (precision - 1))
    for j in range(0, taps):
        take = mask & (j < count)
        value = tl.load(src + base + (first + j) * stride_x, mask=take, other=0).to(tl.int32)
        acc += value * tl.load(weights + tap_weights + j, mask=take, other=0)
    acc = tl.minimum(tl.maximum(acc >> precision, 0), 255)
    tl.store(mid + tl.load(params + row + 8) + e, acc.to(tl.uint8), mask=mask)


@triton.jit
def down(
    mid,
    out,
    params,
    starts,
    images,
    axes,
    weights,
    BLOCK: tl.constexpr,
    PARAMS: tl.constexpr,
    PATCH: tl.constexpr,
    MERGE: tl.constexpr,
):
    row, e = tile(params, starts, images, BLOCK, PARAMS)
    out_h = tl.load(params + row + 6)
    out_w = tl.load(params + row + 7)
    mask = e < out_h * 3 * out_w
    y = e // (3 * out_w)
    c = (e // out_w) % 3
    x = e % out_w
    axis = tl.load(params + row + 14) + y
    first = tl.load(axes + 2 * axis, mask=mask, other=0)
    count = tl.load(axes + 2 * axis + 1, mask=mask, other=0)
    taps = tl.load(params + row + 16)
    precision = tl.load(params + row + 17)
    tap_weights = tl.load(params + row + 15) + y * taps
    source = tl.load(params + row + 8) + c * out_w + x
    acc = tl.zeros([BLOCK], dtype=tl.int32) + (1 << (precision - 1))
    for j in range(0, taps):
        take = mask & (j < count)
        value = tl.load(mid + source + (first + j) * (3 * out_w), mask=take, other=0).to(tl.int32)
        acc += value * tl.load(weights + tap_weights + j, mask=take, other=0)
    acc = tl.minimum(tl.maximum(acc >> precision, 0), 255)
    # (y, x) -> (grid_h/m, grid_w/m, m, m, C, P, P), the processor's patch order (scatter_row of _resize.c)
    by = y // PATCH
    bx = x // PATCH
    index = ((by // MERGE) * (out_w // (PATCH * MERGE)) + bx // MERGE) * (MERGE * MERGE)
    index += (by % MERGE) * MERGE + bx % MERGE
    target = tl.load(params + row + 9) + index * (3 * PATCH * PATCH) + c * (PATCH * PATCH)
    target += (y % PATCH) * PATCH + x % PATCH
    tl.store(out + target, acc.to(tl.uint8), mask=mask)
