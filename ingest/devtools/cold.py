"""Our side of ``bench text`` / ``bench mm`` as a first run meets it: a new process, nothing started before the
clock, the default pools (``build_dataset`` starts a brand-new local Ray and Ray Data's cluster actors on the clock).
Clock from ``build_dataset`` to the last batch of ``iter_torch_batches(collate_fn=VerlCollate())``; steady state is
the rows after the first batch over the time after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ingest.devtools.bench import BATCH_SIZE, run_ours


def steady_rows_per_s(result: dict) -> float:
    """Rows after the first batch over the time after it."""
    return (result["rows"] - BATCH_SIZE) / (result["seconds"] - result["time_to_first_batch_s"])


def run_cold(files: list[str], model: str, config: dict, processor: str | None) -> dict:
    """``run_ours`` in a new process on a new local Ray session (never a cluster left running on the machine)."""
    spec = json.dumps({"files": files, "model": model, "config": config, "processor": processor})
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.run(
        [sys.executable, "-m", __name__, spec], env=env, capture_output=True, text=True, check=False, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the cold run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    measured = run_ours(args["files"], args["model"], args["config"], args["processor"])
    measured = {k: round(v, 3) for k, v in measured.items()}
    print(json.dumps({**measured, "steady_rows_per_s": round(steady_rows_per_s(measured), 1)}))
