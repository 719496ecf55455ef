"""The embedded demo dataset: gsm8k-shaped prompt Parquet files (verl's ``examples/data_preprocess/gsm8k.py`` layout).

Deterministic for a seed. ``variety=True`` mixes in what the parity tests need: system prompts, multi-turn chats,
unicode, overlong prompts, an extra column, rows missing ``extra_info`` fields, ``tools_kwargs`` and
``interaction_kwargs`` on some rows.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DEFAULT_SAMPLE_ROWS = 20_000  # rows of the embedded demo dataset (`python -m ingest run` without files)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Mark", "Ken", "Alexis", "Tina", "Zoë", "Øyvind"]
ITEMS = ["clips", "apples", "pages", "dollars", "cookies", "marbles", "tickets", "books", "eggs", "shells"]
UNICODE_BITS = [
    "日本語の問題です。",
    "Ça coûte 5 €.",
    "Привет, мир!",
    "🙂🚀",
    "naïve café",
    "ß ∑ ∫ √2",
    "עברית",
    "हिन्दी",
]


def _question(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    question = (
        f"{name} sold {item} to {a} of her friends in April, and then she sold {b} times as many {item} in May. "
        f"How many {item} did {name} sell altogether in April and May?"
    )
    return question, str(a + a * b)


def gsm8k_rows(n: int, *, seed: int = 0, start_index: int = 0, variety: bool = False, long_every: int = 0) -> list:
    """``n`` gsm8k-shaped rows as Python dicts. ``long_every=k`` makes every k-th prompt overlong (> 1024 tokens)."""
    rng = random.Random(seed * 1_000_003 + start_index)
    rows = []
    for i in range(start_index, start_index + n):
        question, answer = _question(rng)
        content = f"{question} {INSTRUCTION}"
        if long_every and i % long_every == long_every - 1:
            content = " ".join([question] * rng.randint(30, 60)) + " " + INSTRUCTION
        extra_info: dict = {"split": "train", "index": i, "answer": f"#### {answer}", "question": question}
        messages = [{"role": "user", "content": content}]
        row: dict = {"data_source": "openai/gsm8k", "prompt": messages, "ability": "math"}
        if variety:
            kind = i % 7
            if kind == 1:
                messages.insert(0, {"role": "system", "content": "You are a careful math tutor."})
            elif kind == 2:
                messages[:0] = [
                    {"role": "user", "content": "Hi!"},
                    {"role": "assistant", "content": "Hello. What problem shall we solve?"},
                ]
            elif kind == 3:
                messages[-1]["content"] = f"{rng.choice(UNICODE_BITS)} {content} {rng.choice(UNICODE_BITS)}"
            elif kind == 4:
                del extra_info["answer"], extra_info["question"]
            elif kind == 5:
                extra_info["tools_kwargs"] = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}}
                extra_info["need_tools_kwargs"] = True
            elif kind == 6:
                extra_info["interaction_kwargs"] = {"name": "gsm8k", "query": question, "ground_truth": answer}
            row["difficulty"] = float(i % 5)
        row["reward_model"] = {"style": "rule", "ground_truth": answer}
        row["extra_info"] = extra_info
        rows.append(row)
    return rows


def write_gsm8k_parquet(
    out_dir: str | os.PathLike,
    num_rows: int,
    *,
    num_files: int = 1,
    row_group_size: int = 1000,
    seed: int = 0,
    variety: bool = False,
    long_every: int = 0,
    prefix: str = "train",
) -> list[str]:
    """Write ``num_rows`` rows over ``num_files`` files; returns the file paths in order.

    All files share one schema (taken from the union of every row's fields) so verl's ``concatenate_datasets`` and
    ``pa.unify_schemas`` agree on it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_file = [num_rows // num_files + (1 if k < num_rows % num_files else 0) for k in range(num_files)]
    all_rows = gsm8k_rows(num_rows, seed=seed, variety=variety, long_every=long_every)
    schema = pa.Table.from_pylist(all_rows).schema
    paths, start = [], 0
    for k, count in enumerate(per_file):
        table = pa.Table.from_pylist(all_rows[start : start + count], schema=schema)
        path = out / f"{prefix}-{k:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(str(path))
        start += count
    return paths


def default_sample_dir() -> Path:
    from ingest.tokenizer.offline import default_model_dir

    return default_model_dir().parent / "sample" / f"gsm8k-{DEFAULT_SAMPLE_ROWS}"


def ensure_sample(out_dir: Path | None = None, rows: int = DEFAULT_SAMPLE_ROWS, **kwargs) -> list[str]:
    """The embedded sample dataset (gsm8k-shaped, 1% overlong prompts), generated once."""
    out = Path(out_dir) if out_dir else default_sample_dir()
    existing = sorted(str(p) for p in out.glob("*.parquet"))
    if existing:
        return existing
    kwargs.setdefault("num_files", 4)
    kwargs.setdefault("long_every", 100)
    return write_gsm8k_parquet(out, rows, **kwargs)
