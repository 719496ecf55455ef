"""The Ray Data SFT mode (``build_sft_dataset``, issue 7): rows equal ``build_training_sample`` + ``shift_and_truncate``
called directly and transformers' ``apply_chat_template``; loss masks; prompt + completion input; images through the
vision pool; truncation at placeholder runs; packing; quarantine / strict; ledger counts; ``SFTCollate``. Real local
Ray (the session fixture), small data."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ingest import BadRowError, SourceError
from ingest.blocks import tensor_from_record
from ingest.errors import find_ingest_error
from ingest.rowformat.messages import split_media_placeholders
from ingest.sft import (
    SFTCollate,
    build_sft_dataset,
    build_training_sample,
    create_renderer,
    shift_and_truncate,
)
from ingest.stats import RunLedger
from tests.support.conversations import (
    IM_END,
    IMAGE_PAD,
    encoded_image,
    expected_chatml_mask,
    hf_chat_ids,
    random_conversations,
    random_text,
)

BASE = {"shuffle": False}


def _write(path, rows, schema=None, row_group_size=None) -> str:
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def _rows(ds) -> list[dict]:
    return [row for batch in ds.iter_batches(batch_size=64, batch_format="pyarrow") for row in batch.to_pylist()]


def _direct(renderer, messages, max_length=4096, **kwargs):
    return shift_and_truncate(build_training_sample(renderer, messages, **kwargs), max_length)


def _assert_row_equals(row: dict, seq) -> None:
    assert row["input_ids"] == seq.inputs
    assert row["target_ids"] == seq.targets
    assert row["loss_mask"] == seq.loss_mask
    assert row["seq_lens"] == seq.seq_lens
    if "mm_token_type_ids" in row:
        assert row["mm_token_type_ids"] == seq.mm_token_type_ids


@pytest.fixture(scope="module")
def text_renderer(model_dir):
    return create_renderer(model_dir)


@pytest.fixture(scope="module")
def vl_renderer(model_dir):
    return create_renderer(model_dir, processor=model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


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


def test_text_rows_equal_direct_samples_and_apply_chat_template(
    ray_session, model_dir, text_files, text_conversations, text_renderer, hf_tokenizer
):
    ledger = RunLedger.remote()
    config = {**BASE, "read_rows_per_task": 20, "tokenizer_batch_size": 7}
    rows = _rows(build_sft_dataset(text_files, model_dir, config, ledger=ledger))
    assert len(rows) == len(text_conversations)
    assert set(rows[0]) == {"input_ids", "target_ids", "loss_mask", "seq_lens"}  # text: no media columns
    tools_seen = 0
    for row, messages in zip(rows, text_conversations, strict=True):
        _assert_row_equals(row, _direct(text_renderer, messages))
        ids = hf_chat_ids(hf_tokenizer, messages)  # apply_chat_template(tokenize=True, add_generation_prompt=False)
        assert row["input_ids"] == ids[:-1] and row["target_ids"] == ids[1:]
        assert row["loss_mask"] == expected_chatml_mask(ids)[1:]
        assert row["seq_lens"] == [len(ids) - 1]
        # (the mask oracle: after each <|im_start|>assistant\n header, up to and including its <|im_end|>)
        trained = [t for t, m in zip(row["target_ids"], row["loss_mask"], strict=True) if m]
        assert trained.count(IM_END) == sum(m["role"] == "assistant" for m in messages) and trained[-1] == IM_END
        tools_seen += any(m["role"] == "tool" for m in messages)
    assert tools_seen > 10
    counts = ray_session.get(ledger.get.remote())
    assert counts["rows_in"] == counts["rows_out"] == len(rows)
    assert counts["quarantined"] == counts["filtered_overlong"] == 0
    assert counts["prompt_tokens"] == sum(len(r["input_ids"]) for r in rows)


def test_prompt_completion_and_json_columns(ray_session, model_dir, tmp_path, text_renderer):
    conversations = random_conversations(5, 12, tools=False)
    split = [max(i for i, m in enumerate(c) if m["role"] == "user") for c in conversations]  # prompt: up to last user
    lists = [{"prompt": c[: k + 1], "completion": c[k + 1 :]} for c, k in zip(conversations, split, strict=True)]
    strings = [
        {"prompt": f"Question {i}: {random_text(random.Random(i))}", "completion": f"Answer {i}."} for i in range(5)
    ]
    as_json = [{"messages": json.dumps(c, ensure_ascii=False)} for c in conversations]
    files = [_write(tmp_path / "lists.parquet", lists), _write(tmp_path / "strings.parquet", strings)]
    json_file = _write(tmp_path / "json.parquet", as_json)
    got_lists = _rows(build_sft_dataset(files[0], model_dir, BASE))
    got_strings = _rows(build_sft_dataset(files[1], model_dir, BASE))
    got_json = _rows(build_sft_dataset(json_file, model_dir, BASE))
    for row, row_json, messages in zip(got_lists, got_json, conversations, strict=True):
        _assert_row_equals(row, _direct(text_renderer, messages))  # messages = prompt + completion
        assert row_json == row
    for row, source in zip(got_strings, strings, strict=True):
        messages = [
            {"role": "user", "content": source["prompt"]},
            {"role": "assistant", "content": source["completion"]},
        ]
        _assert_row_equals(row, _direct(text_renderer, messages))
    with pytest.raises(SourceError, match="no 'messages' column and no 'prompt' \\+ 'completion'"):
        build_sft_dataset(_write(tmp_path / "other.parquet", [{"text": "x"}]), model_dir, BASE)
    with pytest.raises(SourceError, match="completion"):
        build_sft_dataset(_write(tmp_path / "half.parquet", [{"prompt": "x"}]), model_dir, BASE)
    with pytest.raises(ValueError, match="vision_pool_max_size"):  # build_dataset's fused layout only
        build_sft_dataset(files[0], model_dir, {**BASE, "vision_pool_max_size": 0})


def test_packing_seq_lens_and_collate(ray_session, model_dir, text_files, text_conversations, text_renderer):
    lengths = [len(build_training_sample(text_renderer, m).token_ids) - 1 for m in text_conversations]
    budget = int(np.percentile(lengths, 80))  # some samples are cut at the budget, most are packed whole
    config = {**BASE, "sft_pack_token_budget": budget, "tokenizer_batch_size": 16, "read_rows_per_task": 16}
    packed = _rows(build_sft_dataset(text_files, model_dir, config))
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

    ds = build_sft_dataset(text_files, model_dir, config)
    batches = list(ds.iter_torch_batches(batch_size=4, collate_fn=SFTCollate(pad_token_id=-1, pad_to=budget)))
    assert sum(len(b["input_ids"]) for b in batches) == len(packed)
    batch, rows = batches[0], packed[:4]
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
    plain = next(iter(ds.iter_torch_batches(batch_size=3, collate_fn=SFTCollate())))
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


def test_bad_conversations_quarantine_strict_and_counts(ray_session, model_dir, tmp_path):
    rows, bad = _bad_rows(encoded_image(random.Random(3), "png"))
    path = _write(tmp_path / "bad.parquet", rows)
    ledger = RunLedger.remote()
    out = _rows(build_sft_dataset(path, model_dir, BASE, ledger=ledger))
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
        _rows(build_sft_dataset(path, model_dir, {**BASE, "on_bad_row": "raise"}))
    err = info.value
    assert (err.file, err.row, err.column) == (path, 1, "messages") and "empty" in err.reason
    assert f"file {path}, row 1" in str(err)


def test_cut_image_files_are_quarantined_before_the_vision_actor(ray_session, model_dir, tmp_path):
    """Images whose header reads but whose file is cut short (a PNG, a JPEG) are bad rows of the render stage: the
    SFT vision actor decodes them with no per-row quarantine, and a half-read file used to crash the run there."""
    png, jpeg = encoded_image(random.Random(1), "png"), encoded_image(random.Random(2), "jpeg")
    images = [png, png[: len(png) // 2], jpeg[: len(jpeg) - 400], jpeg]
    rows = [
        {"prompt": [{"role": "user", "content": f"<image>What is in picture {i}?"}], "completion": f"Shape {i}.",
         "images": [{"bytes": data, "path": None}]}
        for i, data in enumerate(images)
    ]  # fmt: skip
    path = _write(tmp_path / "cut.parquet", rows)
    ledger = RunLedger.remote()
    out = _rows(build_sft_dataset(path, model_dir, BASE, processor=model_dir, ledger=ledger))
    assert len(out) == 2
    counts = ray_session.get(ledger.get.remote())
    assert (counts["rows_in"], counts["rows_out"], counts["quarantined"]) == (4, 2, 2)
    records = ray_session.get(ledger.quarantine.remote())
    assert [(r["row"], r["column"]) for r in records] == [(1, "images"), (2, "images")]
    assert all(r["file"] == path and r["reason"].startswith("bad image: ") for r in records)
    with pytest.raises(BadRowError) as info:
        _rows(build_sft_dataset(path, model_dir, {**BASE, "on_bad_row": "raise"}, processor=model_dir))
    assert (info.value.file, info.value.row, info.value.column) == (path, 1, "images")


@pytest.mark.parametrize("policy", ["quarantine", "raise"])
def test_image_that_fails_to_decode_in_the_vision_actor_names_its_sample(ray_session, model_dir, tmp_path, policy):
    """A JPEG complete to its end marker (it passes the render stage's check) whose data do not decode (a stray
    start-of-image marker mid-scan) fails in the SFT vision actor, in a packed row with other samples: one
    ``BadRowError`` naming the sample's file and row, in both policies (it used to be a bare error from the actor)."""
    jpeg = encoded_image(random.Random(2), "jpeg")
    broken = jpeg[: len(jpeg) // 2] + b"\xff\xd8\x00\x04\x00\x00" + jpeg[len(jpeg) // 2 :]
    rows = [
        {"prompt": [{"role": "user", "content": f"<image>What is in picture {i}?"}], "completion": f"Shape {i}.",
         "images": [{"bytes": data, "path": None}]}
        for i, data in enumerate([jpeg, jpeg, broken, jpeg])
    ]  # fmt: skip
    path = _write(tmp_path / "broken.parquet", rows)
    config = {**BASE, "on_bad_row": policy, "sft_pack_token_budget": 4096}
    with pytest.raises(BadRowError) as info:
        _rows(build_sft_dataset(path, model_dir, config, processor=model_dir))
    err = find_ingest_error(info.value)
    assert (err.file, err.row, err.column) == (path, 2, "images") and err.reason.startswith("bad image: OSError")


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


def _hf_messages(messages: list[dict], column: list[bytes]) -> list[dict]:
    """For the processor's apply_chat_template: every image inline as PIL RGB (verl's RGB conversion)."""
    from PIL import Image

    pending = iter(column)
    out = []
    for message in messages:
        parts = []
        for part in message["content"]:
            if part["type"] == "image":
                data = part.get("image") or next(pending)
                part = {"type": "image", "image": Image.open(io.BytesIO(data)).convert("RGB")}
            parts.append(part)
        out.append({**message, "content": parts})
    return out


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


def test_images_equal_direct_samples_and_the_processor(ray_session, model_dir, tmp_path, vl_renderer):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    rows, sources = _mm_rows(1, 10)
    geo = [  # verl / geo3k layout: <image> markers in string content, HF Image() structs, a completion string
        {"prompt": [{"role": "user", "content": f"<image>Find x in figure {i}.{'<image>' * (i % 2)}"}],
         "completion": f"x = {i}.",
         "images": [{"bytes": encoded_image(random.Random(i), "jpeg"), "path": None}] * (1 + i % 2)}
        for i in range(4)
    ]  # fmt: skip
    files = [_write(tmp_path / "mm.parquet", rows, row_group_size=4), _write(tmp_path / "geo.parquet", geo)]
    config = {**BASE, "vision_batch_size": 3}
    ledger = RunLedger.remote()
    got = _rows(build_sft_dataset(files[0], model_dir, config, processor=model_dir, ledger=ledger))
    assert len(got) == len(rows)
    images_seen = 0
    for row, (messages, column) in zip(got, sources, strict=True):
        seq = _direct(vl_renderer, messages, images=column or None)
        _assert_row_equals(row, seq)
        _media(row, seq)
        assert row["dropped_media"] == 0 and row["video_placeholders"] is None
        expected = processor.apply_chat_template(
            _hf_messages(messages, column),
            tokenize=True,
            return_dict=True,
            add_generation_prompt=False,
            return_tensors="np",
        )
        ids = expected["input_ids"][0].tolist()
        assert row["input_ids"] == ids[:-1] and row["target_ids"] == ids[1:]
        assert row["loss_mask"] == expected_chatml_mask(ids)[1:]
        if seq.multi_modal_data:
            assert row["mm_token_type_ids"] == expected["mm_token_type_ids"][0].tolist()[:-1]
            images_seen += len(seq.multi_modal_data["image"].items)
        else:
            assert row["mm_token_type_ids"] is None
    assert images_seen >= 8
    counts = ray_session.get(ledger.get.remote())
    assert counts["rows_in"] == counts["rows_out"] == len(rows) and counts["quarantined"] == 0

    got_geo = _rows(build_sft_dataset(files[1], model_dir, config, processor=model_dir))
    for row, source in zip(got_geo, geo, strict=True):
        messages = split_media_placeholders([dict(m) for m in source["prompt"]])
        messages.append({"role": "assistant", "content": source["completion"]})
        seq = _direct(vl_renderer, messages, images=[x["bytes"] for x in source["images"]])
        _assert_row_equals(row, seq)
        _media(row, seq)
        assert row["input_ids"].count(IMAGE_PAD) == sum(p.length for p in seq.multi_modal_data["image"].placeholders)


def test_truncation_and_packing_keep_placeholder_runs_whole(ray_session, model_dir, tmp_path, vl_renderer):
    rng = random.Random(9)
    images = [encoded_image(rng, "png"), encoded_image(rng, "jpeg")]
    parts = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}]
    messages = [
        {"role": "user", "content": parts + [{"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "They differ."}]},
    ]
    full = build_training_sample(vl_renderer, messages, images=images)
    first, second = full.multi_modal_data["image"].placeholders
    path = _write(tmp_path / "two.parquet", [{"messages": messages, "images": [{"bytes": b} for b in images]}] * 3)
    cases = [  # (sequence limit, inputs kept, images kept)
        (second.offset + second.length // 2, second.offset, 1),  # inside the second run: back to its start
        (first.offset + 1, first.offset, 0),  # inside the first run
        (second.offset + second.length, second.offset + second.length, 2),  # right after the second run
    ]
    for limit, cut, kept in cases:
        row = _rows(build_sft_dataset(path, model_dir, {**BASE, "sft_max_length": limit}, processor=model_dir))[0]
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
    rows = _rows(build_sft_dataset(path, model_dir, {**BASE, "sft_pack_token_budget": budget}, processor=model_dir))
    one = shift_and_truncate(full, budget)
    n = len(one.inputs)
    assert [r["seq_lens"] for r in rows] == [[n, n], [n]]
    row = rows[0]
    assert row["input_ids"] == one.inputs * 2 and row["mm_token_type_ids"] == one.mm_token_type_ids * 2
    offsets = [p.offset for p in one.multi_modal_data["image"].placeholders]
    assert [p["offset"] for p in row["image_placeholders"]] == offsets + [o + n for o in offsets]
    pixels = np.concatenate([item["pixel_values"] for item in one.multi_modal_data["image"].items])
    np.testing.assert_allclose(tensor_from_record(row["pixel_values"]), np.concatenate([pixels, pixels]), atol=1e-6)
    ds = build_sft_dataset(path, model_dir, {**BASE, "sft_pack_token_budget": budget}, processor=model_dir)
    batch = next(iter(ds.iter_torch_batches(batch_size=2, collate_fn=SFTCollate())))
    assert batch["image_grid_thw"].shape == (6, 3) and batch["pixel_values"].shape[0] == 3 * pixels.shape[0]
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    assert batch["mm_token_type_ids"][0].tolist() == row["mm_token_type_ids"]


@pytest.mark.gpu
def test_cuda_vision_pool_matches_the_cpu_pool(ray_session, model_dir, tmp_path):
    """SFT's vision pool on a GPU actor: every field as on the CPU pool, pixel values within the device tolerance."""
    from ingest.media.pixels import ImagePixels

    rows, _ = _mm_rows(1, 10)
    file = _write(tmp_path / "mm.parquet", rows, row_group_size=4)
    cpu = _rows(build_sft_dataset(file, model_dir, BASE, processor=model_dir))
    gpu_config = {**BASE, "vision_device": "cuda", "vision_num_gpus": 1}
    gpu = _rows(build_sft_dataset(file, model_dir, gpu_config, processor=model_dir))
    tolerance = ImagePixels.from_dir(model_dir).device_tolerance()
    assert len(gpu) == len(cpu) == len(rows)
    for got, expected in zip(gpu, cpu, strict=True):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            if key.startswith("pixel_values") and value is not None:
                np.testing.assert_allclose(
                    tensor_from_record(got[key]), tensor_from_record(value), atol=tolerance, rtol=0
                )
            else:
                assert got[key] == value, key
