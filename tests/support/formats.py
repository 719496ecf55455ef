"""Both sides of a row-format parity test: our batches and the batches of that format's verl release."""

from __future__ import annotations

from ingest import VerlCollate, build_dataset
from tools.oracle import run_verl


def ours(files, model_dir, config: dict, row_format: str, batch_size: int, processor=None) -> list[dict]:
    """``build_dataset`` in input order, collated as ``row_format``'s verl does."""
    ds = build_dataset(files, model_dir, {**config, "shuffle": False, "row_format": row_format}, processor=processor)
    return list(ds.iter_torch_batches(batch_size=batch_size, collate_fn=VerlCollate(row_format=row_format)))


def verl(files, model_dir, configs: list[dict], cache, row_format: str, batch_size: int, processor=None) -> list[dict]:
    """``row_format``'s verl release on the same files, one run per config (``rows`` and collated ``batches``)."""
    configs = [{**c, "cache_dir": str(cache)} for c in configs]
    extra = {"configs": configs, "batch_size": batch_size, "processor": processor}
    return run_verl("rows", files, model_dir, None, row_format=row_format, **extra)["runs"]


def formats_allowed(*row_formats: str) -> bool:
    """False where the environment's own verl refuses one of ``row_formats`` (an installed release only reads its
    own line's rows: ``resolve_row_format``); true where no verl is installed, as in ``make test``."""
    from ingest.config import resolve_row_format

    try:
        for row_format in row_formats:
            resolve_row_format(row_format)
    except ValueError:
        return False
    return True


def skip_unless_formats_allowed(*row_formats: str) -> None:
    """Skip a test that builds ``row_formats`` where the installed verl refuses one of them: such tests run where no
    verl is installed; the environment matrix, which installs verl, runs that release's own cases."""
    import pytest

    if not formats_allowed(*row_formats):
        pytest.skip(f"the installed verl refuses one of {row_formats}")
