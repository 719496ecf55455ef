"""Shared fixtures: one real local Ray for the session, the offline Qwen2-VL tokenizer, generated data; tests marked
``gpu`` skip where there is no CUDA device. Helpers that are not fixtures are in tests/support/."""

from __future__ import annotations

import gc
import os

import pytest

from ingest.ray_version import installed_ray, ray_series

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests need a CUDA device: skipped without one (``pytest -m gpu`` selects them on a GPU
    machine)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def release_module_objects():
    """Module-scoped fixtures (datasets, pipelines) become garbage when their module ends: a full collection then,
    everything unfrozen first; what survives (torch, Ray, transformers: ~300,000 objects) is frozen again, so the
    collections after each test skip it (a full one took 0.2-0.4 s a test)."""
    yield
    gc.unfreeze()
    gc.collect()
    gc.freeze()


# Ray 2.60's actor pools drop a shut-down pool's actor handles themselves. Before it, a failed pipeline's executor can
# still be referenced for a moment after its test, and one frozen then kept its starting actors (and their CPUs) alive
# until the module ended: later tests waited for CPUs. There, nothing made during a module is frozen.
FREEZE_AFTER_EACH_TEST = ray_series(installed_ray()) >= (2, 60)


@pytest.fixture(autouse=True)
def release_pipelines_after_each_test():
    """A pipeline whose iteration raised stays alive (its actors holding the session's CPUs) while the exception's
    traceback cycle keeps its iterator; such cycles go only when the garbage collector runs. Collecting after every
    test shuts those pipelines down, so a later test's actors are never left waiting for CPUs. What survives is
    frozen where that is safe: the next test's collection then scans only what that test made."""
    yield
    gc.collect()
    if FREEZE_AFTER_EACH_TEST:
        gc.freeze()


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # Logical CPUs beyond the 2 physical ones leave room for read tasks next to fractional actors; one logical GPU
    # makes GPU actors schedulable on this CPU machine (their kernels run with device="cpu").
    # address="local": never attach to a cluster some other test or user started with `ray start`
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=1,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def model_dir():
    from ingest.tokenizer.offline import build_offline_model_dir

    return str(build_offline_model_dir())


@pytest.fixture(scope="session")
def sft_family_dirs(tmp_path_factory, model_dir):
    """The offline tokenizers the SFT tests render with (tools/sft_tokenizers.py), built once per session."""
    from tools.sft_tokenizers import llama3_tokenizer_dir, qwen3_vl_sft_dir, qwen_tokenizer_dir

    root = tmp_path_factory.mktemp("sft-families")
    qwen3 = qwen_tokenizer_dir(root / "qwen3", "qwen3")
    return {
        "qwen2-vl": model_dir,
        "qwen2.5": qwen_tokenizer_dir(root / "qwen2.5", "qwen2.5"),
        "qwen3": qwen3,
        "qwen3-vl": qwen3_vl_sft_dir(root / "qwen3-vl", qwen3),
        "llama-3": llama3_tokenizer_dir(root / "llama-3"),
    }


@pytest.fixture(scope="session")
def variety_files(tmp_path_factory):
    """gsm8k-shaped rows with everything the parity contract lists, over 3 files."""
    from ingest.demo import write_gsm8k_parquet

    return write_gsm8k_parquet(
        tmp_path_factory.mktemp("variety"), 210, num_files=3, row_group_size=25, variety=True, long_every=23
    )


@pytest.fixture(scope="module")
def geo3k_files(tmp_path_factory):
    """geo3k-shaped multimodal rows (every image kind, written with the HF Image() feature), over 2 files."""
    from tools.samples import write_geo3k_parquet

    return write_geo3k_parquet(tmp_path_factory.mktemp("geo3k"), 48, num_files=2, row_group_size=12)
