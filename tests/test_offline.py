"""The embedded tokenizer is the real Qwen vocabulary, and the fast loader renders and encodes like transformers."""

from __future__ import annotations

import pytest

from ingest.models import ChatTokenizer
from ingest.sample import gsm8k_rows


def test_offline_tokenizer_is_qwen(model_dir):
    from transformers import AutoProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"]) == [
        151643,
        151644,
        151645,
        151655,
    ]
    assert tok.pad_token_id == 151643
    processor = AutoProcessor.from_pretrained(model_dir)
    assert type(processor).__name__ == "Qwen2VLProcessor"


@pytest.fixture(scope="module")
def both_paths(model_dir):
    fast = ChatTokenizer(model_dir)
    assert fast._hf is None, "Qwen2 directory should take the tokenizer.json fast path"
    slow = ChatTokenizer.__new__(ChatTokenizer)
    slow.path = model_dir
    slow._load_transformers(model_dir, trust_remote_code=False)
    from ingest.chat_template import compile_chat_template

    slow._template = compile_chat_template(slow.chat_template)
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
