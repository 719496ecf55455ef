"""Pixel ops (``ingest/media/pixels.py``): ``ImagePixels`` against transformers' processor, the compiled resize and
normalize against torch / numpy, the device path's float resize on the CPU, one upload per block, reused host
buffers for device patches and for the consumer's ``pixel_values``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from ingest.config import DataConfig
from tests.support.media import sample_rgbs


def test_pixel_ops_equal_transformers_image_processor(model_dir):
    """``ImagePixels`` (torch ops, no transformers) gives transformers' Qwen2-VL processor output bit for bit."""
    from transformers import AutoImageProcessor

    from ingest.media.pixels import ImagePixels

    pixels = ImagePixels.from_dir(model_dir)
    assert pixels is not None
    rgbs = sample_rgbs()
    ours, grids = pixels(rgbs)
    theirs = AutoImageProcessor.from_pretrained(model_dir)(
        images=[torch.from_numpy(rgb.copy()).permute(2, 0, 1) for rgb in rgbs], return_tensors="pt"
    )
    assert np.array_equal(grids, theirs["image_grid_thw"].numpy())
    assert np.array_equal(ours, theirs["pixel_values"].numpy())


def test_compiled_resize_equals_torchs_uint8_kernel(model_dir):
    """``ingest.media._resize`` (the CPU path's resize without torch) gives torch's uint8 antialiased bicubic
    kernel and the
    processor's patch order to the bit: noise, flat colours and sharp edges, shrunk and enlarged, one side only or
    neither, one-pixel and thin images."""
    from ingest.media import pixels as pixel_ops

    assert pixel_ops._resize is not None, "ingest.media._resize was not built: pip install needs a C compiler"
    pixels = pixel_ops.ImagePixels.from_dir(model_dir)
    rng = np.random.default_rng(5)
    shapes = [(1, 1), (28, 28), (56, 84), (3, 500), (500, 3), (2000, 900), (1100, 1400), (28, 901), (4000, 30)]
    shapes += [(int(rng.integers(7, 1300)), int(rng.integers(7, 1300))) for _ in range(40)]
    for k, (h, w) in enumerate(shapes):
        if k % 3 == 0:
            image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        elif k % 3 == 1:
            image = np.broadcast_to(rng.integers(0, 256, 3, dtype=np.uint8), (h, w, 3)).copy()
        else:
            y, x = np.mgrid[0:h, 0:w]
            image = np.stack([x * 7 % 256, y * 3 % 256, (x // 9 + y // 9) % 2 * 255], -1).astype(np.uint8)
        ours, grids = pixels.patches([image])
        assert isinstance(ours, np.ndarray)
        theirs, their_grids = pixels.patches([torch.from_numpy(image).permute(2, 0, 1)])  # a tensor: torch's kernel
        assert np.array_equal(grids, their_grids)
        assert np.array_equal(ours, theirs.numpy()), (h, w)


def test_compiled_normalize_equals_the_numpy_path(model_dir, monkeypatch):
    """The consumer's uint8 patches -> float32 ``pixel_values`` in C (a per-channel table of the numpy path's float32
    ops) is bit-equal to the numpy path: every byte value, one and two frames, no patches at all."""
    from ingest.media import pixels as pixel_ops

    assert pixel_ops._resize is not None, "ingest.media._resize was not built: pip install needs a C compiler"
    mean, std = pixel_ops.ImagePixels.from_dir(model_dir).norm
    every_value = np.arange(4 * 3 * 16 * 16).reshape(4, 3, 16, 16) % 256  # each channel's plane: 0..255
    noise = np.random.default_rng(3).integers(0, 256, (301, 3, 14, 14))
    for values in (every_value, noise, np.zeros((0, 3, 14, 14))):
        values = values.astype(np.uint8)
        for frames in (1, 2):
            compiled = pixel_ops.normalize_patches(values, mean, std, frames).clone()
            with monkeypatch.context() as patch:
                patch.setattr(pixel_ops, "_resize", None)
                plain = pixel_ops.normalize_patches(values, mean, std, frames)
            assert compiled.shape == plain.shape == (len(values), frames * 3 * values.shape[-1] ** 2)
            assert torch.equal(compiled.view(torch.int32), plain.view(torch.int32)), (values.shape, frames)


def test_cpu_path_without_the_compiled_resize_gives_the_same_patches(model_dir, monkeypatch):
    """Where ``ingest.media._resize`` was not built (no C compiler at install), the CPU path runs torch's kernel:
    the same
    patches, and the vision stage's records are byte-equal."""
    from ingest.media import pixels as pixel_ops
    from ingest.stages.vision import VisionStage

    rgbs = sample_rgbs()
    stage = VisionStage(model_dir, DataConfig(vision_device="cpu"))
    grids = [[list(g)] for g in stage.pixels.patches(rgbs)[1].tolist()]
    compiled = [record.as_py() for record in stage._image_inputs([[rgb] for rgb in rgbs], pa.chunked_array([grids]))[0]]
    monkeypatch.setattr(pixel_ops, "_resize", None)
    patches, _ = stage.pixels.patches(rgbs)
    assert isinstance(patches, torch.Tensor)
    fallback = [record.as_py() for record in stage._image_inputs([[rgb] for rgb in rgbs], pa.chunked_array([grids]))[0]]
    assert fallback == compiled


def test_the_run_summary_says_which_cpu_resize_the_vision_actors_use(model_dir, tmp_path, monkeypatch):
    # pip shows no build output: without this line a build that lost its C resize is seen only as a slower start
    import json

    from ingest.media import pixels as pixel_ops
    from ingest.run import RunReport

    assert pixel_ops.cpu_resize(model_dir).startswith("the C resize")
    report = RunReport(image_resize=pixel_ops.cpu_resize(model_dir))
    assert "CPU image resize   the C resize (ingest.media._resize)" in report.format()
    monkeypatch.setattr(pixel_ops, "_resize", None)
    assert pixel_ops.cpu_resize(model_dir).startswith("torch's kernel: the C resize was not built")
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**config, "do_normalize": False}))
    assert pixel_ops.cpu_resize(other).startswith("the processor's own")
    assert "CPU image resize" not in RunReport().format()  # text runs resize nothing


