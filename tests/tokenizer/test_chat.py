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
