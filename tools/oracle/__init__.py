"""Running verl itself (the parity oracle of each row format, and the benchmark's competitor) in a subprocess.

Each verl release is the oracle of its own row format. verl 0.5.0 and 0.6.1 need transformers 4.57, 0.9.1 needs
5.9, so each lives in its own ``--target`` directory (``make oracle`` installs ``.oracle/``, ``.oracle-0.6/`` and
``.oracle-0.9/``) and runs with that directory in front of ``PYTHONPATH``, reusing this environment's torch, numpy,
pyarrow and PIL. A release installed alone (``ORACLE_BASES``) runs with its directory in front of 0.9.1's, whose
transformers 5.9 and the rest it reuses: verl 0.7.1 (``.oracle-0.7/``), the oracle of ``verl-0.7``, and verl 0.8.0
(``.oracle-0.8/``), another release of ``verl-0.9``'s line and a second oracle of it.

In the environment matrix (``tools/envs.py``) verl is installed in the test environment itself, as users install it:
with ``INGEST_ORACLE_INSTALLED=1`` that verl is the oracle of its own release's row format, run with no directory in
front of ``PYTHONPATH``, and the other oracles count as not installed.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ORACLE_DIR_ENV = "INGEST_ORACLE_DIR"  # the verl 0.5.0 oracle's directory, where it is not the repository's
ORACLE_PATH_ENV = "INGEST_ORACLE_PATH"  # set for the runner: the oracle's directories (oracle_path)
RUNNER = Path(__file__).with_name("verl_runner.py")
# oracle -> the directory (under the repository) its verl release is installed in. An oracle is named by its row
# format (that format's own release) or, for another release of a format's line, by its release (ORACLE_BASES).
ORACLE_DIRS = {
    "verl-0.5": ".oracle",
    "verl-0.6": ".oracle-0.6",
    "verl-0.7": ".oracle-0.7",
    "verl-0.9": ".oracle-0.9",
    "verl-0.8.0": ".oracle-0.8",
}
# a release installed alone (no transformers of its own) -> the oracle whose directory goes behind its own
ORACLE_BASES = {"verl-0.7": "verl-0.9", "verl-0.8.0": "verl-0.9"}
INSTALLED_ENV = "INGEST_ORACLE_INSTALLED"  # "1": this environment's own verl is the oracle (no overlay)
# a verl release series -> the oracle it is (its row format, or the release for another release of a format's line)
RELEASE_ORACLES = {"0.5": "verl-0.5", "0.6": "verl-0.6", "0.7": "verl-0.7", "0.8": "verl-0.8.0", "0.9": "verl-0.9"}


def installed_oracle() -> str | None:
    """With ``INGEST_ORACLE_INSTALLED=1``, the oracle the verl installed in this environment is; else None."""
    from ingest.config import installed_verl_version

    release = installed_verl_version() if os.environ.get(INSTALLED_ENV) == "1" else None
    return RELEASE_ORACLES.get(".".join(release.split(".")[:2])) if release else None


def oracle_dir(row_format: str = "verl-0.5") -> Path:
    """The directory of the oracle ``row_format`` (a row format or a release of ``ORACLE_BASES``)."""
    if row_format == "verl-0.5" and os.environ.get(ORACLE_DIR_ENV):
        return Path(os.environ[ORACLE_DIR_ENV])
    return Path(__file__).resolve().parents[2] / ORACLE_DIRS[row_format]


def oracle_path(row_format: str = "verl-0.5") -> list[Path]:
    """The directories the oracle ``row_format`` runs with, first first: its own, then its base's (if it has one);
    none for the installed oracle."""
    if os.environ.get(INSTALLED_ENV) == "1":
        return []
    base = ORACLE_BASES.get(row_format)
    return [oracle_dir(row_format), *(oracle_path(base) if base else [])]


def oracle_available(row_format: str = "verl-0.5") -> bool:
    if os.environ.get(INSTALLED_ENV) == "1":
        return installed_oracle() == row_format
    return all((d / "verl" / "utils" / "dataset" / "rl_dataset.py").is_file() for d in oracle_path(row_format))


def oracle_environment(row_format: str, scratch: Path) -> dict[str, str]:
    """This process's environment with the verl release of the oracle ``row_format`` (and its base's directory) in
    front of ``PYTHONPATH``; ``scratch`` holds its HF datasets cache."""
    env = dict(os.environ)
    dirs = [str(d) for d in oracle_path(row_format)]
    if dirs:
        env["PYTHONPATH"] = os.pathsep.join([*dirs, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[ORACLE_PATH_ENV] = os.pathsep.join(dirs)  # the runner checks that verl and transformers come from them
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
    """Run ``verl_runner.py MODE`` with the verl release of the oracle ``row_format`` (a row format, or a release
    of ``ORACLE_BASES``) and return what it wrote (rows / batches for ``rows``, timings for ``bench``). ``rows``
    requests go to one long-lived runner per oracle (``OracleServer``); every other mode gets a process of its own."""
    if not oracle_available(row_format):
        where = " and ".join(str(d) for d in oracle_path(row_format))
        raise RuntimeError(f"the {row_format} oracle is not installed in {where} (run `make oracle`)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.pkl"
        spec = {"files": files, "tokenizer": tokenizer, "config": config, "out": str(out), **extra}
        if mode == "rows":
            OracleServer.of(row_format).request(spec, Path(tmp), timeout)
        else:
            _run_once(mode, spec, row_format, Path(tmp), timeout)
        with open(out, "rb") as f:
            return pickle.load(f)


def _run_once(mode: str, spec: dict, row_format: str, scratch: Path, timeout: float) -> None:
    env = oracle_environment(row_format, scratch)
    # its own process group, killed whole if we stop early: verl's DataLoader / datasets workers are its children
    with subprocess.Popen(
        [sys.executable, str(RUNNER), mode, json.dumps(spec)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=scratch,
        start_new_session=True,
    ) as proc:
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    if proc.returncode != 0:
        raise RuntimeError(f"verl oracle failed ({proc.returncode}):\n{stderr[-4000:]}")


class OracleServer:
    """One ``verl_runner.py serve`` process per verl release, kept for this process's life and killed with it:
    each ``rows`` request then costs verl's own work, not a new interpreter importing torch, transformers and
    verl (seconds each on a small machine, and a test session makes dozens). Requests are served one at a time; the
    tokenizer and processor are loaded afresh for each, and each gets its own HF datasets cache."""

    _running: dict[str, OracleServer] = {}

    @classmethod
    def of(cls, row_format: str) -> OracleServer:
        server = cls._running.get(row_format)
        if server is None or server.proc.poll() is not None:
            server = cls._running[row_format] = cls(row_format)
        return server

    def __init__(self, row_format: str):
        self.row_format = row_format
        self.scratch = tempfile.TemporaryDirectory()
        requests_read, self._requests = os.pipe()
        self._responses, responses_write = os.pipe()
        self.log = open(Path(self.scratch.name) / "runner.log", "w+")  # verl prints; the tail explains a failure
        spec = {"requests": requests_read, "responses": responses_write}
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), "serve", json.dumps(spec)],
            env=oracle_environment(row_format, Path(self.scratch.name)),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=self.scratch.name,
            pass_fds=(requests_read, responses_write),
            start_new_session=True,
        )
        os.close(requests_read)
        os.close(responses_write)
        self._pending = b""
        atexit.register(self.close)

    def request(self, spec: dict, scratch: Path, timeout: float) -> None:
        """Run one ``rows`` spec; raises with the runner's error (or its log's tail, if it died)."""
        line = json.dumps({**spec, "hf_datasets_cache": str(scratch / "hf-datasets")}) + "\n"
        try:
            os.write(self._requests, line.encode())
            answer = self._answer(timeout)
        except BaseException:
            self.close()  # a request cut short leaves the runner mid-work: the next one starts a new runner
            raise
        if "error" in answer:
            raise RuntimeError(f"verl oracle failed:\n{answer['error'][-4000:]}")

    def _answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._responses], [], [], left)[0]:
                raise TimeoutError(f"verl oracle gave no answer in {timeout:.0f} s")
            chunk = os.read(self._responses, 1 << 16)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError(f"verl oracle runner exited ({self.proc.wait()}):\n{self.log.read()[-4000:]}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.log.closed:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self._requests)
        os.close(self._responses)
        self.log.close()
        self.scratch.cleanup()
        atexit.unregister(self.close)
        if OracleServer._running.get(self.row_format) is self:
            del OracleServer._running[self.row_format]


def run_verl_dataproto(batches: list[dict], repeat: int = 2, timeout: float = 600) -> dict:
    """Our collated batches through verl 0.5.0's ``DataProto.from_single_dict`` and ``RayPPOTrainer.fit``'s
    generation pops (its own source lines), then ``repeat(repeat, interleave=True)``: per batch the popped
    ``gen`` and remaining ``rest`` as plain dicts (``tensors``, ``non_tensors``), the pop key lists and lengths."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batches.pkl"
        with open(path, "wb") as f:
            pickle.dump(batches, f)
        return run_verl("dataproto", [], "", None, timeout=timeout, batches=str(path), repeat=repeat)