def test_device_resize_path_runs_on_cpu_within_the_stated_tolerance(model_dir):
    """The GPU path's code (float resize passes) run on the CPU: grids equal, pixels within two uint8 levels."""
    from ingest.media.pixels import ImagePixels

    pixels = ImagePixels.from_dir(model_dir)
    rgbs = sample_rgbs()
    cpu, cpu_grids = pixels(rgbs)
    device_path, device_grids = pixels(rgbs, "cpu", native_uint8=False)
    assert np.array_equal(cpu_grids, device_grids)
    difference = np.abs(cpu - device_path)
    assert difference.max() <= pixels.device_tolerance()
    assert (difference > 1e-4).mean() < 0.01  # off only where a value sits near a rounding edge


def test_block_images_go_to_the_device_in_one_copy(geo3k_files, model_dir):
    """Images that view one buffer become views of one uploaded tensor (one transfer per batch); others, and
    tensors already on the device, go as they are. A decoded block's images are such views."""
    from ingest.blocks import rgb_arrays
    from ingest.media.pixels import _shared_span, device_images
    from tools.vision_bench import decoded_blocks

    rgbs = sample_rgbs()
    buffer = np.concatenate([rgb.reshape(-1) for rgb in rgbs])
    ends = np.cumsum([rgb.size for rgb in rgbs])
    views = [buffer[end - rgb.size : end].reshape(rgb.shape) for rgb, end in zip(rgbs, ends, strict=True)]
    on_device = torch.zeros((3, 5, 7), dtype=torch.uint8)
    uploaded = device_images([*views, on_device], "cpu", one_copy=True)
    assert uploaded[-1] is on_device
    for tensor, rgb in zip(uploaded, rgbs, strict=False):
        assert torch.equal(tensor, torch.from_numpy(rgb).permute(2, 0, 1))
    assert len({t.untyped_storage().data_ptr() for t in uploaded[:-1]}) == 1  # views of one tensor
    separate = device_images([rgb.copy() for rgb in rgbs], "cpu", one_copy=True)
    assert len({t.untyped_storage().data_ptr() for t in separate}) == len(rgbs)
    far_apart = [buffer[:12].reshape(2, 2, 3), buffer[-12:].reshape(2, 2, 3)]
    assert _shared_span(far_apart) is None  # the span would be mostly other bytes: each goes on its own
    block = decoded_blocks(geo3k_files, model_dir)[0]
    assert _shared_span([im for row in rgb_arrays(block.column("multi_modal_data")) if row for im in row])


