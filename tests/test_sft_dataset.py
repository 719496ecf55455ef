"""The Ray Data SFT mode (``build_sft_dataset``): rows equal renderers' own ``build_training_sample`` +
``shift_and_truncate`` called directly; prompt + completion input; images through renderers' Qwen3-VL renderer;
truncation at placeholder runs; packing; quarantine / strict; ledger counts; ``SFTCollate`` and ``PrimeRLCollate``.
Real local Ray (the session fixture), small data; the renderers are Qwen3's and Qwen3-VL's on offline tokenizers
(``tools.sft_tokenizers``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ingest import BadRowError, SourceError
from ingest.blocks import tensor_from_record
from ingest.rowformat.messages import split_media_placeholders
from ingest.sft import PrimeRLCollate, SFTCollate, build_sft_dataset, shift_and_truncate
from ingest.stats import RunLedger, RunSummary
from tests.support.conversations import (
    IM_END,
    IMAGE_PAD,
    TOOLS,
    encoded_image,
    inline_images,
    random_conversations,
    random_text,
)
from tests.support.tiers import slow

renderers = pytest.importorskip("renderers")
from renderers import build_training_sample, create_renderer  # noqa: E402
from renderers.configs import Qwen3RendererConfig, Qwen3VLRendererConfig  # noqa: E402

BASE = {"shuffle": False}


def _write(path, rows, schema=None, row_group_size=None) -> str:
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def _rows(ds) -> list[dict]:
    return [row for batch in ds.iter_batches(batch_size=64, batch_format="pyarrow") for row in batch.to_pylist()]


def _sample(renderer, messages, images=None, **kwargs):
    return build_training_sample(renderer, inline_images(messages, images), **kwargs)


def _direct(renderer, messages, max_length=4096, images=None, **kwargs):
    return shift_and_truncate(_sample(renderer, messages, images, **kwargs), max_length)


def _assert_row_equals(row: dict, seq) -> None:
    assert row["input_ids"] == seq.inputs
    assert row["target_ids"] == seq.targets
    assert row["loss_mask"] == seq.loss_mask
    assert row["seq_lens"] == seq.seq_lens
    if "mm_token_type_ids" in row:
        assert row["mm_token_type_ids"] == seq.mm_token_type_ids


@pytest.fixture(scope="module")
def qwen3_dir(sft_family_dirs):
    return sft_family_dirs["qwen3"]


@pytest.fixture(scope="module")
def vl_dir(sft_family_dirs):
    return sft_family_dirs["qwen3-vl"]


@pytest.fixture(scope="module")
def text_ds(qwen3_dir):
    """``build_sft_dataset`` as a Qwen3 user calls it: the tokenizer directory and renderers' Qwen3 config."""
    return functools.partial(_build, qwen3_dir, Qwen3RendererConfig())


@pytest.fixture(scope="module")
def vl_ds(vl_dir):
    """``build_sft_dataset`` with the Qwen3-VL processor directory and renderers' Qwen3-VL config."""
    return functools.partial(_build, vl_dir, Qwen3VLRendererConfig())


def _build(model, renderer, files, config=None, **kwargs):
    return build_sft_dataset(files, model, BASE if config is None else config, renderer=renderer, **kwargs)


@pytest.fixture(scope="module")
def text_renderer(qwen3_dir):
    from transformers import AutoTokenizer

    return create_renderer(AutoTokenizer.from_pretrained(qwen3_dir), Qwen3RendererConfig())


@pytest.fixture(scope="module")
def vl_renderer(vl_dir):
    from transformers import AutoTokenizer

    return create_renderer(AutoTokenizer.from_pretrained(vl_dir), Qwen3VLRendererConfig())


@pytest.fixture(scope="module")
def text_conversations():
    return random_conversations(11, 80, tools=True)  # system / multi-turn / tool calls and responses / unicode


@pytest.fixture(scope="module")
def text_files(tmp_path_factory, text_conversations):
    out = tmp_path_factory.mktemp("sft-text")
    rows = [{"messages": m} for m in text_conversations]
    schema = pa.Table.from_pylist(rows).schema
    return [
        _write(out / "a.parquet", rows[:50], schema, row_group_size=16),
        _write(out / "b.parquet", rows[50:], schema, row_group_size=16),
    ]


# --- text ------------------------------------------------------------------------------------------------------------


def test_text_rows_equal_renderers_samples(ray_session, text_ds, text_files, text_conversations, text_renderer):
    ledger = RunLedger.remote()
    config = {**BASE, "read_rows_per_task": 20, "tokenizer_batch_size": 7}
    rows = _rows(text_ds(text_files, config, ledger=ledger))
    assert len(rows) == len(text_conversations)
    assert set(rows[0]) == {"input_ids", "target_ids", "loss_mask", "seq_lens"}  # text: no media columns
    tools_seen = 0
    for row, messages in zip(rows, text_conversations, strict=True):
        _assert_row_equals(row, _direct(text_renderer, messages))
        # renderers' sampled mask: each assistant turn up to and including its <|im_end|>
        trained = [t for t, m in zip(row["target_ids"], row["loss_mask"], strict=True) if m]
        assert trained.count(IM_END) == sum(m["role"] == "assistant" for m in messages) and trained[-1] == IM_END
        tools_seen += any(m["role"] == "tool" for m in messages)
    assert tools_seen > 10
    counts = ray_session.get(ledger.get.remote())
    assert counts["rows_in"] == counts["rows_out"] == len(rows)
    assert counts["quarantined"] == counts["filtered_overlong"] == 0
    assert counts["prompt_tokens"] == sum(len(r["input_ids"]) for r in rows)


