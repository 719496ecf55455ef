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

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ingest.vision import VisionSpec, image_grid, image_processor_config

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the value processor configs store


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

    def __call__(
        self, images: list[np.ndarray], device: str = "cpu", native_uint8: bool | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(H, W, 3) uint8 RGB arrays -> (``pixel_values`` float32 (patches, C*T*P*P), ``image_grid_thw`` int64).
        ``native_uint8``: the resize kernel (default: the uint8 one on CPU, float on other devices)."""
        import torch

        spec = self.spec
        p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
        grids = np.array([image_grid(im.shape[1], im.shape[0], spec) for im in images], dtype=np.int64).reshape(-1, 3)
        counts = grids.prod(axis=1)
        out = torch.empty((int(counts.sum()), 3 * t * p * p), dtype=torch.float32, device=device)
        # transformers fuses rescale into normalize the same way (mean / rescale_factor, std / rescale_factor), then
        # normalizes the float image: (x - mean) / std
        mean = torch.tensor(self.image_mean, device=device) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std, device=device) * (1.0 / self.rescale_factor)
        # Patchify the uint8 image first (a quarter of the bytes to gather), converting to float on the copy into the
        # output; then normalize there in place: the same float ops on the same values as normalize-then-patchify.
        mean = mean.view(1, 1, 1, 1, 3, 1, 1, 1)
        std = std.view(1, 1, 1, 1, 3, 1, 1, 1)
        start = 0
        for image, (_, gh, gw), count in zip(images, grids.tolist(), counts.tolist(), strict=True):
            with warnings.catch_warnings():  # a read-only view of the block: only read (resize makes a new tensor)
                warnings.simplefilter("ignore", UserWarning)
                pixels = torch.from_numpy(np.ascontiguousarray(image)).to(device).permute(2, 0, 1)
            resized = resize_bicubic(pixels[None], gh * p, gw * p, native_uint8)
            patches = resized.view(1, 3, gh // m, m, p, gw // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
            # (gh/m, gw/m, m, m, C, 1, P, P): every temporal slot gets the same frame, as the processor's repeat does
            target = out[start : start + count].view(gh // m, gw // m, m, m, 3, t, p, p)
            target.copy_(patches.expand(-1, -1, -1, -1, -1, t, -1, -1))
            target.sub_(mean).div_(std)
            start += count
        return out.cpu().numpy(), grids


def resize_bicubic(images, height: int, width: int, native_uint8: bool | None = None):
    """torchvision's ``resize(images, [height, width], BICUBIC, antialias=True)`` for (N, 3, H, W) uint8, with torch
    alone (importing torchvision costs an actor seconds). ``native_uint8`` (default: on CPU) runs torch's uint8
    kernel, as torchvision does on CPU. Otherwise (other devices, where there is no uint8 kernel) two float passes,
    horizontal then vertical, each clamped and rounded to uint8 values as the uint8 kernel stores its intermediate
    image: within 2 levels of it (one float pass, torchvision's GPU path, is up to ~20 levels off at sharp edges)."""
    import torch
    from torch.nn.functional import interpolate

    if tuple(images.shape[-2:]) == (height, width):
        return images
    if native_uint8 if native_uint8 is not None else images.device.type == "cpu":
        return interpolate(images, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    resized = images.float()
    for size in ([resized.shape[-2], width], [height, width]):
        if list(resized.shape[-2:]) != size:
            resized = interpolate(resized, size=size, mode="bicubic", align_corners=False, antialias=True)
            resized = resized.clamp_(min=0, max=255).round_()
    return resized.to(torch.uint8)
