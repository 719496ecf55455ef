"""Runs verl 0.5.0 (inside the oracle environment). Usage: verl_runner.py rows|bench|dataproto SPEC_JSON.

rows:  every ``__getitem__`` row, and verl's ``collate_fn`` over consecutive batches, pickled.
bench: RLHFDataset + DataLoader(num_workers, batch_size, collate_fn) end to end: time to first batch and rows/s.
dataproto: batches pickled by our side (``spec["batches"]``, a pickle file) go through verl's own trainer code:
       ``DataProto.from_single_dict`` and the generation pops, the lines executed as they stand in
       ``RayPPOTrainer.fit`` (verl/trainer/ppo/ray_trainer.py), then ``repeat(n, interleave=True)``.
"""

import json
import os
import pickle
import sys
import time


def _tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:  # what verl.utils.tokenizer.hf_tokenizer does
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _processor(path):
    if not path:
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


FIT_START = "batch: DataProto = DataProto.from_single_dict(batch_dict)"
FIT_END = "non_tensor_batch_keys=non_tensor_batch_keys_to_pop,"


def _fit_generation_pops():
    """The code ``RayPPOTrainer.fit`` runs on each dataloader batch up to the generation pop, as source text."""
    import textwrap
    from pathlib import Path

    import verl

    source = (Path(verl.__file__).parent / "trainer" / "ppo" / "ray_trainer.py").read_text()
    start = source.index(FIT_START)
    end = source.index(")", source.index(FIT_END, start)) + 1
    line_start = source.rindex("\n", 0, start) + 1
    return textwrap.dedent(source[line_start:end])


def _plain(proto):
    tensors = dict(proto.batch.items()) if proto.batch is not None else {}
    return {"tensors": tensors, "non_tensors": dict(proto.non_tensor_batch)}


def dataproto(spec):
    """Each batch through ``from_single_dict`` + verl's pops + ``repeat``; plain dicts back (no tensordict)."""
    from verl import DataProto

    code = _fit_generation_pops()
    with open(spec["batches"], "rb") as f:
        batches = pickle.load(f)
    results = []
    for batch_dict in batches:
        scope = {"DataProto": DataProto, "batch_dict": batch_dict}
        exec(code, scope)  # verl 0.5.0's own lines: batch = from_single_dict(...); ...; gen_batch = batch.pop(...)
        gen_batch, batch = scope["gen_batch"], scope["batch"]
        repeated = gen_batch.repeat(repeat_times=spec.get("repeat", 2), interleave=True)
        results.append(
            {
                "len": len(gen_batch),
                "pop_keys": (scope["batch_keys_to_pop"], scope["non_tensor_batch_keys_to_pop"]),
                "gen": _plain(gen_batch),
                "rest": _plain(batch),
                "repeated_len": len(repeated),
                "repeated_index": repeated.non_tensor_batch.get("index"),
            }
        )
    return {"code": code, "batches": results}


def _exit_with_parent() -> None:
    """Linux: get SIGTERM when the process that started us dies, then kill our whole process group (a killed
    ``ingest bench`` left this runner and its DataLoader workers running, skewing the next measurement)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os
    import signal

    parent = os.getppid()
    if os.getpgid(0) == os.getpid():  # we lead our own group (run_verl starts us so): take our workers down with us
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)


def main():
    _exit_with_parent()
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    import torch

    if mode == "dataproto":  # no tokenizer: the batches come from our side
        with open(spec["out"], "wb") as f:
            pickle.dump(dataproto(spec), f)
        return

    # datasets forks a worker pool for verl's filter pass (num_proc >= 1); a child forked after the parent ran torch
    # ops on its intra-op thread pool deadlocks. One thread per process keeps the fork safe (results are the same).
    if mode == "rows":
        torch.set_num_threads(1)
    import transformers
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    # the oracle's own transformers (4.57 for verl 0.5.0 / 0.6.1, 5.9 for 0.9.1), not this environment's
    oracle_dir = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.realpath(transformers.__file__).startswith(os.path.realpath(oracle_dir)), transformers.__file__
    config = OmegaConf.create(spec.get("config") or {})
    started = time.perf_counter()
    tokenizer = _tokenizer(spec["tokenizer"])
    processor = _processor(spec.get("processor"))
    result = {}
    if mode == "rows":  # one result per config in spec["configs"] (one process start for many configs)
        result["runs"] = []
        for one in spec.get("configs", [spec["config"]]):
            try:
                dataset = RLHFDataset(list(spec["files"]), tokenizer, OmegaConf.create(one), processor)
                rows = [dataset[i] for i in range(len(dataset))]
            except Exception as exc:  # the oracle's own errors are part of the contract (truncation="error")
                result["runs"].append({"error": f"{type(exc).__name__}: {exc}"})
                continue
            batch_size = spec.get("batch_size", 16)
            batches = [collate_fn(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
            result["runs"].append({"rows": rows, "batches": batches})
    elif mode == "bench":
        from torch.utils.data import DataLoader

        dataset = RLHFDataset(spec["files"], tokenizer, config, processor)
        loader = DataLoader(
            dataset,
            batch_size=spec.get("batch_size", 64),
            num_workers=spec.get("num_workers", 2),
            collate_fn=collate_fn,
            shuffle=False,
        )
        first, rows = None, 0
        for batch in loader:
            if first is None:
                first = time.perf_counter() - started
            rows += len(batch["input_ids"])
        total = time.perf_counter() - started
        result = {"rows": rows, "seconds": total, "time_to_first_batch_s": first, "rows_per_s": rows / total}
    else:
        raise SystemExit(f"unknown mode {mode}")
    with open(spec["out"], "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