def test_prompt_completion_and_json_columns(ray_session, text_ds, tmp_path, text_renderer):
    conversations = random_conversations(5, 12, tools=False)
    split = [max(i for i, m in enumerate(c) if m["role"] == "user") for c in conversations]  # prompt: up to last user
    lists = [{"prompt": c[: k + 1], "completion": c[k + 1 :]} for c, k in zip(conversations, split, strict=True)]
    strings = [
        {"prompt": f"Question {i}: {random_text(random.Random(i))}", "completion": f"Answer {i}."} for i in range(5)
    ]
    as_json = [{"messages": json.dumps(c, ensure_ascii=False)} for c in conversations]
    files = [_write(tmp_path / "lists.parquet", lists), _write(tmp_path / "strings.parquet", strings)]
    json_file = _write(tmp_path / "json.parquet", as_json)
    got_lists = _rows(text_ds(files[0]))
    got_strings = _rows(text_ds(files[1]))
    got_json = _rows(text_ds(json_file))
    for row, row_json, messages in zip(got_lists, got_json, conversations, strict=True):
        _assert_row_equals(row, _direct(text_renderer, messages))  # messages = prompt + completion
        assert row_json == row
    for row, source in zip(got_strings, strings, strict=True):
        messages = [
            {"role": "user", "content": source["prompt"]},
            {"role": "assistant", "content": source["completion"]},
        ]
        _assert_row_equals(row, _direct(text_renderer, messages))


def test_packing_seq_lens_and_collate(ray_session, text_ds, text_files, text_conversations, text_renderer):
    lengths = [len(build_training_sample(text_renderer, m).token_ids) - 1 for m in text_conversations]
    budget = int(np.percentile(lengths, 80))  # some samples are cut at the budget, most are packed whole
    config = {**BASE, "sft_pack_token_budget": budget, "tokenizer_batch_size": 16, "read_rows_per_task": 16}
    table = pa.concat_tables(text_ds(text_files, config).iter_batches(batch_size=64, batch_format="pyarrow"))
    packed = table.to_pylist()
    singles = [_direct(text_renderer, m, max_length=budget) for m in text_conversations]
    assert len(packed) < len(singles)
    assert sum(len(r["seq_lens"]) for r in packed) == len(singles)
    members = []
    for row in packed:
        assert sum(row["seq_lens"]) == len(row["input_ids"]) <= budget
        start = 0
        for length in row["seq_lens"]:
            members.append({k: row[k][start : start + length] for k in ("input_ids", "target_ids", "loss_mask")})
            start += length
    for member, seq in zip(members, singles, strict=True):  # in order, nothing lost, each sample whole
        assert member == {"input_ids": seq.inputs, "target_ids": seq.targets, "loss_mask": seq.loss_mask}
    assert any(len(s.inputs) == budget for s in singles)  # some samples were cut at the budget

    # the collate on the same rows (iter_torch_batches hands it Arrow batches: test_prime_rl_collate... runs that)
    batch, rows = SFTCollate(pad_token_id=-1, pad_to=budget)(table.slice(0, 4)), packed[:4]
    assert batch["input_ids"].shape == (4, budget) and batch["loss_mask"].dtype == torch.bool
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == row["input_ids"]
        assert set(batch["input_ids"][i, n:].tolist()) <= {-1}
        assert batch["target_ids"][i, :n].tolist() == row["target_ids"]
        assert set(batch["target_ids"][i, n:].tolist()) <= {-100}
        assert batch["loss_mask"][i, :n].tolist() == row["loss_mask"] and not batch["loss_mask"][i, n:].any()
        assert batch["attention_mask"][i].sum() == n
        positions = [p for length in row["seq_lens"] for p in range(length)]
        assert batch["position_ids"][i, :n].tolist() == positions
        assert batch["seq_lens"][i, : len(row["seq_lens"])].tolist() == row["seq_lens"]
    plain = SFTCollate()(table.slice(0, 3))
    assert plain["input_ids"].shape[1] == max(len(r["input_ids"]) for r in packed[:3])  # padded to the batch max


# --- bad conversations ---------------------------------------------------------------------------------------------


def _bad_rows(image: bytes) -> tuple[list[dict], dict[int, str]]:
    good = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c1", "function": {}}]}
    rows = [
        (good, None),
        ([], None),  # empty
        ([{"role": "user", "content": "Hi"}], None),  # no assistant turn
        ([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}, good[1]], None),  # tool, no call
        ([good[0], call, {"role": "tool", "content": "1", "tool_call_id": "zz"}, good[1]], None),  # wrong call id
        (good, [image]),  # an image but no image part
        ("hello", None),  # a JSON string, not a list
        ({"role": "user"}, None),  # a dict, not a list
        (good, None),
    ]
    bad = {
        1: "empty",
        2: "no assistant",
        3: "answers no open tool call",
        4: "zz",
        5: "image parts",
        6: "str",
        7: "dict",
    }
    out = [
        {"messages": json.dumps(m), "images": None if imgs is None else [{"bytes": b, "path": None} for b in imgs]}
        for m, imgs in rows
    ]
    out.append({"messages": "not json at all", "images": None})
    out.append({"messages": None, "images": None})
    bad.update({9: "not JSON", 10: "NoneType"})
    return out, bad


