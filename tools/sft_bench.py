"""``python -m ingest bench sft``: SFT samples/s through ``build_sft_dataset`` vs a plain per-sample loop, one run.

Same generated Parquet (gsm8k-shaped multi-turn chats), same tokenizer (the offline Qwen2-VL one), same sequence
limit. Baseline: what a training script without this pipeline does: read the Parquet, then per sample
``AutoTokenizer.apply_chat_template(tokenize=True)`` for the ids and, per assistant turn, two prefix renders
(``messages[:k]`` with the generation prompt, ``messages[:k+1]``) to find where the turn's body starts and ends,
then the causal shift. Ours: ``build_sft_dataset`` + ``iter_torch_batches(collate_fn=SFTCollate())`` on a local Ray
started before the clock (as ``bench text``); also ``build_training_sample`` in a plain loop in one process (no
Ray), for the per-core figure. Both clocks include loading the tokenizer. The outputs are compared after the clocks
stop: every sample's inputs, targets and loss mask must be equal.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

BENCH_CONFIG = {"shuffle": False, "sft_max_length": 4096}
BATCH_SIZE = 64

_SYSTEM = ["You are a careful math tutor.", "Answer briefly.", "You explain your reasoning step by step."]
_FOLLOW_UPS = ["Can you check that again?", "Why?", "And if she sold twice as many in June?", "Thanks! One more."]


def sft_rows(n: int, *, seed: int = 0) -> list[dict]:
    """``n`` gsm8k-shaped conversations (``{"messages": [...]}``): an optional system prompt, 1-3 user / assistant
    turns, worked answers of a few sentences."""
    from ingest.demo import _question

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM)})
        question, answer = _question(rng)
        for turn in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": question if turn == 0 else rng.choice(_FOLLOW_UPS)})
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            steps = " ".join(
                f"Step {k + 1}: {a} * {b + k} = {a * (b + k)}, so we carry {a * (b + k) % 10}." for k in range(3)
            )
            messages.append({"role": "assistant", "content": f"{steps}\nThe answer is {answer}.\n#### {answer}"})
        rows.append({"messages": messages})
    return rows


def write_sft_parquet(out_dir, n: int, *, num_files: int = 1, row_group_size: int = 1000, seed: int = 0) -> list:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(str(p) for p in out.glob("*.parquet"))
    if existing:
        return existing
    rows = sft_rows(n, seed=seed)
    schema = pa.Table.from_pylist(rows).schema
    per_file, paths = -(-n // num_files), []
    for k in range(num_files):
        path = out / f"sft-{k:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[k * per_file : (k + 1) * per_file], schema=schema), path,
                       row_group_size=row_group_size)  # fmt: skip
        paths.append(str(path))
    return paths


def _read_conversations(files: list[str]) -> list[list[dict]]:
    return [row["messages"] for f in files for row in pq.read_table(f).to_pylist()]


def _ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def baseline_sample(tokenizer, messages: list[dict], max_length: int) -> tuple[list, list, list]:
    """The plain loop's sample: ids from apply_chat_template, the mask from prefix renders, the causal shift."""
    ids = _ids(tokenizer, messages, False)
    mask = [False] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_ids(tokenizer, messages[:k], True))  # after "<|im_start|>assistant\n"
        end = len(_ids(tokenizer, messages[: k + 1], False)) - 1  # up to <|im_end|>, not the newline after it
        mask[start:end] = [True] * (end - start)
    cut = min(len(ids) - 1, max_length)
    return ids[:cut], ids[1 : cut + 1], mask[1 : cut + 1]


def run_baseline(files: list[str], model: str, max_length: int) -> tuple[dict, list]:
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = [baseline_sample(tokenizer, m, max_length) for m in _read_conversations(files)]
    seconds = time.perf_counter() - started
    return {"samples": len(samples), "seconds": seconds, "samples_per_s": len(samples) / seconds}, samples


def run_ours_loop(files: list[str], model: str, max_length: int) -> tuple[dict, list]:
    from ingest.sft import build_training_sample, create_renderer, shift_and_truncate

    started = time.perf_counter()
    renderer = create_renderer(model)
    samples = []
    for messages in _read_conversations(files):
        seq = shift_and_truncate(build_training_sample(renderer, messages), max_length)
        samples.append((seq.inputs, seq.targets, seq.loss_mask))
    seconds = time.perf_counter() - started
    return {"samples": len(samples), "seconds": seconds, "samples_per_s": len(samples) / seconds}, samples


def run_pipeline(files: list[str], model: str, config: dict) -> tuple[dict, list]:
    from ingest.sft import SFTCollate, build_sft_dataset

    started = time.perf_counter()
    ds = build_sft_dataset(files, model, config)
    first, samples, tokens, batches = None, 0, 0, []
    for batch in ds.iter_torch_batches(batch_size=BATCH_SIZE, collate_fn=SFTCollate()):
        if first is None:
            first = time.perf_counter() - started
        samples += int((batch["seq_lens"] > 0).sum())
        tokens += int(batch["attention_mask"].sum())
        batches.append(batch)
    seconds = time.perf_counter() - started
    out = []
    for batch in batches:  # unpadded per-sample lists, after the clock
        for i, n in enumerate(batch["attention_mask"].sum(dim=1).tolist()):
            out.append(tuple(batch[k][i, :n].tolist() for k in ("input_ids", "target_ids", "loss_mask")))
    result = {
        "samples": samples,
        "tokens": tokens,
        "seconds": seconds,
        "time_to_first_batch_s": first,
        "samples_per_s": samples / seconds,
        "tokens_per_s": tokens / seconds,
    }
    return result, out


def bench_sft(rows=(20_000,), work_dir: str | None = None, config: dict | None = None) -> dict:
    import ray
    import torch  # noqa: F401  (a trainer has torch loaded)

    from ingest.tokenizer.offline import build_offline_model_dir
    from tools.session import cache_dir, cached_files, start_local_ray

    model = str(build_offline_model_dir())
    work = cache_dir(work_dir)
    result = {**start_local_ray(), "sizes": []}
    cfg = {**BENCH_CONFIG, **(config or {})}
    for n in rows:
        files = cached_files(
            work, f"sft-{n}", lambda out, n=n: write_sft_parquet(out, n, num_files=max(1, n // 50_000))
        )
        ours, ours_samples = run_pipeline(files, model, cfg)
        loop, loop_samples = run_ours_loop(files, model, cfg["sft_max_length"])
        baseline, baseline_samples = run_baseline(files, model, cfg["sft_max_length"])
        same = ours_samples == loop_samples == baseline_samples
        entry = {
            "rows": n,
            "ours": ours,
            "ours_one_process_no_ray": loop,
            "baseline_prefix_loop": baseline,
            "ratio_samples_per_s": round(ours["samples_per_s"] / baseline["samples_per_s"], 2),
            "same_samples": same,
        }
        result["sizes"].append(entry)
        print(entry, flush=True)
        if not same:
            raise AssertionError("the pipeline, the plain renderer loop and the baseline disagree on some sample")
    ray.shutdown()
    return result
