"""Runs a verl release (inside its oracle environment). Usage: verl_runner.py MODE SPEC_JSON.

rows:  every ``__getitem__`` row, and verl's ``collate_fn`` over consecutive batches, pickled.
serve: ``rows`` requests one after another from a pipe (``oracle.run_verl`` keeps one such process per release, so a
       test session pays the interpreter, torch, transformers and verl imports once per release, not once per run).
bench: RLHFDataset + DataLoader(num_workers, batch_size, collate_fn) end to end: time to first batch and rows/s.
dataproto: batches pickled by our side (``spec["batches"]``, a pickle file) go through verl's own trainer code:
       ``DataProto.from_single_dict`` and the generation pops, the lines executed as they stand in
       ``RayPPOTrainer.fit`` (verl/trainer/ppo/ray_trainer.py), then ``repeat(n, interleave=True)``.
agent_loop: verl 0.7 / 0.9's agent loop, stock and on handed-off media (tools/oracle/agent_loop.py).
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
FIT_END = "non_tensor_batch_keys=non_tensor_batch_keys_to_pop,"  # 0.5.0: the pop is inline in fit
FIT_END_GEN_BATCH = "gen_batch = self._get_gen_batch(batch)"  # 0.6 and later
SAVE_START = 'dataloader_local_path = os.path.join(local_global_step_folder, "data.pt")'
SAVE_END = "torch.save(dataloader_state_dict, dataloader_local_path)"
# 0.5 / 0.6: after each step, fit updates a curriculum sampler if the dataloader has one
SAMPLER_START = "if isinstance(self.train_dataloader.sampler, AbstractCurriculumSampler):"
SAMPLER_END = "self.train_dataloader.sampler.update(batch=batch)"
LOAD_START = 'dataloader_local_path = os.path.join(global_step_folder, "data.pt")'
LOAD_END = 'print(f"Warning: No dataloader state found at {dataloader_local_path}, will start from scratch")'


def _trainer_source() -> str:
    from pathlib import Path

    import verl

    return (Path(verl.__file__).parent / "trainer" / "ppo" / "ray_trainer.py").read_text()


def _lines(source: str, start_marker: str, end_marker: str, end_char: str = "", after: int = 0) -> str:
    """The whole lines of ``source`` from the one holding ``start_marker`` to ``end_marker`` (and then up to the next
    ``end_char``), dedented: verl's own statements, to run as they stand."""
    import textwrap

    start = source.index(start_marker, after)
    end = source.index(end_marker, start) + len(end_marker)
    if end_char:
        end = source.index(end_char, end - 1) + 1
    line_start = source.rindex("\n", 0, start) + 1
    return textwrap.dedent(source[line_start:end])


def _fit_generation_pops():
    """The code ``RayPPOTrainer.fit`` runs on each dataloader batch up to the generation pop, as source text."""
    source = _trainer_source()
    if FIT_END in source:
        return _lines(source, FIT_START, FIT_END, ")")
    return _lines(source, FIT_START, FIT_END_GEN_BATCH)


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


def run_save_lines(save_lines: str, trainer, checkpoint_dir: str) -> None:
    """verl's own checkpoint lines that write ``data.pt``, run on ``trainer`` (its step's folder in
    ``checkpoint_dir``)."""
    import torch

    folder = os.path.join(checkpoint_dir, f"global_step_{trainer.global_steps}")
    scope = {"self": trainer, "os": os, "torch": torch, "local_global_step_folder": folder}
    exec(save_lines, {**scope, "local_mkdir_safe": lambda p: os.makedirs(p, exist_ok=True)})


def _task_runner_module():
    """The module of verl's legacy ``TaskRunner`` (its ``create_rl_dataset`` / ``create_rl_sampler``)."""
    import importlib.util

    legacy = "verl.trainer.main_ppo_v0"  # 0.9: the legacy runner moved here
    return importlib.import_module(legacy if importlib.util.find_spec(legacy) else "verl.trainer.main_ppo")