def test_bad_conversations_quarantine_strict_and_counts(ray_session, vl_ds, tmp_path):
    rows, bad = _bad_rows(encoded_image(random.Random(3), "png"))
    path = _write(tmp_path / "bad.parquet", rows)
    ledger = RunLedger.remote()
    out = _rows(vl_ds(path, ledger=ledger))
    assert len(out) == len(rows) - len(bad) == 2
    counts = ray_session.get(ledger.get.remote())
    assert counts["rows_in"] == len(rows)
    assert counts["rows_in"] == counts["rows_out"] + counts["filtered_overlong"] + counts["quarantined"]
    assert counts["quarantined"] == len(bad)
    records = ray_session.get(ledger.quarantine.remote())
    assert [r["row"] for r in records] == sorted(bad)
    for record in records:
        assert record["file"] == path
        assert bad[record["row"]] in record["reason"], record
        assert record["column"] == ("images" if record["row"] == 5 else "messages")
        assert json.loads(record["original"])["messages"] == rows[record["row"]]["messages"]

    with pytest.raises(BadRowError) as info:
        _rows(vl_ds(path, {**BASE, "on_bad_row": "raise"}))
    err = info.value
    assert (err.file, err.row, err.column) == (path, 1, "messages") and "empty" in err.reason
    assert f"file {path}, row 1" in str(err)


