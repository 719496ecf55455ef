"""The SFT pipeline against the renderers package itself, family by family: ``build_sft_dataset``'s rows (real local
Ray) equal renderers' own ``build_training_sample`` called in this process on the same conversations, shifted as the
rows are (inputs = ids[:-1], targets = ids[1:], the mask of the targets), in every field: ids, loss mask, token
types, placeholders, hashes, pixels and grids.

One case per family is in the fast tier; the full tier adds tool calls, thinking, multi-turn,
``content_sft_roles``, ``message_loss_mask``, ``ensure_final_stop`` and text-only samples through a VLM renderer."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from ingest.blocks import tensor_from_record
from ingest.sft import build_sft_dataset
from tests.support.conversations import TOOLS, encoded_image, inline_images, random_conversations
from tests.support.tiers import slow

renderers = pytest.importorskip("renderers")
from renderers import build_training_sample, create_renderer  # noqa: E402
from renderers.configs import (  # noqa: E402
    DefaultRendererConfig,
    Llama3RendererConfig,
    Qwen3RendererConfig,
    Qwen3VLRendererConfig,
    Qwen35RendererConfig,
)


def assistant_only(message) -> bool:
    return message["role"] == "assistant"


@pytest.fixture(scope="module")
def family_dirs(sft_family_dirs):
    return sft_family_dirs


# family -> (tokenizer directory, renderer config, build_training_sample's keyword arguments)
FAMILIES = {
    "qwen3": ("qwen3", Qwen3RendererConfig(), {}),
    "qwen3.5": ("qwen3", Qwen35RendererConfig(), {}),
    "qwen3-vl": ("qwen3-vl", Qwen3VLRendererConfig(), {}),
    "default-qwen2.5": ("qwen2.5", DefaultRendererConfig(), {"role_to_mask": assistant_only}),
    "default-qwen2-vl": ("qwen2-vl", DefaultRendererConfig(), {"role_to_mask": assistant_only}),
    "llama-3": ("llama-3", Llama3RendererConfig(), {}),
}


def thinking(conversations: list[list[dict]], seed: int) -> list[list[dict]]:
    """Some assistant turns carry ``reasoning_content``, as OpenAI-style thinking datasets hold it."""
    rng = random.Random(seed)
    for messages in conversations:
        for message in messages:
            if message["role"] == "assistant" and rng.random() < 0.3:
                message["reasoning_content"] = rng.choice(["Let me think.", "Step 1: add.\nStep 2: check."])
    return conversations


def write_rows(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def pipeline_rows(files, tokenizer, renderer, **kwargs) -> list[dict]:
    config = {"shuffle": False, "sft_max_length": None}
    ds = build_sft_dataset(files, tokenizer, config, renderer=renderer, **kwargs)
    return [row for batch in ds.iter_batches(batch_size=64, batch_format="pyarrow") for row in batch.to_pylist()]


def assert_row_is_renderers_sample(row: dict, sample) -> None:
    ids = sample.token_ids
    assert row["input_ids"] == ids[:-1]
    assert row["target_ids"] == ids[1:]
    assert row["loss_mask"] == [bool(m) for m in sample.loss_mask[1:]]
    assert row["seq_lens"] == [len(ids) - 1]
    types = sample.mm_token_type_ids
    assert row.get("mm_token_type_ids") == (None if types is None else types[:-1])
    mm = sample.multi_modal_data
    if mm is None:
        assert row.get("pixel_values") is None and not row.get("image_placeholders")
        return
    assert [(p["offset"], p["length"]) for p in row["image_placeholders"]] == [
        (p.offset, p.length) for p in mm.mm_placeholders["image"]
    ]
    assert row["image_hashes"] == mm.mm_hashes["image"]
    items = mm.mm_items["image"]
    np.testing.assert_array_equal(
        tensor_from_record(row["pixel_values"]), np.concatenate([it["pixel_values"] for it in items])
    )
    np.testing.assert_array_equal(
        tensor_from_record(row["image_grid_thw"]), np.concatenate([it["image_grid_thw"] for it in items])
    )


def check_family(tmp_path, family_dirs, family: str, rows: list[dict], **kwargs) -> None:
    """The pipeline's rows of ``rows`` (``messages`` as JSON strings, optional ``tools`` / ``images`` /
    ``message_loss_mask`` columns) against renderers called here on each conversation: a sample per conversation
    renderers renders, and a quarantine record with renderers' reason for each one it refuses."""
    from transformers import AutoTokenizer

    from ingest.stats import RunLedger

    directory, config, family_kwargs = FAMILIES[family]
    tokenizer_dir = family_dirs[directory]
    kwargs = {**family_kwargs, **kwargs}
    no_target = kwargs.pop("no_target", "drop")
    renderer = create_renderer(AutoTokenizer.from_pretrained(tokenizer_dir), config)
    expected, refused = [], {}
    for i, source in enumerate(rows):
        messages = inline_images(json.loads(source["messages"]), source.get("images"))
        tools = json.loads(source["tools"]) if source.get("tools") else None
        try:
            expected.append(
                build_training_sample(
                    renderer, messages, tools=tools, message_loss_mask=source.get("message_loss_mask"), **kwargs
                )
            )
        except ValueError as exc:  # renderers refuses it: the pipeline quarantines it with renderers' reason
            refused[i] = str(exc)
    ledger = RunLedger.remote()
    files = [write_rows(tmp_path / "conversations.parquet", rows)]
    got = pipeline_rows(files, tokenizer_dir, config, no_target=no_target, ledger=ledger, **kwargs)
    assert len(got) == len(expected) and len(expected) >= len(rows) // 3
    for row, sample in zip(got, expected, strict=True):
        assert_row_is_renderers_sample(row, sample)
    records = ray.get(ledger.quarantine.remote())
    assert {r["row"]: r["reason"] for r in records} == {i: f"renderers: ValueError: {m}" for i, m in refused.items()}


