"""The embedded tokenizer is the real Qwen vocabulary, and the fast loader renders and encodes like transformers."""

from __future__ import annotations

import pytest

from ingest.demo import gsm8k_rows
from ingest.tokenizer.chat import ChatTokenizer


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


def test_plain_python_qwen2_vl_renderer_equals_jinja():
    """The Python renderer of the embedded template gives Jinja's exact text, or None where it does not apply."""
    import random

    from ingest.tokenizer.offline import QWEN2_VL_CHAT_TEMPLATE
    from ingest.tokenizer.template import compile_chat_template, qwen2_vl_text_renderer, render_chat

    fast = qwen2_vl_text_renderer(QWEN2_VL_CHAT_TEMPLATE)
    jinja = compile_chat_template(QWEN2_VL_CHAT_TEMPLATE)
    rng = random.Random(5)
    pieces = ["", " ", "\n", "hi", "{{ x }}", "{% if %}", "<|im_end|>", "<image>", "日本語 🤖", "\t  \n\n", "None"]
    roles = ["system", "user", "assistant", "tool", "System", "ipython", ""]
    for _ in range(400):
        messages = [
            {"role": rng.choice(roles), "content": "".join(rng.choices(pieces, k=rng.randint(0, 5)))}
            for _ in range(rng.randint(1, 5))
        ]
        if rng.random() < 0.3:
            messages[0]["extra"] = None  # Arrow struct rows carry every field
        for generation in (True, False):
            expected = render_chat(jinja, messages, add_generation_prompt=generation, special_tokens={})
            assert fast(messages, generation) == expected, messages
    # content lists (after the <image> split) and non-strings are left to Jinja
    assert fast([{"role": "user", "content": [{"type": "text", "text": "x"}]}], True) is None
    assert fast([{"role": "user", "content": None}], True) is None
    assert qwen2_vl_text_renderer(QWEN2_VL_CHAT_TEMPLATE + " ") is None
