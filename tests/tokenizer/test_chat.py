"""``ChatTokenizer`` (``ingest/tokenizer/chat.py``): the fast loader renders and encodes like transformers."""

from __future__ import annotations

import pytest

from ingest.demo import gsm8k_rows
from ingest.tokenizer.chat import ChatTokenizer


@pytest.fixture(scope="module")
def both_paths(model_dir):
    fast = ChatTokenizer(model_dir)
    assert fast._hf is None, "Qwen2 directory should take the tokenizer.json fast path"
    slow = ChatTokenizer.__new__(ChatTokenizer)
    slow.path = model_dir
    slow._load_transformers(model_dir, trust_remote_code=False)
    from ingest.tokenizer.template import compile_chat_template

    slow._template = compile_chat_template(slow.chat_template)
    slow._fast_render = None  # Jinja only
    return fast, slow


def test_fast_path_matches_transformers(both_paths):
    from transformers import AutoTokenizer

    fast, slow = both_paths
    hf = AutoTokenizer.from_pretrained(fast.path)
    chats = [row["prompt"] for row in gsm8k_rows(70, variety=True)]
    chats.append([{"role": "user", "content": "literal <|im_start|> and <image> inside"}])
    texts = [fast.render(c) for c in chats]
    assert texts == [hf.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    assert texts == [slow.render(c) for c in chats]
    ids = fast.encode_batch(texts)
    assert ids == slow.encode_batch(texts) == [hf(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert fast.pad_token_id == slow.pad_token_id == hf.pad_token_id


def _model_copy(model_dir: str, tmp_path, **tokenizer_json) -> str:
    import json
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    data = json.loads((copy / "tokenizer.json").read_text())
    data.update(tokenizer_json)
    (copy / "tokenizer.json").write_text(json.dumps(data))
    return str(copy)


def test_ascii_ids_at_most_chars_only_where_an_id_covers_a_byte(both_paths, model_dir, tmp_path):
    """The overlong filter keeps a prompt short in ASCII characters unencoded only where the tokenizer can never make
    more ids than that: byte-level BPE without a prefix space or a normalizer that changes ASCII."""
    import random

    fast, slow = both_paths
    assert fast.ascii_ids_at_most_chars and not slow.ascii_ids_at_most_chars  # transformers' class: not inspected
    rng = random.Random(0)
    pieces = [chr(c) for c in range(128)] + ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<image>", "\n\n"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 80))) for _ in range(2000)]
    assert all(len(ids) <= len(text) for ids, text in zip(fast.encode_batch(texts), texts, strict=True))
    prefix_space = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    assert not ChatTokenizer(_model_copy(model_dir, tmp_path / "a", pre_tokenizer=prefix_space)).ascii_ids_at_most_chars
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    assert not ChatTokenizer(_model_copy(model_dir, tmp_path / "b", pre_tokenizer=metaspace)).ascii_ids_at_most_chars
    lengthening = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    assert not ChatTokenizer(_model_copy(model_dir, tmp_path / "c", normalizer=lengthening)).ascii_ids_at_most_chars
    nfc = {"type": "Sequence", "normalizers": [{"type": "NFC"}]}
    assert ChatTokenizer(_model_copy(model_dir, tmp_path / "d", normalizer=nfc)).ascii_ids_at_most_chars


def test_known_short_never_says_short_for_a_longer_text(model_dir, tmp_path):
    """``known_short`` (the overlong filter keeps such a prompt unencoded) is a bound: whatever it calls short within
    a limit encodes to at most that many ids, for ASCII and other text, with and without a normalizer; text that a
    normalizer changes (decomposed accents under NFC, ligatures under NFKC) is never known short."""
    import random

    nfc = {"type": "Sequence", "normalizers": [{"type": "NFC"}]}
    nfkc = {"type": "NFKC"}
    tokenizers = [
        ChatTokenizer(model_dir),
        ChatTokenizer(_model_copy(model_dir, tmp_path / "nfc", normalizer=nfc)),
        ChatTokenizer(_model_copy(model_dir, tmp_path / "nfkc", normalizer=nfkc)),
    ]
    rng = random.Random(0)
    pieces = [chr(c) for c in range(32, 127)] + ["\n", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<image>"]
    pieces += ["é", "e\u0301", ">\u0338", "\u0958", "Ø", "中文", "😀", "\ufb01", "\ufdfa", "\u212b", "\u1100\u1161"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 60))) for _ in range(3000)]
    for tokenizer in tokenizers:
        lengths = [len(ids) for ids in tokenizer.encode_batch(texts)]
        # a limit one below each text's ids: "short" there would be a wrong answer
        below = [tokenizer.known_short([text], n - 1)[0] for text, n in zip(texts, lengths, strict=True)]
        assert not any(below)
        generous = tokenizer.known_short(texts, 10_000)
        assert sum(generous) > len(texts) // 10  # the bound is of use: plenty of texts are known short
        assert all(n <= len(text.encode()) for text, n, short in zip(texts, lengths, generous, strict=True) if short)
    plain, with_nfc, with_nfkc = (t.known_short(["cafe\u0301", "\ufb01ne", "café"], 100) for t in tokenizers)
    assert plain == [True, True, True]
    assert with_nfc == [False, True, True]  # NFC composes the accent: the text changes
    assert with_nfkc == [False, False, True]  # NFKC also splits the ligature


def test_tokenizer_file_is_parsed_once_per_version_for_its_users_at_the_same_time(model_dir, tmp_path, monkeypatch):
    import gc
    import os
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import tokenizers

    copy = shutil.copytree(model_dir, tmp_path / "model")
    parsed = []
    from_file = tokenizers.Tokenizer.from_file
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", lambda path: parsed.append(path) or from_file(path))
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda _: ChatTokenizer(copy), range(4)))
    assert len(parsed) == 1 and all(t._backend is loaded[0]._backend for t in loaded)
    fresh = from_file(str(copy / "tokenizer.json"))
    assert loaded[0].encode_batch(["Hello there"]) == [fresh.encode("Hello there", add_special_tokens=False).ids]
    stat = os.stat(copy / "tokenizer.json")
    os.utime(copy / "tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a new version
    assert ChatTokenizer(copy)._backend is not loaded[0]._backend and len(parsed) == 2
    del loaded
    gc.collect()
    ChatTokenizer(copy)  # the last user gone, not kept: parsed again
    assert len(parsed) == 3
