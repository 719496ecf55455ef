"""``python -m ingest bench sft``: SFT samples/s through ``build_sft_dataset`` vs what a prime-rl user runs today,
renderers' own ``build_training_sample`` in a loop in one process. One run per workload; each side a new process.

Workloads on the same generated Parquet: ``text`` (gsm8k-shaped multi-turn chats, renderers' Qwen3 renderer on the
offline Qwen3 tokenizer) and ``qwen3-vl`` (one or two images per chat, renderers' Qwen3-VL renderer, which decodes and
processes each image itself). Baseline: read the Parquet, load the tokenizer, create the renderer, then per
conversation ``build_training_sample`` and the causal shift to ``sft_max_length``; its first batch is its first
``BATCH_SIZE`` samples. Ours: ``build_sft_dataset`` + ``iter_torch_batches(collate_fn=SFTCollate())``, the clock
started at the process's start (cold: imports and ``ray.init`` on it) and, beside it, after ``ray.init``. Peak
memory: the largest PSS of the process and its descendants (Ray's workers included). After the clocks the first
``CHECKED`` samples of both sides are compared (inputs, targets, loss mask), and the sample and token counts.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PROCESS_START = time.perf_counter()  # a side's clock starts when its process imports this module
BENCH_CONFIG = {"shuffle": False, "sft_max_length": 4096}
BATCH_SIZE = 64
CHECKED = 2000

_SYSTEM = ["You are a careful math tutor.", "Answer briefly.", "You explain your reasoning step by step."]
_FOLLOW_UPS = ["Can you check that again?", "Why?", "And if she sold twice as many in June?", "Thanks! One more."]


def sft_rows(n: int, *, seed: int = 0, images: bool = False) -> list[dict]:
    """``n`` gsm8k-shaped conversations (``{"messages": [...]}``): an optional system prompt, 1-3 user / assistant
    turns, worked answers of a few sentences; with ``images``, the first user turn asks about one or two pictures
    (content parts, the encoded images in an ``images`` column)."""
    from ingest.demo import _question
    from tools.samples import encode_image, make_image

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": [{"type": "text", "text": rng.choice(_SYSTEM)}]})
        question, answer = _question(rng)
        pictures = []
        if images:
            pictures = [encode_image(*make_image(rng.choice(["png", "jpeg"]), rng)) for _ in range(rng.randint(1, 2))]
        for turn in range(rng.randint(1, 3)):
            text = question if turn == 0 else rng.choice(_FOLLOW_UPS)
            parts = [{"type": "image"} for _ in pictures] if turn == 0 else []
            messages.append({"role": "user", "content": [*parts, {"type": "text", "text": text}]})
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            steps = " ".join(
                f"Step {k + 1}: {a} * {b + k} = {a * (b + k)}, so we carry {a * (b + k) % 10}." for k in range(3)
            )
            answer_text = f"{steps}\nThe answer is {answer}.\n#### {answer}"
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answer_text}]})
        if not images:  # text chats hold plain string content
            messages = [{**m, "content": m["content"][-1]["text"]} for m in messages]
        rows.append({"messages": messages, **({"images": pictures} if images else {})})
    return rows


def write_sft_parquet(out_dir, n: int, *, num_files: int = 1, row_group_size: int = 1000, images: bool = False):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = sft_rows(n, images=images)
    schema = pa.Table.from_pylist(rows).schema
    per_file, paths = -(-n // num_files), []
    for k in range(num_files):
        path = out / f"sft-{k:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[k * per_file : (k + 1) * per_file], schema=schema), path,
                       row_group_size=row_group_size)  # fmt: skip
        paths.append(str(path))
    return paths


def _read_rows(files: list[str]) -> list[dict]:
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def _renderer_config(workload: str):
    from renderers.configs import Qwen3RendererConfig, Qwen3VLRendererConfig

    return Qwen3VLRendererConfig() if workload == "qwen3-vl" else Qwen3RendererConfig()


def run_baseline(files: list[str], model: str, workload: str, max_length: int) -> dict:
    """renderers' ``build_training_sample`` per conversation in this process (a prime-rl user's loop)."""
    from renderers import build_training_sample, create_renderer
    from transformers import AutoTokenizer

    from ingest.sft import shift_and_truncate
    from ingest.sft.engine import attach_media

    rows = _read_rows(files)
    renderer = create_renderer(AutoTokenizer.from_pretrained(model), _renderer_config(workload))
    samples, first = [], None
    for row in rows:
        messages = _plain(row["messages"])
        if row.get("images"):
            messages = attach_media(messages, {"image": row["images"]})
        seq = shift_and_truncate(build_training_sample(renderer, messages), max_length)
        samples.append((seq.inputs, seq.targets, seq.loss_mask))
        if first is None and len(samples) == BATCH_SIZE:
            first = time.perf_counter() - PROCESS_START
    seconds = time.perf_counter() - PROCESS_START
    return _result(len(samples), sum(len(s[0]) for s in samples), seconds, first, samples[:CHECKED])


def _plain(messages: list[dict]) -> list[dict]:
    from ingest.stages.sft import plain

    return plain(messages)


def run_pipeline(files: list[str], model: str, workload: str, config: dict) -> dict:
    from ingest.sft import SFTCollate, build_sft_dataset
    from tools.session import start_local_ray

    ray_init = start_local_ray()["ray_init_s"]
    after_init = time.perf_counter()
    ds = build_sft_dataset(files, model, config, renderer=_renderer_config(workload))
    first, samples, tokens, checked = None, 0, 0, []
    for batch in ds.iter_torch_batches(batch_size=BATCH_SIZE, collate_fn=SFTCollate()):
        if first is None:
            first = time.perf_counter() - PROCESS_START
        if samples < CHECKED:  # the ids of the first samples (references, no copy); not their pixels
            checked.append({k: batch[k] for k in ("input_ids", "target_ids", "loss_mask", "attention_mask")})
        samples += int((batch["seq_lens"] > 0).sum())
        tokens += int(batch["attention_mask"].sum())
    seconds = time.perf_counter() - PROCESS_START
    out = []
    for batch in checked:  # unpadded per-sample lists, after the clock
        for i, n in enumerate(batch["attention_mask"].sum(dim=1).tolist()):
            out.append(tuple(batch[k][i, :n].tolist() for k in ("input_ids", "target_ids", "loss_mask")))
    result = _result(samples, tokens, seconds, first, out[:CHECKED])
    result.update(ray_init_s=ray_init, warm_seconds=round(time.perf_counter() - after_init, 2))
    return result


def _result(samples: int, tokens: int, seconds: float, first: float | None, checked: list) -> dict:
    return {
        "samples": samples,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "time_to_first_batch_s": None if first is None else round(first, 2),
        "samples_per_s": round(samples / seconds, 1),
        "checked": checked,
    }


def run_side(side: str, files: list[str], model: str, workload: str, config: dict) -> dict:
    """One side in a new process; its peak PSS (with its Ray workers) read from outside."""
    from tools.verl09_bench import TreePss

    spec = json.dumps({"side": side, "files": files, "model": model, "workload": workload, "config": config})
    proc = subprocess.Popen(
        [sys.executable, "-m", __name__, spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RAY_ADDRESS": "local"},
    )  # fmt: skip
    pss = TreePss(proc.pid)
    pss.start()
    out, err = proc.communicate(timeout=7200)
    peak = pss.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"the {side} side failed ({proc.returncode}):\n{err[-4000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_pss_mib": peak}


def bench_sft(rows=(20_000,), work_dir: str | None = None, workloads=("text",), config: dict | None = None) -> dict:
    from tools.session import cache_dir, cached_files, machine
    from tools.sft_tokenizers import qwen3_vl_sft_dir, qwen_tokenizer_dir

    work = cache_dir(work_dir)
    models = {
        "text": qwen_tokenizer_dir(work / "qwen3-tokenizer", "qwen3"),
        "qwen3-vl": qwen3_vl_sft_dir(work / "qwen3-vl-processor"),
    }
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    cfg = {**BENCH_CONFIG, **(config or {})}
    for workload in workloads:
        for n in rows:
            images = workload == "qwen3-vl"
            files = cached_files(
                work, f"sft-{workload}-{n}",
                lambda out, n=n, images=images: write_sft_parquet(out, n, num_files=max(1, n // 50_000), images=images),
            )  # fmt: skip
            baseline = run_side("baseline", files, models[workload], workload, cfg)
            ours = run_side("pipeline", files, models[workload], workload, cfg)
            same = (ours.pop("checked"), ours["samples"], ours["tokens"]) == (
                baseline.pop("checked"), baseline["samples"], baseline["tokens"],
            )  # fmt: skip
            entry = {
                "workload": workload,
                "rows": n,
                "baseline_renderers_loop": baseline,
                "pipeline": ours,
                "ratio_samples_per_s": round(ours["samples_per_s"] / baseline["samples_per_s"], 2),
                "first_batch_behind_baseline_s": round(
                    ours["time_to_first_batch_s"] - baseline["time_to_first_batch_s"], 2
                ),
                "same_samples": same,
            }
            result["runs"].append(entry)
            print(json.dumps(entry), flush=True)
            if not same:
                raise AssertionError(f"{workload} {n}: the pipeline and renderers' loop disagree on some sample")
    return result


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    if args["side"] == "baseline":
        measured = run_baseline(args["files"], args["model"], args["workload"], args["config"]["sft_max_length"])
    else:
        measured = run_pipeline(args["files"], args["model"], args["workload"], args["config"])
    print(json.dumps(measured))
