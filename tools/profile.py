"""``python -m ingest bench profile``: where a text row's CPU time goes, stage by stage, in one process (no Ray);
``--images``: the same for an image row (``bench mm``'s geo3k rows, Qwen2-VL processor, the one-pool stages).

The pipeline's steady state spends its cores on the read (Parquet -> Arrow, in the tokenizer actors), the tokenize
stage (prompts to Python, template render, batch encode on one thread, the filter, Arrow out) and the collate (in the
consumer); whatever its measured steady rows/s leaves beyond these is Ray's (object store puts and gets, scheduling,
the iterator, Ray's own processes). Each step runs alone over the same rows (``bench text``'s gsm8k files), one core.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tools.bench import BATCH_SIZE, BENCH_CONFIG, gsm8k_files
from tools.session import cache_dir, machine


def bench_profile(rows: int = 200_000, work_dir: str | None = None) -> dict:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per step, as a tokenizer actor has
    from ingest.blocks import FILE_COLUMN, ROW_COLUMN
    from ingest.config import DataConfig, StageContext
    from ingest.rowformat.collate import VerlCollate
    from ingest.stages.prompt import prompt_stage
    from ingest.tokenizer.chat import ChatTokenizer
    from ingest.tokenizer.offline import build_offline_model_dir

    files = [str(f) for f in gsm8k_files(cache_dir(work_dir), rows)]
    model = str(build_offline_model_dir())
    seconds: dict[str, float] = {}

    def timed(name: str, step):
        started = time.perf_counter()
        out = step()
        seconds[name] = time.perf_counter() - started
        return out

    table = pa.concat_tables(timed("read", lambda: [pq.read_table(f) for f in files]))
    n = table.num_rows
    prompts = timed("prompts_to_python", lambda: table.column("prompt").to_pylist())
    chat = ChatTokenizer(model)
    texts = timed("render", lambda: [chat.render(m) for m in prompts])

    def each_batch(step, rows: int) -> None:  # results dropped as made: kept, their garbage collection would count
        for start in range(0, rows, BATCH_SIZE):
            step(start)

    timed("encode", lambda: each_batch(lambda s: chat.encode_batch(texts[s : s + BATCH_SIZE]), n))
    provenance = {FILE_COLUMN: pa.array(np.zeros(n, np.int32)), ROW_COLUMN: pa.array(np.arange(n))}
    for name, column in provenance.items():
        table = table.append_column(name, column)
    stage = prompt_stage(DataConfig.from_any(BENCH_CONFIG), StageContext(files=tuple(files)), model, None)
    blocks = timed("tokenize_stage", lambda: [stage(table.slice(s, BATCH_SIZE)).table for s in range(0, n, BATCH_SIZE)])
    out, collate = pa.concat_tables(blocks), VerlCollate()
    timed("collate", lambda: each_batch(lambda s: collate(out.slice(s, BATCH_SIZE)), out.num_rows))
    return {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": n,
        "note": "tokenize_stage includes prompts_to_python, render and encode; one core each",
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "us_per_row": {k: round(v / n * 1e6, 1) for k, v in seconds.items()},
    }


def bench_profile_images(rows: int = 1000, work_dir: str | None = None) -> dict:
    """An image row's CPU time per step, one core, no Ray: read, the prompt stage (chat template, ids, each image's
    grid from its header), decode, vision (resize + patches) and the collate (``pixel_values`` normalized, PIL
    images for ``multi_modal_data``), each over the same ``bench mm`` rows."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from ingest.blocks import FILE_COLUMN, ROW_COLUMN
    from ingest.config import DataConfig, StageContext
    from ingest.rowformat.collate import VerlCollate
    from ingest.stages.decode import DecodeStage
    from ingest.stages.prompt import prompt_stage
    from ingest.stages.vision import VisionStage
    from ingest.tokenizer.offline import build_offline_model_dir
    from tools.bench import geo3k_files

    files = [str(f) for f in geo3k_files(cache_dir(work_dir), rows)]
    model = str(build_offline_model_dir())
    one_pool = {"truncation": "left", "decode_pool_max_size": 0, "vision_pool_max_size": 0}
    config = DataConfig.from_any({**BENCH_CONFIG, **one_pool})
    context = StageContext(files=tuple(files))
    seconds: dict[str, float] = {}

    def timed(name: str, step):
        started = time.perf_counter()
        out = step()
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started
        return out

    table = pa.concat_tables(timed("read", lambda: [pq.read_table(f) for f in files]))
    n = table.num_rows
    table = table.append_column(FILE_COLUMN, pa.array(np.zeros(n, np.int32)))
    table = table.append_column(ROW_COLUMN, pa.array(np.arange(n)))
    prompt, decode = prompt_stage(config, context, model, model), DecodeStage(config, context)
    vision, collate = VisionStage(model, config, context), VerlCollate()
    blocks = []
    for start in range(0, n, BATCH_SIZE):
        block = timed("prompt_stage", lambda s=start: prompt(table.slice(s, BATCH_SIZE)).table)
        block = timed("decode", lambda b=block: decode(b).table)
        blocks.append(timed("vision", lambda b=block: vision.process(b).table))
    for block in blocks:
        timed("collate", lambda b=block: collate(b))
    return {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": n,
        "images": sum(len(x or []) for x in table.column("images").to_pylist()),
        "note": "one core per step; collate: pixel_values normalized and PIL images built in the consumer",
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "ms_per_row": {k: round(v / n * 1e3, 3) for k, v in seconds.items()},
    }