def test_images_that_do_not_decode_are_quarantined_with_renderers_reason(ray_session, vl_ds, tmp_path):
    """Images whose header reads but whose data do not decode (a PNG and a JPEG cut short, a JPEG with a stray
    start-of-image marker mid-scan): renderers' decode refuses them, and the row is quarantined with its reason and
    the images column, or raises under ``on_bad_row: raise``; the other rows are kept."""
    png, jpeg = encoded_image(random.Random(1), "png"), encoded_image(random.Random(2), "jpeg")
    stray = jpeg[: len(jpeg) // 2] + b"\xff\xd8\x00\x04\x00\x00" + jpeg[len(jpeg) // 2 :]
    images = [png, png[: len(png) // 2], jpeg[: len(jpeg) - 400], jpeg, stray]
    rows = [
        {"prompt": [{"role": "user", "content": f"<image>What is in picture {i}?"}], "completion": f"Shape {i}.",
         "images": [{"bytes": data, "path": None}]}
        for i, data in enumerate(images)
    ]  # fmt: skip
    path = _write(tmp_path / "cut.parquet", rows)
    ledger = RunLedger.remote()
    out = _rows(vl_ds(path, ledger=ledger))
    assert len(out) == 2
    counts = ray_session.get(ledger.get.remote())
    assert (counts["rows_in"], counts["rows_out"], counts["quarantined"]) == (5, 2, 3)
    records = ray_session.get(ledger.quarantine.remote())
    assert [(r["row"], r["column"]) for r in records] == [(1, "images"), (2, "images"), (4, "images")]
    assert all(r["file"] == path and r["reason"].startswith("renderers: ") for r in records), records


# --- images ------------------------------------------------------------------------------------------------------


def _mm_rows(seed: int, n: int) -> tuple[list[dict], list[tuple[list[dict], list[bytes]]]]:
    """Rows with struct content parts (images as {"type": "image"} + an images column, or inline bytes) and, per row,
    the same conversation as a Python source would hold it + the images column's values."""
    rng = random.Random(seed)
    kinds = ["png", "jpeg", "gray", "palette", "rgba", "tiny", "wide", "tall"]
    rows, sources = [], []
    for i in range(n):
        messages, column = [], []
        for _ in range(rng.randint(1, 2)):
            parts = []
            for _ in range(rng.randint(0, 2)):
                data = encoded_image(rng, rng.choice(kinds))
                if rng.random() < 0.5:
                    parts.append({"type": "image", "image": data})
                else:
                    parts.append({"type": "image"})
                    column.append(data)
            parts.append({"type": "text", "text": random_text(rng)})
            rng.shuffle(parts)
            messages.append({"role": "user", "content": parts})
            messages.append({"role": "assistant", "content": [{"type": "text", "text": random_text(rng)}]})
        images = [{"bytes": b, "path": None} for b in column] if column or i % 2 else None
        rows.append({"messages": messages, "images": images})
        sources.append((messages, column))
    return rows, sources


def _media(row: dict, seq) -> None:
    data = (seq.multi_modal_data or {}).get("image")
    if data is None:
        assert row["pixel_values"] is None and row["image_grid_thw"] is None and row["image_placeholders"] is None
        return
    assert row["image_placeholders"] == [{"offset": p.offset, "length": p.length} for p in data.placeholders]
    assert row["image_hashes"] == data.hashes
    expected = np.concatenate([item["pixel_values"] for item in data.items])
    got = tensor_from_record(row["pixel_values"])
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    grids = np.concatenate([item["image_grid_thw"] for item in data.items])
    np.testing.assert_array_equal(tensor_from_record(row["image_grid_thw"]), grids)


def test_images_equal_renderers_samples(ray_session, vl_ds, tmp_path, vl_renderer):
    rows, sources = _mm_rows(1, 10)
    geo = [  # verl / geo3k layout: <image> markers in string content, HF Image() structs, a completion string
        {"prompt": [{"role": "user", "content": f"<image>Find x in figure {i}.{'<image>' * (i % 2)}"}],
         "completion": f"x = {i}.",
         "images": [{"bytes": encoded_image(random.Random(i), "jpeg"), "path": None}] * (1 + i % 2)}
        for i in range(4)
    ]  # fmt: skip
    files = [_write(tmp_path / "mm.parquet", rows, row_group_size=4), _write(tmp_path / "geo.parquet", geo)]
    ledger = RunLedger.remote()
    got = _rows(vl_ds(files[0], ledger=ledger))
    assert len(got) == len(rows)
    images_seen = 0
    for row, (messages, column) in zip(got, sources, strict=True):
        seq = _direct(vl_renderer, messages, images=column)
        _assert_row_equals(row, seq)
        _media(row, seq)
        assert row["dropped_media"] == 0 and row["video_placeholders"] is None
        if seq.multi_modal_data:
            images_seen += len(seq.multi_modal_data["image"].items)
        else:
            assert row["mm_token_type_ids"] is None
    assert images_seen >= 8
    counts = ray_session.get(ledger.get.remote())
    assert counts["rows_in"] == counts["rows_out"] == len(rows) and counts["quarantined"] == 0

    got_geo = _rows(vl_ds(files[1]))
    for row, source in zip(got_geo, geo, strict=True):
        messages = split_media_placeholders([dict(m) for m in source["prompt"]])
        messages.append({"role": "assistant", "content": source["completion"]})
        seq = _direct(vl_renderer, messages, images=[x["bytes"] for x in source["images"]])
        _assert_row_equals(row, seq)
        _media(row, seq)
        assert row["input_ids"].count(IMAGE_PAD) == sum(p.length for p in seq.multi_modal_data["image"].placeholders)


@slow
def test_truncation_and_packing_keep_placeholder_runs_whole(ray_session, vl_ds, tmp_path, vl_renderer):
    rng = random.Random(9)
    images = [encoded_image(rng, "png"), encoded_image(rng, "jpeg")]
    parts = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}]
    messages = [
        {"role": "user", "content": parts + [{"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "They differ."}]},
    ]
    full = _sample(vl_renderer, messages, images)
    first, second = full.multi_modal_data.mm_placeholders["image"]
    path = _write(tmp_path / "two.parquet", [{"messages": messages, "images": [{"bytes": b} for b in images]}] * 3)
    cases = [  # (sequence limit, inputs kept, images kept)
        (second.offset + second.length // 2, second.offset, 1),  # inside the second run: back to its start
        (first.offset + 1, first.offset, 0),  # inside the first run
        (second.offset + second.length, second.offset + second.length, 2),  # right after the second run
    ]
    for limit, cut, kept in cases:  # every cut is in the user turn: no trained target, kept to look at the runs
        config = {**BASE, "sft_max_length": limit}
        row = _rows(vl_ds(path, config, no_target="keep"))[0]
        seq = shift_and_truncate(full, limit)
        _assert_row_equals(row, seq)
        assert len(row["input_ids"]) == cut
        assert row["dropped_media"] == 2 - kept
        if kept:
            _media(row, seq)
            assert tensor_from_record(row["image_grid_thw"]).shape == (kept, 3)
            assert len(row["image_placeholders"]) == kept
        else:
            assert row["pixel_values"] is None and row["mm_token_type_ids"] == [0] * cut

    budget = 2 * len(full.token_ids)
    table = pa.concat_tables(
        vl_ds(path, {**BASE, "sft_pack_token_budget": budget}).iter_batches(batch_format="pyarrow")
    )
    rows = table.to_pylist()
    one = shift_and_truncate(full, budget)
    n = len(one.inputs)
    assert [r["seq_lens"] for r in rows] == [[n, n], [n]]
    row = rows[0]
    assert row["input_ids"] == one.inputs * 2 and row["mm_token_type_ids"] == one.mm_token_type_ids * 2
    offsets = [p.offset for p in one.multi_modal_data["image"].placeholders]
    assert [p["offset"] for p in row["image_placeholders"]] == offsets + [o + n for o in offsets]
    pixels = np.concatenate([item["pixel_values"] for item in one.multi_modal_data["image"].items])
    np.testing.assert_allclose(tensor_from_record(row["pixel_values"]), np.concatenate([pixels, pixels]), atol=1e-6)
    batch = SFTCollate()(table.slice(0, 2))
    assert batch["image_grid_thw"].shape == (6, 3) and batch["pixel_values"].shape[0] == 3 * pixels.shape[0]
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    assert batch["mm_token_type_ids"][0].tolist() == row["mm_token_type_ids"]


# --- renderers' and prime-rl's call shapes -----------------------------------------------------------------------


def _byt5_chatml():
    """A slow (Python) tokenizer with a ChatML template and no directory behind it (``name_or_path`` is empty)."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer(extra_ids=0, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    return tokenizer


def assistant_only(message) -> bool:
    return message["role"] == "assistant"


@slow
def test_tokenizer_and_processor_objects_give_the_rows_of_their_paths(
    ray_session, qwen3_dir, vl_dir, vl_renderer, text_files, text_conversations, tmp_path, monkeypatch
):
    """prime-rl's call: ``build_sft_dataset(files, tokenizer_object, renderer=...)``. An object is never pickled to the
    actors: a tokenizer unchanged since it was loaded from a directory goes as that directory; anything else (a
    changed template, a slow tokenizer made in memory, a processor) is saved once and its files reach the actors,
    also on a node without the driver's directory. A renderer made by ``renderers.create_renderer`` gives its
    config."""
    from transformers import AutoProcessor, AutoTokenizer

    from ingest.datasets.saved_models import model_for_actors

    config = {**BASE, "read_rows_per_task": 40}
    qwen3 = Qwen3RendererConfig()
    by_path = _rows(build_sft_dataset(text_files, qwen3_dir, config, renderer=qwen3))
    fast = AutoTokenizer.from_pretrained(qwen3_dir)
    assert fast.is_fast and model_for_actors(fast) == qwen3_dir  # unchanged: its directory, nothing saved
    assert _rows(build_sft_dataset(text_files, fast, config, renderer=create_renderer(fast, qwen3))) == by_path

    # a changed template is the object's, not the directory's: saved, and renderers' default renderer (the
    # template's own) renders with it in the actors
    default = renderers.configs.DefaultRendererConfig()
    changed = AutoTokenizer.from_pretrained(qwen3_dir)
    changed.chat_template = changed.chat_template.replace("# Tools", "# Available tools")
    saved = model_for_actors(changed)
    assert not isinstance(saved, str) and saved.path != qwen3_dir
    got = _rows(build_sft_dataset(text_files, changed, config, renderer=default, role_to_mask=assistant_only))
    renderer = create_renderer(changed, default)
    for row, messages in zip(got, text_conversations, strict=True):
        _assert_row_equals(row, _direct(renderer, messages, role_to_mask=assistant_only))

    # a slow tokenizer: saved once (the same SavedModel for a second dataset), rows as the direct calls
    slow = _byt5_chatml()
    assert not slow.is_fast
    chats = [
        [{"role": "user", "content": f"Grüße {i}?"}, {"role": "assistant", "content": f"Hallo, Wörld {i}."}]
        for i in range(6)
    ]
    path = _write(tmp_path / "byt5.parquet", [{"messages": m} for m in chats])
    saved = model_for_actors(slow)
    assert model_for_actors(slow) is saved
    slow_renderer = create_renderer(slow, default)
    got = _rows(build_sft_dataset(path, slow, BASE, renderer=default, role_to_mask=assistant_only))
    for row, messages in zip(got, chats, strict=True):
        _assert_row_equals(row, _direct(slow_renderer, messages, role_to_mask=assistant_only))
    # an actor on a node without the driver's directory writes the files from the object store
    shutil.rmtree(saved.path)
    assert _rows(build_sft_dataset(path, slow, BASE, renderer=default, role_to_mask=assistant_only)) == got

    # a processor object, as the tokenizer or as the processor (renderers loads it from the same files)
    rows, sources = _mm_rows(4, 6)
    mm_file = _write(tmp_path / "mm.parquet", rows)
    vl = Qwen3VLRendererConfig()
    processor = AutoProcessor.from_pretrained(vl_dir)
    as_tokenizer = _rows(build_sft_dataset(mm_file, processor, BASE, renderer=vl))
    assert any(r["pixel_values"] is not None for r in as_tokenizer)
    for row, (messages, column) in zip(as_tokenizer, sources, strict=True):
        seq = _direct(vl_renderer, messages, images=column)
        _assert_row_equals(row, seq)
        _media(row, seq)
    assert _rows(build_sft_dataset(mm_file, None, BASE, processor=processor, renderer=vl)) == as_tokenizer

    # an object that can be neither named nor saved: one clear error on the driver
    stuck = AutoTokenizer.from_pretrained(qwen3_dir)
    stuck.chat_template += " "  # no longer its directory's tokenizer

    def refuse(*args, **kwargs):
        raise OSError("read-only file system")

    monkeypatch.setattr(stuck, "save_pretrained", refuse)
    with pytest.raises(ValueError, match="cannot hand the tokenizer object .* read-only file system.* directory"):
        build_sft_dataset(text_files, stuck, config, renderer=qwen3)
    with pytest.raises(TypeError, match="renderers config or a renderer"):
        build_sft_dataset(text_files, qwen3_dir, config, renderer="qwen3")


def test_no_target_samples_are_dropped_and_counted_or_kept(ray_session, text_ds, tmp_path, text_renderer):
    """A sample whose window (``sft_max_length``) holds no trained token is dropped by default (prime-rl's rule:
    its loss would divide by zero) and counted as ``dropped_no_target``, so rows in = out + filtered + quarantined +
    dropped; ``no_target="keep"`` emits it with an all-false loss mask."""
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    long_prompt = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "Yes."}]
    conversations = [short, long_prompt, [{"role": "user", "content": "no answer"}], short, long_prompt]
    path = _write(tmp_path / "targets.parquet", [{"messages": json.dumps(m)} for m in conversations])
    config = {**BASE, "sft_max_length": 64}
    assert not any(_direct(text_renderer, long_prompt, 64).loss_mask)
    assert any(_direct(text_renderer, short, 64).loss_mask)

    ledger = RunLedger.remote()
    rows = _rows(text_ds(path, config, ledger=ledger))
    assert len(rows) == 2
    for row in rows:
        _assert_row_equals(row, _direct(text_renderer, short, 64))
    counts = ray_session.get(ledger.get.remote())
    assert counts["dropped_no_target"] == 2 and counts["quarantined"] == 1 and counts["filtered_overlong"] == 0
    assert counts["rows_in"] == 5 == counts["rows_out"] + counts["quarantined"] + counts["dropped_no_target"]
    summary = RunSummary(**counts)  # the run summary counts them as a reason of their own
    assert summary.accounted and not dataclasses.replace(summary, dropped_no_target=0).accounted
    assert "dropped: no target            2" in summary.format()

    ledger = RunLedger.remote()
    kept = _rows(text_ds(path, config, ledger=ledger, no_target="keep"))
    assert len(kept) == 4
    for row, messages in zip(kept, [short, long_prompt, short, long_prompt], strict=True):
        _assert_row_equals(row, _direct(text_renderer, messages, 64))
    assert not any(kept[1]["loss_mask"]) and len(kept[1]["input_ids"]) == 64
    counts = ray_session.get(ledger.get.remote())
    assert (counts["rows_out"], counts["dropped_no_target"], counts["quarantined"]) == (4, 0, 1)
    with pytest.raises(ValueError, match="no_target must be one of drop, keep"):
        text_ds(path, config, no_target="skip")


def _tool_chat(arguments) -> list[dict]:
    """An OpenAI-shaped agent chat: a tool-call turn with null content, a tool answer, a named user."""
    call = {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "21", "tool_call_id": "c1"},
        {"role": "assistant", "content": "21 °C."},
    ]


def test_struct_column_nulls_go_and_tool_call_argument_nulls_stay(
    ray_session, text_ds, tmp_path, text_renderer, qwen3_dir
):
    """A Parquet struct column gives every message every key, so keys a message lacks read back as null and go;
    a null inside tool-call arguments is data (``{"reasoning_effort": null}``) and stays, whether the arguments are
    a JSON string (OpenAI's shape) or a map. The rows equal renderers' samples of the source messages."""
    named = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello."},
    ]
    as_string = [_tool_chat('{"city": "Paris", "reasoning_effort": null}'), named]
    as_map = [_tool_chat({"city": "Paris", "reasoning_effort": None}), _tool_chat({"city": "東京", "days": "2"})]
    string_file = _write(tmp_path / "string.parquet", [{"messages": m, "tools": TOOLS} for m in as_string])
    call = pa.struct([("name", pa.string()), ("arguments", pa.map_(pa.string(), pa.string()))])
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("tool_call_id", pa.string()),
            ("tool_calls", pa.list_(pa.struct([("type", pa.string()), ("id", pa.string()), ("function", call)]))),
        ]
    )
    map_rows = [{"messages": m} for m in as_map]
    map_file = _write(tmp_path / "map.parquet", map_rows, pa.schema([("messages", pa.list_(message))]))
    assert pq.read_table(string_file).column("messages")[1].as_py()[1]["tool_calls"] is None  # the filled nulls

    from transformers import AutoTokenizer

    for path, sources, tools in ((string_file, as_string, TOOLS), (map_file, as_map, None)):
        rows = _rows(text_ds(path))
        assert len(rows) == len(sources)
        for row, messages in zip(rows, sources, strict=True):
            _assert_row_equals(row, _direct(text_renderer, messages, tools=tools))
        if path == string_file:
            assert '"reasoning_effort": null' in AutoTokenizer.from_pretrained(qwen3_dir).decode(rows[0]["input_ids"])


def test_files_without_conversation_columns_name_the_columns_found_and_expected(ray_session, text_ds, tmp_path):
    other = _write(tmp_path / "other.parquet", [{"text": "x", "label": 1}])
    with pytest.raises(SourceError) as info:
        text_ds(other)
    message = str(info.value)
    assert info.value.file == other and info.value.column == "messages"
    assert "found 'text', 'label'" in message
    assert "expected a 'messages' column" in message and "'prompt' + 'completion' columns" in message
    half = _write(tmp_path / "half.parquet", [{"prompt": "x"}])
    with pytest.raises(SourceError, match="found 'prompt'; expected a 'messages' column"):
        text_ds(half, {**BASE, "sft_completion_key": "answer"})
    renamed = _write(tmp_path / "renamed.parquet", [{"chat": "[]"}])
    with pytest.raises(SourceError, match="found 'chat'; expected a 'conversation' column"):
        text_ds(renamed, {**BASE, "sft_messages_key": "conversation"})
    messages = _write(tmp_path / "messages.parquet", [{"messages": "[]"}])
    split = _write(tmp_path / "split.parquet", [{"prompt": "x", "completion": "y"}])
    with pytest.raises(SourceError, match="mix the two conversation layouts"):
        text_ds([messages, split])


def _png(pixels: np.ndarray) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _prime_rl_sample(sample, seq_len: int) -> dict | None:
    """prime-rl's ``SFTDataset`` item of a rendered sample: causal shift; a multimodal sample longer than
    ``seq_len`` cut at the last cut outside a placeholder run, items past the cut dropped (and the sample dropped if
    no stop token is left in its targets); no trained target in ``[:seq_len]``: dropped; text samples stay whole."""
    ids, mask, types = list(sample.token_ids), list(sample.loss_mask), sample.mm_token_type_ids
    inputs, targets, mask = ids[:-1], ids[1:], mask[1:]
    types = None if types is None else list(types)[:-1]
    mm = sample.multi_modal_data
    data = None if mm is None else {name: (mm.mm_items[name], ranges) for name, ranges in mm.mm_placeholders.items()}
    if data is not None and len(inputs) > seq_len:
        cut = seq_len
        for _, ranges in data.values():
            for r in ranges:
                if r.offset < cut < r.offset + r.length:
                    cut = r.offset
        inputs, targets, mask = inputs[:cut], targets[:cut], mask[:cut]
        types = None if types is None else types[:cut]
        data = {
            name: [item for item, r in zip(items, ranges, strict=True) if r.offset + r.length <= cut]
            for name, (items, ranges) in data.items()
        }
        if IM_END not in targets:
            return None
    else:
        data = None if data is None else {name: items for name, (items, _) in data.items()}
    if not any(mask[:seq_len]):
        return None
    mm_kwargs = {}
    for items in (data or {}).values():
        for item in items:
            for key, value in item.items():
                if isinstance(value, np.ndarray):
                    value = torch.as_tensor(value)
                    mm_kwargs[key] = torch.cat([mm_kwargs[key], value]) if key in mm_kwargs else value
    return {
        "input_ids": inputs,
        "target_ids": targets,
        "loss_mask": mask,
        "position_ids": list(range(len(inputs))),
        "seq_lens": [len(inputs)],
        "mm_kwargs": mm_kwargs or None,
        "mm_token_type_ids": types,
    }


def _prime_rl_packs(samples: list[dict], seq_len: int) -> list[dict]:
    """prime-rl's ``CatDataset`` + ``cat_collate``: samples appended in order until the next would overflow
    ``seq_len`` (a pack that reaches it closes); a pack is cut to ``seq_len`` and right-padded with input 0,
    target 0, loss False and positions ``range(pad)``, the padding added to the last ``seq_lens`` entry;
    ``mm_kwargs`` concatenated; ``mm_token_type_ids`` only once a member has media (zeros for the others)."""
    packs, current = [], None

    def close(pack):
        out = {k: pack[k][:seq_len] for k in ("input_ids", "position_ids", "loss_mask", "target_ids")}
        seq_lens, remaining = [], len(out["input_ids"])
        for n in pack["seq_lens"]:
            if remaining <= 0:
                break
            seq_lens.append(min(n, remaining))
            remaining -= min(n, remaining)
        pad = seq_len - len(out["input_ids"])
        out["input_ids"] += [0] * pad
        out["position_ids"] += list(range(pad))
        out["loss_mask"] += [False] * pad
        out["target_ids"] += [0] * pad
        if pad:
            seq_lens[-1] += pad
        types = pack["mm_token_type_ids"]
        packs.append(
            {
                "input_ids": torch.tensor(out["input_ids"], dtype=torch.long).unsqueeze(0),
                "position_ids": torch.tensor(out["position_ids"], dtype=torch.long).unsqueeze(0),
                "loss_mask": torch.tensor(out["loss_mask"], dtype=torch.bool).unsqueeze(0),
                "target_ids": torch.tensor(out["target_ids"], dtype=torch.long).unsqueeze(0),
                "seq_lens": torch.tensor(seq_lens, dtype=torch.long),
                "mm_kwargs": pack["mm_kwargs"],
                "mm_token_type_ids": None
                if types is None
                else torch.tensor(types[:seq_len] + [0] * pad, dtype=torch.long).unsqueeze(0),
            }
        )

    def empty():
        return {"input_ids": [], "position_ids": [], "loss_mask": [], "target_ids": [], "seq_lens": [],
                "mm_kwargs": None, "mm_token_type_ids": None}  # fmt: skip

    current, used = empty(), 0
    for sample in samples:
        n = len(sample["input_ids"])
        if used > 0 and used + n > seq_len:
            close(current)
            current, used = empty(), 0
        before = len(current["input_ids"])
        for key in ("input_ids", "position_ids", "loss_mask", "target_ids"):
            current[key] += sample[key]
        current["seq_lens"].append(n)
        if sample["mm_kwargs"] is None:
            if current["mm_token_type_ids"] is not None:
                current["mm_token_type_ids"] += [0] * n
        else:
            if current["mm_kwargs"] is None:
                current["mm_kwargs"] = dict(sample["mm_kwargs"])
            else:
                for key, value in sample["mm_kwargs"].items():
                    current["mm_kwargs"][key] = torch.cat([current["mm_kwargs"][key], value])
            if current["mm_token_type_ids"] is None and sample["mm_token_type_ids"] is not None:
                current["mm_token_type_ids"] = [0] * before
            if current["mm_token_type_ids"] is not None:
                current["mm_token_type_ids"] += sample["mm_token_type_ids"] or [0] * n
        used += n
        if used >= seq_len:
            close(current)
            current, used = empty(), 0
    if used:
        close(current)
    return packs


def test_prime_rl_collate_gives_prime_rl_packed_micro_batches(ray_session, vl_ds, tmp_path, vl_renderer):
    """``PrimeRLCollate`` over rows packed with ``sft_pack_token_budget`` = prime-rl's ``seq_len`` equals the same
    conversations through prime-rl's rule (its ``SFTDataset`` samples, ``CatDataset`` packs, ``cat_collate``):
    inputs, targets, loss mask, per-sample positions, ``seq_lens`` with the padding on the last sample, pixel values
    and grids concatenated, ``mm_token_type_ids`` shifted in lockstep and only in packs with media."""
    rng = random.Random(12)
    big = _png(np.random.default_rng(5).integers(0, 255, (640, 640, 3), dtype=np.uint8))  # 400 image tokens

    def part(text):  # every content a part list: one Parquet struct column for all rows
        return [{"type": "text", "text": text}]

    def image_chat(data, text):
        return [
            {"role": "user", "content": [{"type": "image", "image": data}, *part(text)]},
            {"role": "assistant", "content": part(f"It shows {text.lower()}")},
        ]

    def text_chat(n_words):
        return [{"role": "user", "content": part("Say it.")}, {"role": "assistant", "content": part("ok " * n_words)}]

    # an image in the second user turn: cut inside its run, the sample keeps its first answer and loses the image
    late_image = text_chat(3) + image_chat(big, "A shape?")
    run = build_training_sample(vl_renderer, late_image).multi_modal_data.mm_placeholders["image"][0]
    seq_len = run.offset + run.length // 2
    small = [encoded_image(rng, kind) for kind in ("tiny", "wide", "tall", "tiny")]
    conversations = [
        late_image,  # alone in its pack (the next one does not fit): no media left, so no mm_token_type_ids
        text_chat(seq_len),  # longer than seq_len: a pack of its own, cut to seq_len
        image_chat(small[0], "Dots?"),
        text_chat(5),
        image_chat(small[1], "Lines?"),
        text_chat(9),
        image_chat(small[2], "Bars?"),
        image_chat(small[3], "Rings?"),
        text_chat(4),
    ]
    samples = [build_training_sample(vl_renderer, m, ensure_final_stop=True) for m in conversations]
    assert len(samples[1].token_ids) - 1 > seq_len
    assert all(len(s.token_ids) - 1 < seq_len // 2 for s in samples[2:])
    expected = _prime_rl_packs([_prime_rl_sample(s, seq_len) for s in samples], seq_len)
    assert expected[0]["mm_kwargs"] is None and expected[0]["mm_token_type_ids"] is None
    assert expected[1]["seq_lens"].tolist() == [seq_len]
    assert any(p["mm_kwargs"] is not None and len(p["seq_lens"]) > 2 for p in expected)

    path = _write(tmp_path / "prime.parquet", [{"messages": m} for m in conversations])
    config = {**BASE, "sft_pack_token_budget": seq_len, "tokenizer_batch_size": 64, "read_rows_per_task": 64}
    ds = vl_ds(path, config, ensure_final_stop=True)
    got = list(ds.iter_torch_batches(batch_size=1, collate_fn=PrimeRLCollate(seq_len)))
    assert len(got) == len(expected)
    for batch, want in zip(got, expected, strict=True):
        assert batch.keys() == want.keys()
        for key in ("input_ids", "position_ids", "loss_mask", "target_ids", "seq_lens", "mm_token_type_ids"):
            if want[key] is None:
                assert batch[key] is None, key
            else:
                assert batch[key].dtype == want[key].dtype and torch.equal(batch[key], want[key]), key
        if want["mm_kwargs"] is None:
            assert batch["mm_kwargs"] is None
            continue
        assert batch["mm_kwargs"].keys() == want["mm_kwargs"].keys() == {"pixel_values", "image_grid_thw"}
        assert torch.equal(batch["mm_kwargs"]["image_grid_thw"], want["mm_kwargs"]["image_grid_thw"])
        torch.testing.assert_close(batch["mm_kwargs"]["pixel_values"], want["mm_kwargs"]["pixel_values"],
                                   atol=1e-6, rtol=0)  # fmt: skip
    with pytest.raises(ValueError, match="batch_size=1"):
        next(iter(ds.iter_torch_batches(batch_size=2, collate_fn=PrimeRLCollate(seq_len))))
