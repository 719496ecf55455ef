"""Tokenizers without the hub: the chat tokenizer (tokenizers + the Jinja chat template), the offline Qwen2-VL model."""
