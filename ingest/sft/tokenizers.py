"""Loaded transformers tokenizers and processors as renderer tokenizers (what ``renderers.create_renderer`` takes).

``ChatTokenizer`` loads a tokenizer from a path or hub name; a caller that already holds a ``PreTrainedTokenizerBase``
(fast or slow) or a ``ProcessorMixin`` (what every prime-rl config builds) passes the object. ``HFChatTokenizer``
gives a renderer the same four things ``ChatTokenizer`` does: the chat template, the special tokens the template
sees, token ids by name, and an encode with character offsets. transformers itself is never imported here: an object
of one of its classes can only exist once the caller imported it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ingest.tokenizer.chat import ChatTokenizer


def is_transformers_instance(obj: object, *class_names: str) -> bool:
    """``isinstance(obj, transformers.<name>)`` for any of ``class_names``, without importing transformers."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    for name in class_names:
        try:
            cls = getattr(transformers, name)
        except Exception:  # a lazy attribute whose backend is missing
            continue
        if isinstance(obj, cls):
            return True
    return False


def is_tokenizer_object(obj: object) -> bool:
    return is_transformers_instance(obj, "PreTrainedTokenizerBase")


def is_processor_object(obj: object) -> bool:
    return is_transformers_instance(obj, "ProcessorMixin")


class HFChatTokenizer:
    """A loaded transformers tokenizer behind the interface renderers use (``ChatTokenizer``'s).

    ``chat_template``: the template to render with (a processor's own template, which can differ from its
    tokenizer's); default the tokenizer's (its default entry when it holds several named templates).
    Fast tokenizers encode with their Rust backend, as ``ChatTokenizer`` does for a loaded directory; slow (Python)
    ones encode through the object and get character offsets from decoding (see ``encode_with_offsets``).
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self._hf = tokenizer
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self.path = getattr(tokenizer, "name_or_path", "") or f"<{type(tokenizer).__name__}>"
        if chat_template is None:
            chat_template = tokenizer.chat_template
            if isinstance(chat_template, dict):  # named templates: apply_chat_template's default pick
                chat_template = tokenizer.get_chat_template()
        self.chat_template = chat_template
        # what apply_chat_template passes to the template besides the messages
        self.special_tokens_map = dict(tokenizer.special_tokens_map)
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else tokenizer.eos_token_id

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` as one vocabulary entry, None when it is not one (never the unknown token's id)."""
        if self._backend is not None:
            return self._backend.token_to_id(token)
        token_id = self._hf.convert_tokens_to_ids(token)
        unk = self._hf.unk_token
        if token_id is None or (token_id == self._hf.unk_token_id and token != unk):
            return None
        return token_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._hf(texts, add_special_tokens=False)["input_ids"]]


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of ``text`` (``tokenizer(text, add_special_tokens=False)``, what ``apply_chat_template`` encodes) and the
    character span of every token.

    A tokenizers backend gives the spans. A slow tokenizer has none, so they come from decoding (renderers' rule):
    token by token when the pieces join back to ``text``, else by decoding growing prefixes (byte-level pieces of
    one character decode only together); where neither gives ``text`` back exactly, ``ValueError``.
    """
    backend = getattr(tokenizer, "_backend", None)
    if backend is not None:
        encoding = backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets
    hf = getattr(tokenizer, "_hf", None)
    if hf is None:
        raise ValueError(f"tokenizer {tokenizer!r} can neither encode with offsets nor decode")
    ids = list(hf(text, add_special_tokens=False)["input_ids"])
    offsets = _offsets_from_decode(hf, ids, text)
    if offsets is None:
        raise ValueError(
            f"the slow tokenizer {type(hf).__name__} does not decode its tokens back to the rendered text, so its "
            "tokens cannot be attributed to messages; use its fast (tokenizers) version"
        )
    return ids, offsets


def _offsets_from_decode(hf: Any, ids: list[int], text: str) -> list[tuple[int, int]] | None:
    def decode(part: list[int]) -> str:
        return hf.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    pieces = [decode([i]) for i in ids]
    if "".join(pieces) == text:
        offsets, position = [], 0
        for piece in pieces:
            offsets.append((position, position + len(piece)))
            position += len(piece)
        return offsets
    offsets, previous = [], 0
    for end in range(1, len(ids) + 1):
        prefix = decode(ids[:end])
        if len(prefix) < previous or not text.startswith(prefix):
            return None
        offsets.append((previous, len(prefix)))
        previous = len(prefix)
    return offsets if previous == len(text) else None


def as_chat_tokenizer(tokenizer: Any, processor: Any = None, *, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """(renderer tokenizer, processor) for what ``create_renderer`` accepts.

    ``tokenizer``: a ``ChatTokenizer``; a path, hub name or ``embedded:qwen2-vl`` (None: embedded); a loaded
    ``PreTrainedTokenizerBase`` (fast or slow); or a ``ProcessorMixin``, whose tokenizer encodes, whose chat template
    renders and which processes the media unless ``processor`` is given.
    """
    if isinstance(tokenizer, ChatTokenizer | HFChatTokenizer):
        return tokenizer, processor
    if tokenizer is None or isinstance(tokenizer, str | os.PathLike):
        return ChatTokenizer(tokenizer, trust_remote_code=trust_remote_code), processor
    if is_processor_object(tokenizer):
        inner = getattr(tokenizer, "tokenizer", None)
        if inner is None:
            raise TypeError(f"the processor {type(tokenizer).__name__} has no tokenizer")
        template = getattr(tokenizer, "chat_template", None) or None
        return HFChatTokenizer(inner, template), tokenizer if processor is None else processor
    if is_tokenizer_object(tokenizer):
        return HFChatTokenizer(tokenizer), processor
    raise TypeError(
        "tokenizer must be a path, a hub name, a ChatTokenizer, a transformers tokenizer (PreTrainedTokenizerBase) "
        f"or processor (ProcessorMixin), got {type(tokenizer).__name__}"
    )
