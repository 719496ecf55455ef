"""Running verl itself (the parity oracle of each row format, and the benchmark's competitor) in a subprocess.

Each verl release is the oracle of its own row format. verl 0.5.0 and 0.6.1 need transformers 4.57, 0.9.1 needs
5.9, so each lives in its own ``--target`` directory (``make oracle`` installs ``.oracle/``, ``.oracle-0.6/`` and
``.oracle-0.9/``) and runs with that directory in front of ``PYTHONPATH``, reusing this environment's torch, numpy,
pyarrow and PIL.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ORACLE_DIR_ENV = "INGEST_ORACLE_DIR"  # the verl 0.5.0 oracle's directory, where it is not the repository's
RUNNER = Path(__file__).with_name("verl_runner.py")
# row format -> the directory (under the repository) its verl release is installed in
ORACLE_DIRS = {"verl-0.5": ".oracle", "verl-0.6": ".oracle-0.6", "verl-0.9": ".oracle-0.9"}


def oracle_dir(row_format: str = "verl-0.5") -> Path:
    if row_format == "verl-0.5" and os.environ.get(ORACLE_DIR_ENV):
        return Path(os.environ[ORACLE_DIR_ENV])
    return Path(__file__).resolve().parents[3] / ORACLE_DIRS[row_format]


def oracle_available(row_format: str = "verl-0.5") -> bool:
    return (oracle_dir(row_format) / "verl" / "utils" / "dataset" / "rl_dataset.py").is_file()


def oracle_environment(row_format: str, scratch: Path) -> dict[str, str]:
    """This process's environment with the verl release of ``row_format`` in front of ``PYTHONPATH``; ``scratch``
    holds its HF datasets cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(oracle_dir(row_format)), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # qwen-vl-utils reads videos with torchcodec whenever it is installed (a test requirement here): the oracle
    # keeps decord, the reader its parity was established with (docs/parity.md)
    env.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")
    # A fresh HF datasets cache per run: a warm one replays verl's overlong filter from disk
    env["HF_DATASETS_CACHE"] = str(scratch / "hf-datasets")
    return env


def run_verl(
    mode: str,
    files: list[str],
    tokenizer: str,
    config: dict | None,
    timeout: float = 1800,
    row_format: str = "verl-0.5",
    **extra,
) -> dict:
    """Run ``verl_runner.py MODE`` with the verl release of ``row_format`` and return what it wrote (rows / batches
    for ``rows``, timings for ``bench``)."""
    if not oracle_available(row_format):
        raise RuntimeError(f"the {row_format} oracle is not installed in {oracle_dir(row_format)} (run `make oracle`)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.pkl"
        spec = {"files": files, "tokenizer": tokenizer, "config": config, "out": str(out), **extra}
        env = oracle_environment(row_format, Path(tmp))
        # its own process group, killed whole if we stop early: verl's DataLoader / datasets workers are its children
        with subprocess.Popen(
            [sys.executable, str(RUNNER), mode, json.dumps(spec)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp,
            start_new_session=True,
        ) as proc:
            try:
                _, stderr = proc.communicate(timeout=timeout)
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                raise
        if proc.returncode != 0:
            raise RuntimeError(f"verl oracle failed ({proc.returncode}):\n{stderr[-4000:]}")
        with open(out, "rb") as f:
            return pickle.load(f)


def run_verl_dataproto(batches: list[dict], repeat: int = 2, timeout: float = 600) -> dict:
    """Our collated batches through verl 0.5.0's ``DataProto.from_single_dict`` and ``RayPPOTrainer.fit``'s
    generation pops (its own source lines), then ``repeat(repeat, interleave=True)``: per batch the popped
    ``gen`` and remaining ``rest`` as plain dicts (``tensors``, ``non_tensors``), the pop key lists and lengths."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batches.pkl"
        with open(path, "wb") as f:
            pickle.dump(batches, f)
        return run_verl("dataproto", [], "", None, timeout=timeout, batches=str(path), repeat=repeat)