def test_device_patches_come_back_into_reused_host_buffers(model_dir):
    """A device's patches land in a ``DEVICE_PATCHES`` buffer, page-locked where CUDA is (one DMA back), reused
    once the block is gone; ``pinned_or_pageable`` gives ordinary memory without CUDA. The copy-back itself runs
    with a device: ``test_cuda_vision_matches_cpu_within_tolerance`` and ``tools/gpu``."""
    from ingest.media.pixels import DEVICE_PATCHES, ImagePixels, host_array
    from ingest.memory import pinned_or_pageable

    array = pinned_or_pageable(1000)
    assert array.dtype == np.uint8 and array.shape == (1000,)
    assert torch.from_numpy(array).is_pinned() == torch.cuda.is_available()
    if not torch.cuda.is_available():
        return
    pixels = ImagePixels.from_dir(model_dir)
    patches, _ = pixels.patches(sample_rgbs(), "cuda")
    host = host_array(patches)
    assert torch.equal(torch.from_numpy(host), patches.cpu()) and torch.from_numpy(host).is_pinned()
    address = host.ctypes.data
    assert any(b.ctypes.data == address for b in DEVICE_PATCHES._buffers)
    assert host_array(patches).ctypes.data != address  # still held: not handed out again
    del host
    assert host_array(patches).ctypes.data == address


def test_consumer_pixel_values_reuse_only_buffers_nothing_holds(monkeypatch):
    """The float32 ``pixel_values`` built on the CPU (the collate, per image row) come from ``PIXEL_VALUES``: a row
    the caller still holds is never written again, a dropped row's buffer is reused (the smallest that fits), and
    each row's tensor owns just its bytes (pickling or saving it carries no other row's)."""
    import pickle

    import torch

    import ingest.media.pixels
    from ingest.media.pixels import normalize_patches
    from ingest.memory import ReusedBuffers

    pool = ReusedBuffers(keep=192, slack=1.0)  # this test's own: other tests' free buffers could fit better
    monkeypatch.setattr(ingest.media.pixels, "PIXEL_VALUES", pool)
    rng = np.random.default_rng(1)
    mean, std = (122.7, 116.7, 104.1), (68.5, 66.6, 70.3)
    rows = [rng.integers(0, 256, (n, 3, 14, 14), dtype=np.uint8) for n in (40, 10, 25)]
    held = [normalize_patches(r, mean, std, 2) for r in rows]
    expected = [h.clone() for h in held]
    for h, r in zip(held, rows, strict=True):
        assert h.shape == (len(r), 3 * 2 * 14 * 14) and h.untyped_storage().nbytes() == h.numel() * 4
        assert len(pickle.dumps(h)) < h.numel() * 4 + 4096
    addresses = {h.data_ptr() for h in held}
    others = [normalize_patches(r, mean, std, 2) for r in rows]  # all three held: new buffers
    assert not addresses & {o.data_ptr() for o in others}
    assert all(torch.equal(h, e) for h, e in zip(held, expected, strict=True))
    large, small = held[0].data_ptr(), held[1].data_ptr()
    del held, others
    again = normalize_patches(rows[1], mean, std, 2)  # 10 patches: the smallest free buffer that fits
    assert again.data_ptr() == small and torch.equal(again, expected[1])
    assert normalize_patches(rows[0], mean, std, 2).data_ptr() == large
    assert any(b.ctypes.data == small for b in pool._buffers)


def test_consumer_normalize_is_bit_equal_across_its_chunks():
    """The CPU normalize goes a few hundred patches at a time (``_NORMALIZE_CHUNK``), normalizing each once and
    copying it into both frames: bit-equal to (x - mean) / std in float32 over the repeated frames, at and around
    the chunk boundaries."""
    from ingest.media.pixels import _NORMALIZE_CHUNK, normalize_patches

    rng = np.random.default_rng(2)
    mean, std = (122.7, 116.7, 104.1), (68.5, 66.6, 70.3)
    step = _NORMALIZE_CHUNK // (3 * 14 * 14)
    for n in (1, step - 1, step, step + 1, 3 * step + 5):
        patches = rng.integers(0, 256, (n, 3, 14, 14), dtype=np.uint8)
        frames = np.repeat(patches.reshape(n, 3, 1, 196).astype(np.float32), 2, axis=2)
        expected = (frames - np.float32(mean).reshape(1, 3, 1, 1)) / np.float32(std).reshape(1, 3, 1, 1)
        got = normalize_patches(patches, mean, std, 2).numpy()
        assert got.shape == (n, 3 * 2 * 196) and got.tobytes() == expected.reshape(n, -1).tobytes(), n
