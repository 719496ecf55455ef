"""Where the vision stage's pixel kernels run: the device an actor uses, the resize kernel on it (C / torch /
Triton), and torch's CPU threads."""

from __future__ import annotations

import os
import sys

from ingest.config import DEVICE_RESIZES


def resolve_device(device: str) -> str:
    """``auto``: cuda where this process can use a GPU, else cpu. In a Ray actor that Ray gave no GPU the answer is
    cpu without importing torch (seconds of an actor's start-up that the CPU image path never needs); elsewhere
    torch's answer."""
    if device != "auto":
        return device
    if _ray_actor_gpu_ids() == []:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _ray_actor_gpu_ids() -> list[str] | None:
    """The GPU ids Ray assigned to the current actor; None outside a Ray actor."""
    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    return list(context.get_accelerator_ids().get("GPU", []))


def resize_kernel(device_resize: str, device: str) -> str:
    """The image resize ``ImagePixels.patches`` runs for ``vision_device_resize`` on ``device``: "triton" on CUDA
    (and on the CPU under ``TRITON_INTERPRET=1``, the tests' way to run it), else "torch" (on the CPU: the C uint8
    kernel, whose bytes the Triton kernels reproduce). "auto": "triton" on CUDA where triton imports, else "torch";
    on the CPU it imports nothing (a CPU vision actor never imports torch or triton)."""
    if device_resize not in DEVICE_RESIZES:
        raise ValueError(f"vision_device_resize must be one of {DEVICE_RESIZES}, got {device_resize!r}")
    if device_resize == "torch":
        return "torch"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.startswith("cuda") or (device_resize == "triton" and interpreted):
        from ingest.media.triton_resize import triton_available

        why = triton_available()
        if why and device_resize == "triton":
            raise RuntimeError(f"vision_device_resize: triton, but triton does not import here ({why})")
        return "torch" if why else "triton"
    return "torch"


def limit_torch_threads() -> None:
    """Hold torch's CPU thread pool to the actor's CPU share. Ray sets ``OMP_NUM_THREADS`` per task and actor (1
    for a fractional CPU) and torch follows it when first imported there; in a worker that imported torch earlier (a
    cluster started with ``RAY_preload_python_modules`` naming torch) the pool spans every core, and its OpenMP
    threads spin-wait on the cores the other stages' actors need (docs/design.md).
    Where torch is not imported yet this leaves it so (the CPU image path may never need it)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
