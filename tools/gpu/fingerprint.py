"""Fingerprints of a list of batches: every leaf as (path, kind, sha256 / value), pixel tensors kept aside."""

import hashlib

import numpy as np
import torch
from PIL import Image

PIXEL_KEYS = ("pixel_values", "pixel_values_videos")


def leaves(obj, path="batch"):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        yield path, ("tensor", str(t.dtype), tuple(t.shape), hashlib.sha256(t.numpy().tobytes()).hexdigest())
    elif isinstance(obj, Image.Image):
        yield path, ("PIL", obj.mode, obj.size, hashlib.sha256(obj.tobytes()).hexdigest())
    elif isinstance(obj, np.ndarray) and obj.dtype != object:
        digest = hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest()
        yield path, ("ndarray", str(obj.dtype), obj.shape, digest)
    elif isinstance(obj, np.ndarray):
        for idx in np.ndindex(obj.shape):
            yield from leaves(obj[idx], f"{path}{list(idx)}")
    elif isinstance(obj, dict):
        yield path + ".keys", ("keys", tuple(obj))
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}")
    elif isinstance(obj, list | tuple):
        yield path + ".len", ("len", type(obj).__name__, len(obj))
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, ("value", type(obj).__name__, repr(obj))


def fingerprint(batches):
    return dict(leaves(batches))


def levels(pixel_values, pixels) -> np.ndarray:
    """``pixel_values`` back to the uint8 levels they normalize (first frame of each patch): (patches, 3, P*P)."""
    mean, std = pixels.norm
    v = pixel_values.numpy().reshape(pixel_values.shape[0], 3, pixels.spec.temporal_patch_size, -1)[:, :, 0, :]
    x = v * np.asarray(std, np.float32).reshape(1, 3, 1) + np.asarray(mean, np.float32).reshape(1, 3, 1)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)
