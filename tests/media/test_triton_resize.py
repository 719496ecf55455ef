"""The Triton image resize (``vision_device_resize: triton``, ``ingest/media/triton_resize.py``): its patches are the
CPU uint8 kernel's, byte for byte. CI has no GPU, so the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
CPU tensors), in a subprocess: the variable has to be set before triton is imported. Triton's compiler builds them for
the GPUs without one; they run compiled where a CUDA device is (``test_cuda_triton_resize_equals_the_cpu_kernel``, in
``tools/gpu/run.sh``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ingest.config import DataConfig
from ingest.media.device import resize_kernel
from ingest.stages.vision import VisionStage
from tests.support.tiers import slow

ROOT = Path(__file__).resolve().parents[2]

# Random images of sizes that keep, shrink and grow each side (28 x 28 keeps both: the identity weights), extreme
# aspect ratios and a large downscale (many taps); given three ways: views of one buffer (a block's), separate arrays,
# and (3, H, W) tensors. Then a block of geo3k rows (every image kind of the parity data) through VisionStage.
INTERPRETED = r"""
import sys
import numpy as np
import torch
from ingest.config import DataConfig
from ingest.tokenizer.offline import build_offline_model_dir
from ingest.media.pixels import ImagePixels
from tools.samples import write_geo3k_parquet
from ingest.stages.vision import VisionStage
from tools.vision_bench import decoded_blocks

model = str(build_offline_model_dir())
pixels = ImagePixels.from_dir(model)
rng = np.random.default_rng(0)
shapes = [(28, 28), (30, 97), (120, 56), (57, 300), (200, 33), (56, 56), (29, 400), (400, 29), (900, 500), (12, 45)]
size = sum(h * w * 3 for h, w in shapes)
buffer = rng.integers(0, 256, size, dtype=np.uint8)
views, offset = [], 0
for h, w in shapes:
    views.append(buffer[offset : offset + h * w * 3].reshape(h, w, 3))
    offset += h * w * 3
expected, grids = pixels.patches(views, "cpu")
expected = np.asarray(expected)
for name, images in (
    ("views of one buffer", views),
    ("separate arrays", [v.copy() for v in views]),
    ("(3, H, W) tensors", [torch.from_numpy(v.copy()).permute(2, 0, 1) for v in views]),
):
    got, got_grids = pixels.patches(images, "cpu", kernel="triton")
    assert np.array_equal(got_grids, grids), name
    diff = np.abs(got.numpy().astype(int) - expected.astype(int))
    assert diff.max() == 0, f"{name}: {int((diff > 0).sum())} values differ, by up to {diff.max()}"
files = write_geo3k_parquet(sys.argv[1], 8, row_group_size=8)
cpu = VisionStage(model, DataConfig(vision_device="cpu"))
triton = VisionStage(model, DataConfig(vision_device="cpu", vision_device_resize="triton"))
assert (cpu.resize_kernel, triton.resize_kernel) == ("torch", "triton")
for block in decoded_blocks(files, model):
    assert triton(block).equals(cpu(block))
print("ok", len(shapes), "images")
"""


@slow
def test_interpreted_triton_resize_gives_the_cpu_kernels_patches(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", INTERPRETED, str(tmp_path / "geo3k")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-3000:]


# Triton's own compiler (and the ptxas its wheel ships), no GPU needed: the kernels build to a cubin for Hopper
# (sm_90: H100 / H200, the machines lent) and Ampere (sm_80). The interpreter above checks the arithmetic; it is
# lenient about what the compiler rejects.
COMPILE = r"""
import torch
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import create_function_from_signature
from ingest.media import _triton_kernels as kernels
from ingest.media.triton_resize import BLOCK, PARAMS