def text_rows(seed: int, n: int, *, with_tools: bool) -> list[dict]:
    rows = []
    for messages in thinking(random_conversations(seed, n, tools=with_tools), seed):
        row = {"messages": json.dumps(messages, ensure_ascii=False)}
        if with_tools:
            row["tools"] = json.dumps(TOOLS)
        rows.append(row)
    return rows


def image_rows(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        images = [encoded_image(rng, rng.choice(["png", "jpeg"])) for _ in range(1 + (i % 3 == 0))]
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"Describe picture {i}."}]
        messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": f"Picture {i} shows shapes."}]
        rows.append({"messages": json.dumps(messages), "images": images})
    if n > 2:  # a text-only sample through the VLM renderer: no media fields
        rows[1] = {"messages": json.dumps([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]),
                   "images": []}  # fmt: skip
    return rows


# --- one case per family (fast tier) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5", "default-qwen2.5", "default-qwen2-vl", "llama-3"])
def test_text_rows_equal_renderers_own_samples(ray_session, tmp_path, family_dirs, family):
    check_family(tmp_path, family_dirs, family, text_rows(7, 12, with_tools=False))


def test_qwen3_vl_image_rows_equal_renderers_own_samples(ray_session, tmp_path, family_dirs):
    check_family(tmp_path, family_dirs, "qwen3-vl", image_rows(3, 5))


# --- every case (full tier) ------------------------------------------------------------------------------------------


def every_case_rows(family: str) -> list[dict]:
    """Tool calls, thinking and multi-turn chats (several images in some, text-only ones, for Qwen3-VL), each with a
    ``message_loss_mask`` that leaves out some messages."""
    rows = image_rows(23, 12) if family == "qwen3-vl" else text_rows(11, 40, with_tools=True)
    rng = random.Random(17)
    for row in rows:
        row["message_loss_mask"] = [rng.random() < 0.7 for _ in json.loads(row["messages"])]
    return rows


@slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_case_equals_renderers(ray_session, tmp_path, family_dirs, family):
    """Every case of a family in one pipeline: renderers' keyword arguments (``content_sft_roles``,
    ``ensure_final_stop``) and a ``message_loss_mask`` column on tool calls, thinking, multi-turn and image chats;
    samples with no target left are kept to be compared."""
    kwargs = {"content_sft_roles": {"tool"}, "ensure_final_stop": True, "no_target": "keep"}
    check_family(tmp_path, family_dirs, family, every_case_rows(family), **kwargs)


@slow
def test_qwen3_template_is_what_the_qwen3_renderer_renders(family_dirs):
    """The offline Qwen3 tokenizer's chat template gives the ids renderers' hand-written Qwen3 renderer gives (the
    renderer is written to match the published template), on tool calls, thinking and multi-turn chats.

    Chats where a message starts with a newline are left out: there the renderer encodes the turn's header and the
    content apart, and BPE joins the two newlines differently than one pass over the template's text does (a
    renderers behaviour, which the pipeline keeps)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family_dirs["qwen3"])
    renderer = create_renderer(tokenizer, Qwen3RendererConfig())
    compared = 0
    for messages in random_conversations(29, 60, tools=True):
        if any(str(m.get("content") or "").startswith(("\n", " \n")) for m in messages):
            continue
        for tools in (TOOLS, None):
            ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=False)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            assert renderer.render_ids(messages, tools=tools) == ids
            compared += 1
    assert compared >= 40