def trainer(spec):
    """verl's ``RayPPOTrainer`` code with ``ingest_trainer``'s dataloaders: ``_create_dataloader`` (lengths, the steps
    arithmetic), ``fit``'s lines on each batch up to the rollout hand-off (``DataProto``, uid, the generation pops,
    ``repeat``), ``data.pt`` saved after ``save_after`` steps by verl's own lines, then a second trainer that loads it
    by verl's own lines and runs on to the end. Per step: the popped keys and the rows' ``index`` values."""
    import uuid

    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from ingest.verl import ingest_trainer

    source = _trainer_source()
    fit_lines = _fit_generation_pops()
    sampler_lines = _lines(source, SAMPLER_START, SAMPLER_END) if SAMPLER_START in source else ""
    # from the folder's creation just before it (local_mkdir_safe) to the torch.save
    save_at = source.rindex("local_mkdir_safe(local_global_step_folder)", 0, source.index(SAVE_START))
    save_lines = _lines(source, "local_mkdir_safe", SAVE_END, after=save_at)
    load_lines = _lines(source, LOAD_START, LOAD_END)
    trainer_cls = ingest_trainer(RayPPOTrainer)

    runner = _task_runner_module()

    def new_trainer():
        trainer = object.__new__(trainer_cls)  # no worker groups: only the data side of the trainer runs
        trainer.config = config = OmegaConf.create(spec["trainer_config"])
        trainer.tokenizer = _tokenizer(spec["tokenizer"])
        trainer.processor = _processor(spec.get("processor"))
        trainer.async_rollout_mode = False
        trainer.global_steps = 0
        # as verl's TaskRunner does before it builds the trainer (data.custom_cls selects IngestDataset)
        train = runner.create_rl_dataset(config.data.train_files, config.data, trainer.tokenizer, trainer.processor)
        val = runner.create_rl_dataset(
            config.data.val_files, config.data, trainer.tokenizer, trainer.processor, is_train=False
        )
        result.setdefault("dataset_classes", [type(train).__name__, type(val).__name__])
        trainer._create_dataloader(train, val, None, runner.create_rl_sampler(config.data, train))
        return trainer

    def run(trainer, stop_after=None):
        steps = []
        total_epochs = trainer.config.trainer.total_epochs
        start_epoch = trainer.global_steps // len(trainer.train_dataloader)
        for _epoch in range(start_epoch, total_epochs):
            for batch_dict in trainer.train_dataloader:
                scope = {"self": trainer, "DataProto": DataProto, "batch_dict": batch_dict, "np": np, "uuid": uuid}
                exec(fit_lines, scope)  # verl's own lines: from_single_dict, uid, the generation pops
                gen_batch, batch = scope["gen_batch"], scope["batch"]
                repeated = gen_batch.repeat(repeat_times=trainer.config.actor_rollout_ref.rollout.n, interleave=True)
                if sampler_lines:  # verl's own lines at the end of each step
                    from verl.experimental.dataset.sampler import AbstractCurriculumSampler

                    exec(
                        sampler_lines,
                        {"self": trainer, "batch": batch, "AbstractCurriculumSampler": AbstractCurriculumSampler},
                    )
                trainer.global_steps += 1
                steps.append(
                    {
                        "gen_tensors": sorted(gen_batch.batch.keys()) if gen_batch.batch is not None else [],
                        "gen_non_tensors": sorted(gen_batch.non_tensor_batch),
                        "rest_non_tensors": sorted(batch.non_tensor_batch),
                        "index": [int(i) for i in gen_batch.non_tensor_batch["index"]],
                        "repeated": len(repeated),
                    }
                )
                if trainer.global_steps >= trainer.total_training_steps:
                    return steps
                if stop_after is not None and trainer.global_steps == stop_after:
                    run_save_lines(save_lines, trainer, spec["checkpoint_dir"])
                    return steps
        return steps

    result = {}
    first = new_trainer()
    result |= {
        "len_train": len(first.train_dataloader),
        "len_val": len(first.val_dataloader),
        "total_training_steps": first.total_training_steps,
        "optim_steps": first.config.actor_rollout_ref.actor.optim.total_training_steps,
        "critic_steps": first.config.critic.optim.total_training_steps,
        "val_batches": [len(b["index"]) for b in first.val_dataloader],
    }
    result["uninterrupted"] = run(first)
    before = new_trainer()
    result["before"] = run(before, stop_after=spec["save_after"])
    resumed = new_trainer()
    resumed.global_steps = spec["save_after"]
    folder = os.path.join(spec["checkpoint_dir"], f"global_step_{spec['save_after']}")
    exec(load_lines, {"self": resumed, "os": os, "torch": torch, "global_step_folder": folder})
    result["after"] = run(resumed)
    result["fit_lines"], result["save_lines"], result["load_lines"] = fit_lines, save_lines, load_lines
    result["sampler_lines"] = sampler_lines
    return result


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
    if mode == "trainer":
        with open(spec["out"], "wb") as f:
            pickle.dump(trainer(spec), f)
        return
    if mode in ("trainer_v1", "agent_loop"):
        # run as a script, so its own folder is on sys.path, not the repository root that holds ``tools``
        sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        if mode == "agent_loop":
            from tools.oracle.agent_loop import main as agent_loop

            agent_loop(spec)
            return
        from tools.oracle.trainer_v1 import trainer_v1

        with open(spec["out"], "wb") as f:
            pickle.dump(trainer_v1(spec), f)
        return

    # datasets forks a worker pool for verl's filter pass (num_proc >= 1); a child forked after the parent ran torch
    # ops on its intra-op thread pool deadlocks. One thread per process keeps the fork safe (results are the same).
    if mode in ("rows", "serve"):
        torch.set_num_threads(1)
        (_serve if mode == "serve" else _rows)(spec)
        return
    if mode != "bench":
        raise SystemExit(f"unknown mode {mode}")
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    if spec.get("stateful"):  # what verl's trainer iterates
        from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader
    else:
        from torch.utils.data import DataLoader
    _check_oracle_transformers()
    config = OmegaConf.create(spec.get("config") or {})
    started = time.perf_counter()
    tokenizer = _tokenizer(spec["tokenizer"])
    processor = _processor(spec.get("processor"))
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
        rows += len(next(iter(batch.values())))  # every key has one entry per row
    total = time.perf_counter() - started
    result = {"rows": rows, "seconds": total, "time_to_first_batch_s": first, "rows_per_s": rows / total}
    with open(spec["out"], "wb") as f:
        pickle.dump(result, f)


