"""Shared fixtures: one real local Ray for the session, the offline Qwen2-VL tokenizer, generated data."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
        _system_config={"metrics_report_interval_ms": 1000},  # the metrics test reads the exported counters
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def model_dir():
    from ingest.tokenizer.offline import build_offline_model_dir

    return str(build_offline_model_dir())


@pytest.fixture(scope="session")
def variety_files(tmp_path_factory):
    """gsm8k-shaped rows with everything the parity contract lists, over 3 files."""
    from ingest.demo import write_gsm8k_parquet

    return write_gsm8k_parquet(
        tmp_path_factory.mktemp("variety"), 210, num_files=3, row_group_size=25, variety=True, long_every=23
    )


def collect(ds, batch_size=16, **collate_kwargs):
    from ingest import VerlCollate

    return list(ds.iter_torch_batches(batch_size=batch_size, collate_fn=VerlCollate(**collate_kwargs)))
