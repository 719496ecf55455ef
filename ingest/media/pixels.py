"""Qwen2-VL image preprocessing with torch ops: resize, rescale + normalize, patchify, on any device.

The same operations, in the same order and with the same torch kernels, as transformers' torchvision-backed
``Qwen2VLImageProcessorFast`` (what verl 0.5.0 gets from ``AutoProcessor`` under transformers 4.57): bicubic
antialiased ``resize`` of the uint8 image to the ``smart_resize`` size, ``normalize`` of the float image with
mean and std scaled by 1 / rescale_factor, the image repeated to ``temporal_patch_size`` frames, then the
(grid_t, grid_h, grid_w, merge, merge, C, T, P, P) patch order. Without transformers' input handling around it
(validation, grouping, BatchFeature) and its import (seconds per actor), and writing every image's patches
straight into one output tensor. Processor configs with other options go through transformers (``supports``).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from ingest.media.geometry import VisionSpec, image_grid, image_processor_config
from ingest.memory import ReusedBuffers, pinned_or_pageable

try:  # the C resize (ingest/media/_resize.c), built by ``pip install``; without it the CPU path runs torch's kernel
    from ingest.media import _resize
except ImportError:  # pragma: no cover - a build without a C compiler
    _resize = None

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the value processor configs store
PATCHES = ReusedBuffers()  # a block's uint8 patches on the CPU (``ImagePixels.patches``)
DEVICE_PATCHES = ReusedBuffers(allocate=pinned_or_pageable)  # a device's patches copied back (``host_array``)
UPLOAD_STAGING = ReusedBuffers(allocate=pinned_or_pageable)  # a block's pixels on their way to CUDA (``upload``)
# float32 ``pixel_values`` built on the CPU (``normalize_patches``), one buffer per image row: eight times the bytes
# of the block's uint8 patches. From malloc they land on fresh pages every batch (the collate runs in a new thread
# each iteration, whose glibc arena gives its heaps back once a batch is freed), and zeroing those dominated the
# consumer's CPU (docs/design.md). At most 192 buffers are kept (about three 64-row batches: what a consumer holds at
# its peak), each handed out again only once nothing holds it.
PIXEL_VALUES = ReusedBuffers(keep=192, slack=1.0)


def cpu_resize(processor_dir: str | Path) -> str:
    """How this install's CPU vision actors resize images for the processor at ``processor_dir``: the C resize, or
    torch's kernel where it was not built (the same pixels; each actor then imports torch), or the processor's own
    code for options not implemented here. pip shows no build output, so the run summary says which."""
    if not ImagePixels.supports(image_processor_config(processor_dir)):
        return "the processor's own (transformers): its options are not the Qwen2-VL ones implemented here"
    if _resize is not None:
        return "the C resize (ingest.media._resize)"
    return "torch's kernel: the C resize was not built at install (no C compiler or Python headers)"


@dataclass(frozen=True)
class ImagePixels:
    """The pixel side of a Qwen2-VL image processor, read from ``preprocessor_config.json``."""

    spec: VisionSpec
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float

    @classmethod
    def from_dir(cls, path: str | Path) -> ImagePixels | None:
        """The processor at ``path`` when its options are the ones implemented here, else None."""
        config = image_processor_config(path)
        if not cls.supports(config):
            return None
        return cls(
            spec=VisionSpec.from_dir(path),
            image_mean=tuple(float(v) for v in config["image_mean"]),
            image_std=tuple(float(v) for v in config["image_std"]),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
        )

    @staticmethod
    def supports(config: dict) -> bool:
        kind = str(config.get("image_processor_type", ""))
        return (
            kind.startswith("Qwen2VLImageProcessor")
            and config.get("do_resize", True)
            and config.get("do_rescale", True)
            and config.get("do_normalize", True)
            and config.get("do_convert_rgb", True)
            and int(config.get("resample", _BICUBIC)) == _BICUBIC
            and len(config.get("image_mean") or ()) == 3
            and len(config.get("image_std") or ()) == 3
        )

    def device_tolerance(self) -> float:
        """Largest ``pixel_values`` difference between the device resize (float passes) and the CPU one (uint8 kernel):
        two uint8 levels, 2 * rescale_factor / std for the smallest std (0.030 for Qwen2-VL)."""
        return 2 * self.rescale_factor / min(self.image_std) + 1e-6

    @cached_property
    def norm(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(mean, std) as the float32 values the normalize divides by: transformers fuses rescale into normalize
        (mean / rescale_factor, std / rescale_factor) and normalizes the float image, (x - mean) / std. Its
        ``torch.tensor(mean) * scale`` is a float32 product (torch casts the Python scalar to the tensor's type), as
        here."""
        scale = np.float32(1.0 / self.rescale_factor)
        mean = np.asarray(self.image_mean, dtype=np.float32) * scale
        std = np.asarray(self.image_std, dtype=np.float32) * scale
        return tuple(mean.tolist()), tuple(std.tolist())

    def __call__(
        self, images: list[np.ndarray], device: str = "cpu", native_uint8: bool | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(H, W, 3) uint8 RGB arrays -> (``pixel_values`` float32 (patches, C*T*P*P), ``image_grid_thw`` int64).
        ``native_uint8``: the resize kernel (default: the uint8 one on CPU, float on other devices)."""
        patches, grids = self.patches(images, device, native_uint8)
        mean, std = self.norm
        values = normalize_patches(patches, mean, std, self.spec.temporal_patch_size)
        return values.cpu().numpy(), grids

    def patches(
        self, images: list[np.ndarray], device: str = "cpu", native_uint8: bool | None = None, kernel: str = "torch"
    ):
        """(H, W, 3) uint8 RGB arrays (or (3, H, W) uint8 tensors) -> (uint8 patches (patches, C, P, P) on ``device``
        in the processor's patch order, ``image_grid_thw`` int64). ``normalize_patches`` turns them into
        ``pixel_values``: blocks carry these, an eighth of the float32 bytes (one frame instead of
        ``temporal_patch_size``, one byte per value). On the CPU, for numpy images with the uint8 kernel, the
        patches are a numpy array from ``ingest.media._resize`` (the same bytes, without importing torch) where it was
        built; a torch tensor otherwise. ``kernel="triton"``: the whole block in two Triton kernels
        (``ingest.media.triton_resize``: the uint8 kernel's bytes, exactly), for CUDA devices (on the CPU only under
        ``TRITON_INTERPRET=1``)."""
        spec = self.spec
        shapes = [im.shape[:2] if isinstance(im, np.ndarray) else im.shape[1:] for im in images]  # (H, W)
        grids = np.array([image_grid(w, h, spec) for h, w in shapes], dtype=np.int64).reshape(-1, 3)
        patches = image_patches(images, grids, spec.patch_size, spec.merge_size, device, native_uint8, kernel)
        return patches, grids


def image_patches(
    images: list,
    grids: np.ndarray,
    patch_size: int,
    merge_size: int,
    device: str = "cpu",
    native_uint8: bool | None = None,
    kernel: str = "torch",
):
    """``ImagePixels.patches`` for given ``image_grid_thw``: each image resized to its grid's size (where it is not
    that size already) and cut into patches in the processor's order."""
    p, m = patch_size, merge_size
    counts = grids.prod(axis=1)
    shape = (int(counts.sum()), 3, p, p)
    if kernel == "triton":
        return _triton_patches(images, device, grids, shape, p, m)
    if _resize is not None and device == "cpu" and native_uint8 is not False:
        if all(isinstance(im, np.ndarray) for im in images):
            return _compiled_patches(images, grids, shape, p, m)
    import torch

    if torch.device(device).type == "cpu":  # the block's patches: the last block's buffer once Ray has stored it
        out = torch.from_numpy(PATCHES.take(int(np.prod(shape)))).view(shape)
    else:  # host_array copies them back into such a buffer
        out = torch.empty(shape, dtype=torch.uint8, device=device)
    start = 0
    for pixels, (_, gh, gw), count in zip(device_images(images, device), grids.tolist(), counts.tolist(), strict=True):
        resized = resize_bicubic(pixels[None], gh * p, gw * p, native_uint8)
        # (C, gh/m, m, P, gw/m, m, P) -> (gh/m, gw/m, m, m, C, P, P), the processor's patch order
        source = resized.view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        out[start : start + count].view(gh // m, gw // m, m, m, 3, p, p).copy_(source)
        start += count
    return out


def _triton_patches(images: list, device: str, grids: np.ndarray, shape: tuple, p: int, m: int):
    """``ImagePixels.patches`` through ``ingest.media.triton_resize.block_patches``. Arrays go up in one copy, read in
    place as (H, W, 3): the span of one buffer where they are views of it (a block's), else packed on the host first.
    Tensors already on the device (nvJPEG's) are packed there as (3, H, W) with the arrays."""
    import torch

    from ingest.media.triton_resize import block_patches

    out = torch.empty(shape, dtype=torch.uint8, device=device)
    if not images:
        return out
    sizes = [(int(gh) * p, int(gw) * p) for _, gh, gw in grids.tolist()]
    with warnings.catch_warnings():  # read-only views of the block: only read
        warnings.simplefilter("ignore", UserWarning)
        if all(isinstance(im, np.ndarray) for im in images):
            span = _shared_span(images)
            if span is None:
                flat = [np.ascontiguousarray(im).reshape(-1) for im in images]
                span = np.concatenate(flat), np.cumsum([0] + [f.size for f in flat[:-1]]).tolist()
            buffer, offsets = span
            source = upload(buffer, device)
            layouts = [(o, im.shape[1] * 3, 3, 1, *im.shape[:2]) for o, im in zip(offsets, images, strict=True)]
        else:
            tensors = [image.contiguous() for image in device_images(images, device)]
            source = torch.cat([t.reshape(-1) for t in tensors])
            starts = np.cumsum([0] + [t.numel() for t in tensors[:-1]]).tolist()
            layouts = [
                (o, t.shape[2], 1, t.shape[1] * t.shape[2], *t.shape[1:]) for o, t in zip(starts, tensors, strict=True)
            ]
    block_patches(source, layouts, sizes, out, p, m)
    return out


def _compiled_patches(images: list[np.ndarray], grids: np.ndarray, shape: tuple, p: int, m: int) -> np.ndarray:
    """``ImagePixels.patches`` on the CPU through ``ingest.media._resize``: torch's uint8 resize kernel to the bit, each
    image's patches written straight into the block's ``PATCHES`` buffer, and no torch import."""
    out = PATCHES.take(int(np.prod(shape)))
    start = 0
    for image, (_, gh, gw) in zip(images, grids.tolist(), strict=True):
        h, w = image.shape[:2]
        end = start + gh * gw * 3 * p * p
        _resize.resize_patches(np.ascontiguousarray(image), h, w, out[start:end], gh * p, gw * p, p, m)
        start = end
    return out.reshape(shape)


def host_array(patches) -> np.ndarray:
    """uint8 patches as a numpy array in host memory: CPU tensors as they are (``patches`` wrote them into a
    ``PATCHES`` buffer, as it does its numpy arrays); a device's copied into a ``DEVICE_PATCHES`` buffer: pinned where
    CUDA is (one DMA, no staging copy), and the last block's once Ray has stored it (pinning is slow; fresh pages are
    dear)."""
    if isinstance(patches, np.ndarray):
        return patches
    import torch

    if patches.device.type == "cpu":
        return patches.numpy()
    host = torch.from_numpy(DEVICE_PATCHES.take(patches.numel())).view(patches.shape)
    return host.copy_(patches).numpy()


def device_images(images: list, device: str, one_copy: bool | None = None) -> list:
    """(H, W, 3) uint8 arrays (or (3, H, W) uint8 tensors) -> (3, H, W) uint8 tensors on ``device``. Arrays that are
    views of one buffer (``rgb_arrays`` of a block: every image's pixels in the block's one binary buffer) go to an
    accelerator in one copy of the span they cover, each image then a view of it: one transfer per batch instead of
    one synchronous transfer per image. ``one_copy``: whether to look for that span (default: off the CPU)."""
    import torch

    arrays = [k for k, image in enumerate(images) if isinstance(image, np.ndarray)]
    out = list(images)
    if one_copy is None:
        one_copy = torch.device(device).type != "cpu"
    span = _shared_span([images[k] for k in arrays]) if one_copy and arrays else None
    with warnings.catch_warnings():  # read-only views of the block: only read (the resize makes new tensors)
        warnings.simplefilter("ignore", UserWarning)
        if span is not None:
            buffer, offsets = span
            uploaded = upload(buffer, device)
            for k, offset in zip(arrays, offsets, strict=True):
                h, w, _ = images[k].shape
                out[k] = uploaded[offset : offset + h * w * 3].view(h, w, 3).permute(2, 0, 1)
        else:
            for k in arrays:
                out[k] = torch.from_numpy(np.ascontiguousarray(images[k])).to(device).permute(2, 0, 1)
    return [image.to(device) for image in out]


def upload(buffer: np.ndarray, device: str):
    """A 1-D uint8 host array as a tensor on ``device``, in one copy. To CUDA through a reused pinned staging buffer:
    a CPU copy, then one DMA at the link's speed. From pageable memory the driver stages the transfer itself, CPU copy
    and DMA in turn, and the GPU's copy engine is busy all along (half the GPU time in the profiles of
    docs/design.md). Where several actors share a GPU, that GPU time is what runs out. (One actor alone gains nothing:
    the CPU copy is then on its critical path.)"""
    import torch

    if torch.device(device).type != "cuda":
        return torch.from_numpy(buffer).to(device)
    staged = UPLOAD_STAGING.take(buffer.size)
    np.copyto(staged, buffer)
    return torch.from_numpy(staged).to(device)  # synchronous: the staging buffer is free again once this returns


def _shared_span(arrays: list[np.ndarray]) -> tuple[np.ndarray, list[int]] | None:
    """(the one 1-D uint8 buffer all of ``arrays`` are C-contiguous views of, cut to the bytes they cover, each
    array's byte offset in it), or None where they are not such views or cover less than half of the span."""
    roots = {id(_root(a)) for a in arrays}
    if len(roots) != 1 or not all(a.dtype == np.uint8 and a.flags.c_contiguous for a in arrays):
        return None
    root = _root(arrays[0])
    if root.ndim != 1 or root.dtype != np.uint8:
        return None
    base = root.__array_interface__["data"][0]
    starts = [a.__array_interface__["data"][0] - base for a in arrays]
    lo, hi = min(starts), max(s + a.nbytes for s, a in zip(starts, arrays, strict=True))
    if 2 * sum(a.nbytes for a in arrays) < hi - lo:  # sparse views: copying the span would move mostly other bytes
        return None
    return root[lo:hi], [s - lo for s in starts]


def _root(array: np.ndarray) -> np.ndarray:
    """The array that owns (or first wraps) the memory ``array`` views."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def normalize_patches(patches, mean: tuple[float, ...], std: tuple[float, ...], temporal_patch_size: int):
    """uint8 patches (n, C, P, P) (torch or numpy) -> ``pixel_values`` (n, C*T*P*P) float32 on the patches' device:
    each patch repeated to ``temporal_patch_size`` frames (the processor's image repeat), then (x - mean) / std per
    channel. The same float ops on the same values as the processor's normalize-then-patchify, so bit-equal."""
    import torch

    if isinstance(patches, np.ndarray):
        with warnings.catch_warnings():  # read-only block views are only read
            warnings.simplefilter("ignore", UserWarning)
            patches = torch.from_numpy(patches)
    n, channels, p, _ = patches.shape
    t = temporal_patch_size
    shape = (n, channels, t, p * p)
    if patches.device.type == "cpu":
        # numpy's ufuncs on a ``PIXEL_VALUES`` buffer: the same IEEE float32 ops, on one thread. torch's CPU kernels
        # would fan out to its OpenMP pool, whose threads then spin-wait on the cores the pipeline's actors need (a
        # third more CPU for the collate on 2 cores).
        out = torch.from_numpy(PIXEL_VALUES.take(4 * int(np.prod(shape)))).view(torch.float32).view(shape)
        normalize_patches_into(patches.numpy(), out.numpy(), mean, std, t)
    else:
        out = torch.empty(shape, dtype=torch.float32, device=patches.device)
        out.copy_(patches.reshape(n, channels, 1, p * p).expand(n, channels, t, p * p))
        out.sub_(torch.tensor(mean, device=out.device).view(1, channels, 1, 1))
        out.div_(torch.tensor(std, device=out.device).view(1, channels, 1, 1))
    return out.view(n, channels * t * p * p)


def normalize_patches_into(
    patches: np.ndarray, out: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...], temporal_patch_size: int
) -> np.ndarray:
    """``normalize_patches`` on the CPU without torch: uint8 patches (n, C, P, P) -> ``out``, float32 (n, C, T, P*P).
    A few hundred patches at a time through a cache-sized scratch, each normalized once and then copied into every
    frame: one pass over the output instead of three (in C through a per-channel table of the same float ops'
    results where ``ingest.media._resize`` was built)."""
    n, channels, p, _ = patches.shape
    t = temporal_patch_size
    source = patches.reshape(n, channels, p * p)
    if _resize is not None:
        lut = _normalize_table(tuple(mean), tuple(std))
        _resize.normalize_patches(np.ascontiguousarray(source), out, lut, n, channels, t, p * p)
        return out
    mean_, std_ = (np.asarray(x, dtype=np.float32).reshape(1, channels, 1) for x in (mean, std))
    step = max(1, _NORMALIZE_CHUNK // (channels * p * p))
    for start in range(0, n, step):
        end = min(n, start + step)
        scratch = _float_scratch((end - start) * channels * p * p).reshape(end - start, channels, p * p)
        np.copyto(scratch, source[start:end], casting="unsafe")
        np.subtract(scratch, mean_, out=scratch)
        np.divide(scratch, std_, out=scratch)
        np.copyto(out[start:end], scratch[:, :, None, :])
    return out


@lru_cache(maxsize=16)
def _normalize_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(channels, 256) float32: (value - mean) / std for every uint8 value, by the numpy path's own float32 ops, so a
    lookup gives each value's result to the bit."""
    values = np.broadcast_to(np.arange(256, dtype=np.float32), (len(mean), 256)).copy()
    np.subtract(values, np.asarray(mean, dtype=np.float32).reshape(-1, 1), out=values)
    np.divide(values, np.asarray(std, dtype=np.float32).reshape(-1, 1), out=values)
    return values


_NORMALIZE_CHUNK = 1 << 17  # float32 values per ``normalize_patches`` step: 512 KB, within a core's L2 cache
_SCRATCH = threading.local()  # the collate may run in several threads at once


def _float_scratch(size: int) -> np.ndarray:
    """This thread's float32 scratch of at least ``size`` values."""
    scratch = getattr(_SCRATCH, "values", None)
    if scratch is None or scratch.size < size:
        scratch = _SCRATCH.values = np.empty(max(size, _NORMALIZE_CHUNK), dtype=np.float32)
    return scratch[:size]


def resize_bicubic(images, height: int, width: int, native_uint8: bool | None = None):
    """torchvision's ``resize(images, [height, width], BICUBIC, antialias=True)`` for (N, 3, H, W) uint8, with torch
    alone (importing torchvision costs an actor seconds). ``native_uint8`` (default: on CPU) runs torch's uint8
    kernel, as torchvision does on CPU. Otherwise (other devices, where there is no uint8 kernel) two float passes,
    horizontal then vertical, each clamped and rounded to uint8 values as the uint8 kernel stores its intermediate
    image: within 2 levels of it (one float pass, torchvision's GPU path, is further off at sharp edges)."""
    import torch

    # the kernel F.interpolate(mode="bicubic", antialias=True, align_corners=False, size=...) calls, without its
    # Python argument checks (on a GPU, where the host only launches kernels, their time counts)
    interpolate = torch.ops.aten._upsample_bicubic2d_aa
    if tuple(images.shape[-2:]) == (height, width):
        return images
    if native_uint8 if native_uint8 is not None else images.device.type == "cpu":
        return interpolate(images, [height, width], False)
    resized = images.float()
    for size in ([resized.shape[-2], width], [height, width]):
        if list(resized.shape[-2:]) != size:
            resized = interpolate(resized, size, False).clamp_(min=0, max=255).round_()
    return resized.to(torch.uint8)


class ProcessorPixels:
    """Images -> the image processor's float32 ``pixel_values`` and int64 ``image_grid_thw``: with our kernels
    (``ImagePixels``) where they serve the processor at ``path``, else with transformers' image processor (the one
    given, or loaded from ``path`` on first use). The one pixel path of the RL vision stage's fallback and of SFT."""

    def __init__(self, path: str | None = None, device: str = "cpu", image_processor=None):
        self.path, self.device = path, device
        self.pixels = ImagePixels.from_dir(path) if path is not None and image_processor is None else None
        self._image_processor = image_processor

    @property
    def image_processor(self):
        """transformers' image processor (loaded on first use where our kernels serve the images)."""
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(self.path)
        return self._image_processor

    def __call__(self, images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(H, W, 3) uint8 RGB arrays -> (``pixel_values`` (patches, dim) float32, ``image_grid_thw`` (n, 3) int64)."""
        if self.pixels is not None:
            return self.pixels(images, self.device)
        import torch

        tensors = [torch.from_numpy(np.array(rgb)).permute(2, 0, 1) for rgb in images]  # writable copies
        out = self.image_processor(images=tensors, return_tensors="pt", device=self.device)
        return out["pixel_values"].float().cpu().numpy(), out["image_grid_thw"].cpu().numpy().astype(np.int64)