pointers = {"table": "*i32", "starts": "*i32", "images": "i32", "axes": "*i32", "weights": "*i32"}
for fn, images, extra in (
    (kernels.across, {"src": "*u8", "mid": "*u8"}, {}),
    (kernels.down, {"mid": "*u8", "out": "*u8"}, {"PATCH": 14, "MERGE": 2}),
):
    constants = {"BLOCK": BLOCK, "PARAMS": PARAMS, **extra}
    signature = {**images, **pointers, **{name: "constexpr" for name in constants}}
    assert list(signature) == fn.arg_names, (fn.arg_names, list(signature))
    constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    for arch in (90, 80):
        target = GPUTarget("cuda", arch, 32)
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target)
        assert compiled.asm["cubin"], (fn.__name__, arch)
    # the launch's argument binder (kernel[grid](...) runs it first): a kernel argument that shares a name with its
    # locals breaks every launch ("failed to specialize argument of type: dict", on the first GPU run)
    binder = create_function_from_signature(fn.signature, fn.params, backends["nvidia"].compiler(target))
    values = {name: 3 if kind == "i32" else torch.zeros(4, dtype=torch.int32) for name, kind in signature.items()}
    _, specialization, _ = binder(**{**values, **constants})
    assert len(specialization) == len(signature), (fn.__name__, specialization)
print("ok")
"""


def test_triton_kernels_compile_for_hopper_and_ampere(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-3000:]


def test_device_resize_setting(monkeypatch):
    assert DataConfig().vision_device_resize == "auto"
    with pytest.raises(ValueError, match="vision_device_resize must be one of"):
        DataConfig(vision_device_resize="cuda")
    assert resize_kernel("torch", "cuda") == "torch"
    assert resize_kernel("triton", "cpu") == ("triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch")
    assert resize_kernel("auto", "cpu") == "torch"  # the C uint8 kernel: the same bytes, no torch or triton import
    assert resize_kernel("auto", "cuda:1") == "triton"  # triton imports here (torch's wheels bring it)
    with pytest.raises(ValueError, match="vision_device_resize"):
        resize_kernel("nearest", "cpu")
    monkeypatch.setattr("ingest.media.triton_resize.triton_available", lambda: "ImportError: no triton")
    assert resize_kernel("auto", "cuda") == "torch"
    with pytest.raises(RuntimeError, match="triton does not import here"):
        resize_kernel("triton", "cuda")


def test_auto_falls_back_to_torch_where_the_triton_kernels_do_not_run(monkeypatch, caplog):
    """ "auto" picks Triton on CUDA; where its kernels then fail (here: really launched on CPU tensors without the
    interpreter, which Triton refuses), the actor warns and resizes with torch's kernels. An explicit "triton" fails."""
    from ingest.stages import vision
    from ingest.tokenizer.offline import build_offline_model_dir

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(vision, "resize_kernel", lambda choice, device: "triton")
    model = str(build_offline_model_dir())
    with caplog.at_level("WARNING", logger="ingest.stages.vision"):
        stage = VisionStage(model, DataConfig(vision_device="cpu", vision_device_resize="auto"))
    assert stage.resize_kernel == "torch"
    assert "the Triton resize failed on cpu" in caplog.text
    with pytest.raises(Exception):  # noqa: B017 - whatever Triton raises for that launch
        VisionStage(model, DataConfig(vision_device="cpu", vision_device_resize="triton"))


@pytest.mark.gpu
def test_cuda_triton_resize_equals_the_cpu_kernel():
    """The compiled kernels: the CPU kernel's patches exactly, where the torch device resize is within 2 levels."""
    from ingest.media.pixels import ImagePixels
    from ingest.tokenizer.offline import build_offline_model_dir

    pixels = ImagePixels.from_dir(build_offline_model_dir())
    rng = np.random.default_rng(1)
    shapes = [(28, 28), (30, 97), (120, 56), (57, 300), (1000, 750), (29, 400), (480, 640)]
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    expected, grids = pixels.patches(images, "cpu")
    got, got_grids = pixels.patches(images, "cuda", kernel="triton")
    assert got.device.type == "cuda" and np.array_equal(got_grids, grids)
    assert np.array_equal(got.cpu().numpy(), np.asarray(expected))
