"""A consuming process for the resume test: ``python tests/support/resume_worker.py SPEC_JSON``.

Iterates a ``PromptStream`` (from a saved state when the spec names one), appends each batch's ``index`` values and an
``input_ids`` checksum to ``out`` and writes ``state_dict()`` to ``state`` after every batch (a trainer's checkpoint),
and kills itself with SIGKILL after ``kill_after`` batches (a crash, no cleanup).
"""

import json
import os
import signal
import sys

import ray


def main() -> None:
    spec = json.loads(sys.argv[1])
    from ingest import PromptStream

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    stream = PromptStream(spec["files"], spec["tokenizer"], spec["config"], spec["batch_size"])
    if spec.get("resume"):
        with open(spec["state"]) as f:
            stream.load_state_dict(json.load(f))
    for k, batch in enumerate(stream, start=1):
        record = {"index": [int(i) for i in batch["index"]], "ids": int(batch["input_ids"].sum())}
        with open(spec["out"], "a") as f:
            f.write(json.dumps(record) + "\n")
        with open(spec["state"] + ".tmp", "w") as f:
            json.dump(stream.state_dict(), f)
        os.replace(spec["state"] + ".tmp", spec["state"])
        if k == spec.get("kill_after"):
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
