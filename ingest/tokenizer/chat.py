"""Loading a tokenizer inside an actor, and the two things the pipeline needs from it: render and encode.

``ChatTokenizer`` renders a chat with the model's Jinja template (transformers' own renderer, with the same variables
``apply_chat_template`` passes) and encodes a whole batch in one call to the Rust backend. For plain BPE tokenizers
(Qwen2 and other ``tokenizer.json`` models whose class adds no Python-side behaviour) it loads ``tokenizer.json``
directly: faster to load and call than ``AutoTokenizer`` (docs/design.md), and the ids are the same. Anything else goes
through ``AutoTokenizer``.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import weakref
from pathlib import Path

from ingest.errors import ModelLoadError
from ingest.tokenizer.offline import resolve_model_path
from ingest.tokenizer.template import compile_chat_template, qwen2_vl_text_renderer, render_chat

# Normalizers that leave ASCII text as it is, and pre-tokenizers that only split it (ByteLevel: without a prefix space)
_ASCII_KEEPING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Digits", "Punctuation", "ByteLevel"})
# Tokenizer classes that are exactly "tokenizer.json + special tokens + chat template".
_PLAIN_FAST_CLASSES = frozenset(
    {"Qwen2Tokenizer", "Qwen2TokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend"}
)
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _ParsedFile:
    """One parsed ``tokenizer.json``, held by the ``ChatTokenizer`` objects using it: the cache refers to it weakly (a
    ``tokenizers.Tokenizer`` of 0.22, which verl's pinned environments have, cannot be referenced weakly itself)."""

    __slots__ = ("tokenizer", "__weakref__")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


# parsed tokenizer.json files in use in this process, by file version; freed with their last user
_parsed_files: weakref.WeakValueDictionary[tuple, _ParsedFile] = weakref.WeakValueDictionary()
_parsing = threading.Lock()


def _parsed_tokenizer_file(path: Path) -> _ParsedFile:
    """``tokenizers.Tokenizer.from_file(path)``, shared by the stages that use one file version at the same time (an
    epoch's count on a thread per core): a parse takes about a second of CPU and ~70 MiB. Nothing here changes a
    backend, and its encode takes no lock. Not kept after its last user: a driver's tokenizer would then stay in memory
    for the whole epoch."""
    from tokenizers import Tokenizer

    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _parsing:  # threads starting together parse the file once
        parsed = _parsed_files.get(key)
        if parsed is None:
            parsed = _parsed_files[key] = _ParsedFile(Tokenizer.from_file(str(path)))
        return parsed


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class ChatTokenizer:
    """Chat template + batched encode, loaded once per actor from a directory or hub name."""

    def __init__(self, name_or_path: str | os.PathLike | None, *, trust_remote_code: bool = False):
        path = resolve_model_path(name_or_path)
        self.path = path
        try:
            if not self._load_plain(Path(path)):
                self._load_transformers(path, trust_remote_code)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"cannot load tokenizer {path!r}: {type(exc).__name__}: {exc}") from None
        if self.chat_template is None:
            raise ModelLoadError(f"tokenizer {path!r} has no chat template")
        self._template = compile_chat_template(self.chat_template)
        self._fast_render = qwen2_vl_text_renderer(self.chat_template)
        self._other_templates: dict = {}  # apply_chat_template_kwargs' chat_template, compiled once

    def _load_plain(self, path: Path) -> bool:
        config_file, tokenizer_file = path / "tokenizer_config.json", path / "tokenizer.json"
        if not (config_file.is_file() and tokenizer_file.is_file()):
            return False
        config = json.loads(config_file.read_text())
        if config.get("tokenizer_class") not in _PLAIN_FAST_CLASSES or config.get("auto_map"):
            return False
        self._parsed = _parsed_tokenizer_file(tokenizer_file)  # kept while this object lives
        self._backend = self._parsed.tokenizer
        self._hf = None
        self.special_tokens_map = {
            key: _token_content(config[key]) for key in _SPECIAL_TOKEN_KEYS if config.get(key) is not None
        }
        template = config.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if template is None and (path / "chat_template.json").is_file():
            template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        self.chat_template = template
        pad = self.special_tokens_map.get("pad_token") or self.special_tokens_map.get("eos_token")
        self.pad_token_id = self._backend.token_to_id(pad) if pad is not None else None
        return True

    def _load_transformers(self, path: str, trust_remote_code: bool) -> None:
        from transformers import AutoTokenizer

        self._hf = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self._backend = getattr(self._hf, "_tokenizer", None)
        self.special_tokens_map = dict(self._hf.special_tokens_map)
        self.chat_template = self._hf.chat_template
        # verl's hf_tokenizer() sets pad to eos when a tokenizer has none
        self.pad_token_id = self._hf.pad_token_id if self._hf.pad_token_id is not None else self._hf.eos_token_id

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **template_kwargs) -> str:
        """``apply_chat_template(messages, tokenize=False, **template_kwargs)`` as transformers 4.x did it (messages
        as given; ``template_kwargs``: verl's ``apply_chat_template_kwargs``, the template's own variables, or
        ``chat_template`` to render with another template)."""
        if self._fast_render is not None and not template_kwargs:
            text = self._fast_render(messages, add_generation_prompt)
            if text is not None:
                return text
        template, template_kwargs = self._template, dict(template_kwargs)
        tools = template_kwargs.pop("tools", None)
        if "chat_template" in template_kwargs:
            source = template_kwargs.pop("chat_template")
            if source not in self._other_templates:
                self._other_templates[source] = compile_chat_template(source)
            template = self._other_templates[source]
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens={**self.special_tokens_map, **template_kwargs},
            tools=tools,
        )

    def token_id(self, token: str) -> int | None:
        if self._backend is not None:
            return self._backend.token_to_id(token)
        return self._hf.convert_tokens_to_ids(token)

    @functools.cached_property
    def ascii_ids_at_most_chars(self) -> bool:
        """Whether an ASCII text never encodes to more ids than it has characters, so a prompt that is short in
        characters is short in ids without encoding it: a byte-level BPE (every id stands for at least one byte of the
        text, special tokens too) loaded from ``tokenizer.json``, whose normalizer leaves ASCII unchanged and whose
        pre-tokenizers only split (no prefix space)."""
        if self._hf is not None or self._backend is None or type(self._backend.model).__name__ != "BPE":
            return False

        def parts(component, key: str) -> list[dict]:
            if component is None:
                return []
            state = json.loads(component.__getstate__())
            return state[key] if state.get("type") == "Sequence" else [state]

        normalizers = parts(self._backend.normalizer, "normalizers")
        pre_tokenizers = parts(self._backend.pre_tokenizer, "pretokenizers")
        byte_level = [p for p in pre_tokenizers if p.get("type") == "ByteLevel"]
        return (
            all(n.get("type") in _ASCII_KEEPING_NORMALIZERS for n in normalizers)
            and all(p.get("type") in _SPLITTING_PRE_TOKENIZERS for p in pre_tokenizers)
            and bool(byte_level)
            and not any(p.get("add_prefix_space") for p in byte_level)
        )

    def known_short(self, texts: list[str], limit: int) -> list[bool]:
        """Per text: whether it encodes to at most ``limit`` ids, known without encoding it. Where
        ``ascii_ids_at_most_chars`` holds, every id stands for at least one byte of the normalized text between the
        special tokens (each of those one id, at least one byte): an ASCII text has no more ids than characters, and
        so has any text its normalizer leaves as it is (then so are the pieces it normalizes) no more than UTF-8
        bytes. False where not known (any text of other tokenizers)."""
        if not self.ascii_ids_at_most_chars:
            return [False] * len(texts)
        normalizer = self._backend.normalizer

        def short(text: str) -> bool:
            if len(text) > limit:  # characters <= bytes
                return False
            if text.isascii():
                return True
            return len(text.encode()) <= limit and (normalizer is None or normalizer.normalize_str(text) == text)

        return [short(text) for text in texts]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``tokenizer(text, add_special_tokens=False)["input_ids"]`` for every text, in one backend call."""
        if self._backend is not None:
            # encode_batch_fast (tokenizers >= 0.21): the same ids without computing character offsets
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            return [enc.ids for enc in encode(texts, add_special_tokens=False)]
        return self._hf(texts, add_special_tokens=False)["input_ids"]
