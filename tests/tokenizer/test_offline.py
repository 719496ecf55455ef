"""The embedded tokenizer (``ingest/tokenizer/offline.py``) is the real Qwen vocabulary."""

from __future__ import annotations


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