def _check_oracle_transformers() -> None:
    """The oracle's own transformers (4.57 for verl 0.5.0 / 0.6.1, 5.9 for 0.9.1, and for 0.7.1 and 0.8.0 from
    0.9.1's directory behind their own), not this environment's; and the oracle's own verl (not the 0.9.1 behind it)."""
    import transformers
    import verl

    if os.environ.get("INGEST_ORACLE_INSTALLED") == "1":  # the environment matrix: verl and transformers installed here
        assert not os.environ.get("INGEST_ORACLE_PATH"), os.environ["INGEST_ORACLE_PATH"]
        return
    # the oracle's directories, its own first (INGEST_ORACLE_PATH, set by oracle_environment), else PYTHONPATH's first
    oracle_dirs = [os.path.realpath(d) for d in os.environ.get("INGEST_ORACLE_PATH", "").split(os.pathsep) if d]
    oracle_dirs = oracle_dirs or [os.path.realpath(os.environ["PYTHONPATH"].split(os.pathsep)[0])]
    found = os.path.realpath(transformers.__file__)
    assert any(found.startswith(d + os.sep) for d in oracle_dirs), transformers.__file__
    assert os.path.realpath(verl.__file__).startswith(oracle_dirs[0] + os.sep), verl.__file__


def _random_datasets_fingerprints() -> None:
    """HF datasets names each ``filter`` / ``map`` result by hashing the function with dill, which for verl's filter
    pickles the whole tokenizer or processor: most of a parity run's time. The oracle's cache is fresh per request,
    so the name is never looked up: give each result the random name datasets itself uses for a transform it cannot
    hash. verl's code and its rows are untouched (not done for ``bench``, which times verl as users run it)."""
    import datasets.arrow_dataset
    import datasets.fingerprint

    def random_fingerprint(*args, **kwargs) -> str:
        return datasets.fingerprint.generate_random_fingerprint()

    datasets.fingerprint.update_fingerprint = random_fingerprint
    datasets.arrow_dataset.update_fingerprint = random_fingerprint


def _in_process_filter() -> dict:
    """The config that runs verl's filter in this process, not in a pool of one that datasets ships the tokenizer or
    processor to by pickling it (the same function on the same rows). Datasets from 4.1 or so pools even one
    process and reads ``num_proc`` 0 as none; older ones (4.0) run one in-process already and refuse 0."""
    import inspect

    import datasets.arrow_dataset

    zero_is_no_pool = "num_proc == 0" in inspect.getsource(datasets.arrow_dataset.Dataset.map)
    return {"filter_overlong_prompts_workers": 0} if zero_is_no_pool else {}


def _rows(spec: dict) -> None:
    """Every ``__getitem__`` row and the collated batches, one result per config in ``spec["configs"]``, pickled to
    ``spec["out"]``; tokenizer and processor loaded fresh for each request."""
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    _check_oracle_transformers()
    _random_datasets_fingerprints()
    tokenizer = _tokenizer(spec["tokenizer"])
    processor = _processor(spec.get("processor"))
    in_process_filter = _in_process_filter()
    runs = []
    for one in spec.get("configs", [spec["config"]]):
        try:
            one = {**in_process_filter, **one}
            # verl 0.8 and later take max_samples (the trainer's data.train_max_samples / val_max_samples)
            draw = {"max_samples": one.pop("max_samples")} if "max_samples" in one else {}
            dataset = RLHFDataset(list(spec["files"]), tokenizer, OmegaConf.create(one), processor, **draw)
            rows = [dataset[i] for i in range(len(dataset))]
        except Exception as exc:  # the oracle's own errors are part of the contract (truncation="error")
            runs.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        batch_size = spec.get("batch_size", 16)
        batches = [collate_fn(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
        runs.append({"rows": rows, "batches": batches})
    with open(spec["out"], "wb") as f:
        pickle.dump({"runs": runs}, f)


def _serve(spec: dict) -> None:
    """``rows`` requests (a JSON spec per line on fd ``spec["requests"]``), each answered by one JSON line on fd
    ``spec["responses"]``: ``{}`` once its result is written, ``{"error": traceback}`` if it failed. Each request
    gets a fresh HF datasets cache (a warm one would replay verl's overlong filter from disk)."""
    import traceback

    import datasets.config

    with os.fdopen(spec["requests"]) as requests, os.fdopen(spec["responses"], "w") as responses:
        for line in requests:
            request = json.loads(line)
            datasets.config.HF_DATASETS_CACHE = request.pop("hf_datasets_cache")
            try:
                _rows(request)
                answer = {}
            except Exception:
                answer = {"error": traceback.format_exc()}
            responses.write(json.dumps(answer) + "\n")
            responses.flush()


if __name__ == "__main__":
    main()
