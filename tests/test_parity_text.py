"""Parity with verl 0.5.0 itself: same keys, dtypes, shapes, values, row count and order, batch by batch."""

from __future__ import annotations

import pytest

from ingest import BadRowError, build_dataset
from ingest.errors import find_ingest_error
from tests.support.batches import collect
from tests.support.compare import assert_same_batches
from tests.support.tiers import first_fast
from tools.oracle import oracle_available, run_verl

pytestmark = pytest.mark.skipif(not oracle_available(), reason="verl 0.5.0 oracle not installed (make oracle)")

# Every truncation mode with the filter on and off (error + filter off raises: tested below), raw chat / full prompt
CONFIGS = [
    {"truncation": "left", "filter_overlong_prompts": True, "return_raw_chat": True},
    {"truncation": "left", "filter_overlong_prompts": False, "return_full_prompt": True},
    {"truncation": "right", "filter_overlong_prompts": True, "return_full_prompt": True},
    {"truncation": "right", "filter_overlong_prompts": False, "return_raw_chat": True},
    {"truncation": "middle", "filter_overlong_prompts": True},
    {"truncation": "middle", "filter_overlong_prompts": False, "return_raw_chat": True, "return_full_prompt": True},
    {"truncation": "error", "filter_overlong_prompts": True, "return_raw_chat": True, "max_prompt_length": 512},
    {"truncation": "middle", "filter_overlong_prompts": False, "max_prompt_length": 97},
]
BATCH = 16


@pytest.fixture(scope="module")
def oracle_runs(variety_files, model_dir, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("verl-cache"))
    configs = [{**c, "cache_dir": cache} for c in CONFIGS + [{"truncation": "error", "filter_overlong_prompts": False}]]
    return run_verl("rows", variety_files, model_dir, None, configs=configs, batch_size=BATCH)["runs"]


@pytest.mark.parametrize("index", first_fast(range(len(CONFIGS)), ids=[str(c) for c in CONFIGS], matrix=True))
def test_rows_equal_verl(ray_session, variety_files, model_dir, oracle_runs, index):
    expected = oracle_runs[index]
    assert "error" not in expected, expected.get("error")
    ds = build_dataset(variety_files, model_dir, {**CONFIGS[index], "shuffle": False})
    assert_same_batches(collect(ds, BATCH), expected["batches"])


def test_data_has_what_the_contract_lists(oracle_runs):
    rows = oracle_runs[1]["rows"]  # filter off: every row
    assert len(rows) == 210
    contents = [m["content"] for r in rows for m in r["raw_prompt"]] if "raw_prompt" in rows[0] else []
    assert any(r["tools_kwargs"] for r in rows) and any(r["interaction_kwargs"] for r in rows)
    assert any(r["tools_kwargs"] is None for r in rows), "rows missing extra_info fields"
    assert any(r["attention_mask"].sum() == 1024 for r in rows), "no overlong (truncated) row"
    assert len(oracle_runs[0]["rows"]) < 210, "filter dropped nothing"
    assert contents == [] or any("Привет" in c or "日本語" in c for c in contents)


def test_truncation_error_raises_like_verl(ray_session, variety_files, model_dir, oracle_runs):
    assert "error" in oracle_runs[-1], "verl should raise on an overlong prompt with truncation=error"
    ds = build_dataset(variety_files, model_dir, {"truncation": "error", "filter_overlong_prompts": False})
    with pytest.raises(BadRowError) as info:
        collect(ds)
    message = str(find_ingest_error(info.value))
    assert "truncation='error'" in message and "train-0000" in message and "row " in message
    assert "column 'prompt'" in message
