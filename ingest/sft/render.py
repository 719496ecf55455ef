"""Renderers: one template render, one encode with character offsets, per-token tags; media pads expanded.

``ChatMLRenderer`` tags from the ChatML turn structure (sampled = assistant body + ``<|im_end|>``);
``TemplateRenderer`` (any template) attributes characters to messages by prefix rendering and cannot tell sampled
tokens. ``create_renderer`` picks one by probing the template.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ingest.sft.data import MediaItem, PlaceholderRange, RenderedConversation, SFTRenderError
from ingest.sft.media import PAD_TOKENS, MediaProcessor, media_values, part_modality
from ingest.sft.tokenizers import HFChatTokenizer, as_chat_tokenizer, encode_with_offsets
from ingest.tokenizer.chat import ChatTokenizer
from ingest.tokenizer.template import compile_chat_template, render_chat

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


@runtime_checkable
class Renderer(Protocol):
    """Turns a conversation into tagged token ids in one pass."""

    tokenizer: ChatTokenizer | HFChatTokenizer
    tells_sampled: bool  # False: build_training_sample needs role_to_mask
    stop_token_id: int | None  # the turn-closing token ensure_final_stop appends

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list | None = None,
        images: Sequence | None = None,
        videos: Sequence | None = None,
        process_media: bool = True,
    ) -> RenderedConversation: ...


class _TemplateBase:
    tells_sampled = False

    def __init__(
        self,
        tokenizer: ChatTokenizer | HFChatTokenizer,
        media: MediaProcessor | None = None,
        chat_template: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.media = media
        self.chat_template = chat_template or tokenizer.chat_template
        if not self.chat_template:
            raise ValueError(f"tokenizer {tokenizer.path!r} has no chat template")
        self._template = compile_chat_template(self.chat_template)
        eos = tokenizer.special_tokens_map.get("eos_token")
        self.stop_token_id = tokenizer.token_id(eos) if eos else None
        self._pad_ids = {m: tokenizer.token_id(t) for m, t in PAD_TOKENS.items()}

    def render_text(self, messages: Sequence[Mapping[str, Any]], tools: list | None = None) -> str:
        """``apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)``."""
        return render_chat(
            self._template,
            list(messages),
            add_generation_prompt=False,
            special_tokens=self.tokenizer.special_tokens_map,
            tools=tools,
        )

    def _char_tags(self, text: str, messages: Sequence[Mapping[str, Any]], tools: list | None):
        raise NotImplementedError

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list | None = None,
        images: Sequence | None = None,
        videos: Sequence | None = None,
        process_media: bool = True,
    ) -> RenderedConversation:
        check_structure(messages)
        messages = template_messages(messages)
        values = media_values(messages, images, videos)
        if any(values.values()) and self.media is None:
            raise SFTRenderError("the conversation has images or videos but the renderer has no processor")
        try:
            text = self.render_text(messages, tools)
        except Exception as exc:
            raise SFTRenderError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        idx_c, sampled_c, content_c = self._char_tags(text, messages, tools)
        ids, offsets = encode_with_offsets(self.tokenizer, text)
        idx, sampled, content = _token_tags(offsets, idx_c, sampled_c, content_c)
        ids_arr = np.asarray(ids, dtype=np.int64)
        media: list[MediaItem] = []
        if any(values.values()):
            ids_arr, idx, sampled, content, media = self._expand(ids_arr, idx, sampled, content, values, process_media)
        return RenderedConversation(
            token_ids=ids_arr.tolist(),
            message_indices=idx.tolist(),
            sampled=None if sampled is None else sampled.tolist(),
            content=None if content is None else content.tolist(),
            media=media,
            text=text,
        )

    def _expand(self, ids, idx, sampled, content, values, process_media):
        """Repeat each media pad token to its grid's token count; pads are never sampled."""
        loaded = self.media.load(values, process_media)
        counts = np.ones(len(ids), dtype=np.int64)
        where: list[tuple[int, str, int]] = []  # (unexpanded position, modality, item)
        for modality, items in loaded.items():
            pad_id = self._pad_ids[modality]
            positions = np.flatnonzero(ids == pad_id) if pad_id is not None else np.array([], dtype=np.int64)
            if len(positions) != len(items):
                raise SFTRenderError(
                    f"the template rendered {len(positions)} {modality} placeholders for {len(items)} {modality}s"
                )
            for k, (pos, item) in enumerate(zip(positions.tolist(), items, strict=True)):
                counts[pos] = item.tokens
                where.append((pos, modality, k))
        starts = np.cumsum(counts) - counts
        ids = np.repeat(ids, counts)
        idx = np.repeat(idx, counts)
        content = None if content is None else np.repeat(content, counts)
        sampled = None if sampled is None else np.repeat(sampled, counts)
        media = []
        for pos, modality, k in sorted(where):
            item = loaded[modality][k]
            placeholder = PlaceholderRange(int(starts[pos]), int(counts[pos]))
            if sampled is not None:
                sampled[placeholder.offset : placeholder.offset + placeholder.length] = False
            media.append(MediaItem(modality, placeholder, item.grid, item.hash, item.outputs, item.data))
        return ids, idx, sampled, content, media


class ChatMLRenderer(_TemplateBase):
    """ChatML templates: tags from the ``<|im_start|>role\\n ... <|im_end|>`` turn structure of one render.

    Turns are matched to messages in order; a leading system turn the template adds when the conversation has no
    system message is scaffolding (-1); a run of consecutive tool messages may share one turn (Qwen2.5 / Qwen3 wrap
    them in one ``user`` turn). Sampled: body and ``<|im_end|>`` of assistant turns (never the header nor the
    newline after ``<|im_end|>``). Content: on assistant turns the sampled tokens (body and ``<|im_end|>``, as
    renderers tags them); on other turns the message's own text and media pads inside the body (not the wrappers a
    template adds there). Headers and newlines between turns carry their message's index but are not content.
    """

    tells_sampled = True

    def __init__(
        self,
        tokenizer: ChatTokenizer | HFChatTokenizer,
        media: MediaProcessor | None = None,
        chat_template: str | None = None,
    ):
        super().__init__(tokenizer, media, chat_template)
        if tokenizer.token_id(IM_START) is None or tokenizer.token_id(IM_END) is None:
            raise ValueError("the tokenizer has no <|im_start|> / <|im_end|> tokens: not a ChatML tokenizer")
        self.stop_token_id = tokenizer.token_id(IM_END)

    def _char_tags(self, text, messages, tools):
        n = len(text)
        idx = np.full(n, -1, dtype=np.int32)
        sampled = np.zeros(n, dtype=bool)
        content = np.zeros(n, dtype=bool)
        turns = _chatml_turns(text)
        owners = _align_turns(turns, messages)
        for turn, owned in zip(turns, owners, strict=True):
            if not owned:
                continue
            if turn.role == "assistant":
                # renderers' rule: on assistant tokens content equals sampled (body + <|im_end|>), so body-only
                # supervision of the assistant is its sampled tokens
                sampled[turn.body_start : turn.close_end] = True
                content[turn.body_start : turn.close_end] = True
            if len(owned) == 1:
                idx[turn.start : turn.next_start] = owned[0]
                if turn.role != "assistant":
                    _mark_content(content, text, messages[owned[0]], turn.body_start, turn.body_end)
                continue
            # several tool messages in one turn: split at the end of each message's text in the body
            bounds, cursor = [turn.start], turn.body_start
            for j in owned[:-1]:
                body = messages[j].get("content")
                found = text.find(body, cursor, turn.body_end) if isinstance(body, str) and body else -1
                if found < 0:
                    bounds = None
                    break
                cursor = found + len(body)
                bounds.append(cursor)
            if bounds is None:
                idx[turn.start : turn.next_start] = owned[0]
                content[turn.body_start : turn.body_end] = True
                continue
            bounds.append(turn.next_start)
            for j, (a, b) in zip(owned, zip(bounds[:-1], bounds[1:], strict=True), strict=True):
                idx[a:b] = j
                _mark_content(content, text, messages[j], max(a, turn.body_start), min(b, turn.body_end))
        return idx, sampled, content


def _mark_content(content: np.ndarray, text: str, message: Mapping[str, Any], start: int, end: int) -> None:
    """Content of a non-assistant message: the characters of its own text (and media pads) inside its turn's body,
    found in order; the wrappers a template adds around them (``<tool_response>``, a tools prompt around a system
    message) stay scaffolding, as renderers tags them. A piece not found in order (the template transformed it)
    makes the whole body content."""
    value = message.get("content")
    if isinstance(value, str):
        pieces = [value]
    elif isinstance(value, list):
        pieces = []
        for part in value:
            if not isinstance(part, Mapping):
                continue
            modality = part_modality(part)
            if modality is not None:
                pieces.append(PAD_TOKENS[modality])
            elif isinstance(part.get("text"), str):
                pieces.append(part["text"])
    else:
        pieces = []
    spans, cursor = [], start
    for piece in pieces:
        if not piece:
            continue
        found = text.find(piece, cursor, end)
        if found < 0:
            content[start:end] = True
            return
        spans.append((found, found + len(piece)))
        cursor = found + len(piece)
    for a, b in spans:
        content[a:b] = True


class TemplateRenderer(_TemplateBase):
    """Any chat template: character ownership by prefix rendering, no sampled / content tags.

    Message k owns the characters the full render gains over the longest common prefix with the render of
    ``messages[:k]`` (running maximum over k); characters the empty conversation already renders are -1. Exact for
    prefix-stable templates; where a template rewrites earlier turns (Qwen3 drops past thinking) characters are
    attributed to a later message, never an earlier one. Costs one render per message.
    """

    tells_sampled = False

    def _char_tags(self, text, messages, tools):
        bounds = []
        for k in range(len(messages)):
            try:
                prefix = self.render_text(messages[:k], tools)
            except Exception:
                prefix = ""
            common = len(os.path.commonprefix([prefix, text]))
            bounds.append(max(common, bounds[-1]) if bounds else common)
        bounds.append(len(text))
        idx = np.full(len(text), -1, dtype=np.int32)
        for k in range(len(messages)):
            idx[bounds[k] : max(bounds[k], bounds[k + 1])] = k
        return idx, None, None


def create_renderer(
    tokenizer: Any,
    processor: str | os.PathLike | Any | None = None,
    *,
    chat_template: str | None = None,
    kind: str = "auto",
) -> Renderer:
    """The renderer for a tokenizer: ``ChatMLRenderer`` when the template renders ChatML turns, else the fallback.

    ``tokenizer``: what renderers' ``create_renderer`` takes, a loaded transformers tokenizer
    (``PreTrainedTokenizerBase``, fast or slow) or processor (``ProcessorMixin``: its tokenizer, its chat template
    and, unless ``processor`` is given, its media processing); or a model directory, hub name,
    ``embedded:qwen2-vl`` (None = embedded), or a loaded ``ChatTokenizer``. ``processor``: None (text only), a
    processor directory / name, or a loaded transformers processor (``Qwen2VLProcessor``) or image processor.
    ``chat_template`` overrides the tokenizer's template. ``kind``: ``auto``, ``chatml`` or ``template``.
    """
    tokenizer, processor = as_chat_tokenizer(tokenizer, processor)
    media = MediaProcessor(processor) if processor is not None else None
    if kind not in ("auto", "chatml", "template"):
        raise ValueError(f"kind must be 'auto', 'chatml' or 'template', got {kind!r}")
    if kind == "template":
        return TemplateRenderer(tokenizer, media, chat_template)
    if kind == "chatml":
        return ChatMLRenderer(tokenizer, media, chat_template)
    try:
        chatml = ChatMLRenderer(tokenizer, media, chat_template)
        if _renders_chatml(chatml):
            return chatml
    except ValueError:
        pass
    return TemplateRenderer(tokenizer, media, chat_template)


def _renders_chatml(renderer: ChatMLRenderer) -> bool:
    probes = [
        [{"role": "user", "content": "Ping?"}, {"role": "assistant", "content": "Pong."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Ping?"},
            {"role": "assistant", "content": "Pong."},
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "Pong!"},
        ],
    ]
    try:
        for messages in probes:
            text = renderer.render_text(messages)
            idx, sampled, _ = renderer._char_tags(text, messages, None)
            last = len(messages) - 1
            trained = "".join(c for c, s, i in zip(text, sampled, idx, strict=True) if s and i == last)
            if not trained.endswith(messages[last]["content"] + IM_END):
                return False
    except Exception:
        return False
    return True


# --- internals: ChatML structure ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Turn:
    role: str
    start: int  # <|im_start|>
    body_start: int  # after "role\n"
    body_end: int  # <|im_end|>
    close_end: int  # after <|im_end|>
    next_start: int  # next <|im_start|> or end of text (the newline between turns is this turn's scaffolding)


_IM_START_RE = re.compile(re.escape(IM_START))


def _chatml_turns(text: str) -> list[_Turn]:
    starts = [m.start() for m in _IM_START_RE.finditer(text)]
    turns = []
    for k, start in enumerate(starts):
        nxt = starts[k + 1] if k + 1 < len(starts) else len(text)
        head = start + len(IM_START)
        end = text.find(IM_END, head, nxt)
        if end < 0:
            raise SFTRenderError(f"unterminated ChatML turn at character {start} of the rendered text")
        newline = text.find("\n", head, end)
        body_start = end if newline < 0 else newline + 1
        role = text[head : end if newline < 0 else newline]
        close_end = end + len(IM_END)
        if text[close_end:nxt].strip():
            raise SFTRenderError(
                f"text after the <|im_end|> of a {role!r} turn: a message contains a literal <|im_end|> "
                "or the template is not plain ChatML"
            )
        turns.append(_Turn(role, start, body_start, end, close_end, nxt))
    return turns


def _align_turns(turns: list[_Turn], messages: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Message indices per turn ([] for a template-added turn)."""
    roles = [m["role"] for m in messages]
    owners: list[list[int]] = []
    rest = turns
    if turns and turns[0].role == "system" and (not roles or roles[0] != "system"):
        owners.append([])
        rest = turns[1:]
    groups: list[list[int]] = []
    for j, role in enumerate(roles):
        if role == "tool" and groups and roles[groups[-1][-1]] == "tool":
            groups[-1].append(j)
        else:
            groups.append([j])
    if len(rest) == len(roles):
        assigned = [[j] for j in range(len(roles))]
    elif len(rest) == len(groups):
        assigned = groups
    else:
        raise SFTRenderError(
            f"the template rendered {len(rest)} ChatML turns for {len(roles)} messages; cannot align them "
            "(use create_renderer(..., kind='template'))"
        )
    for turn, owned in zip(rest, assigned, strict=True):
        for j in owned:
            if roles[j] in ("system", "user", "assistant") and turn.role != roles[j]:
                raise SFTRenderError(f"message {j} ({roles[j]}) was rendered as a {turn.role!r} turn")
    return owners + assigned


# --- internals: tokens ------------------------------------------------------------------------------------------------


def _token_tags(offsets, idx_c: np.ndarray, sampled_c: np.ndarray | None, content_c: np.ndarray | None):
    """Character tags -> token tags. A token inside one tagged region takes its tags; a token straddling regions
    (a body starting with a newline merges with the header's) takes those of its first character of highest
    priority (sampled > content > scaffolding), or of its last character when the renderer has no priorities."""
    n_tokens, n_chars = len(offsets), len(idx_c)
    if n_tokens == 0 or n_chars == 0:
        empty = np.zeros(n_tokens, dtype=bool)
        return (
            np.full(n_tokens, -1, dtype=np.int32),
            None if sampled_c is None else empty,
            None if content_c is None else empty.copy(),
        )
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    start = np.clip(off[:, 0], 0, n_chars - 1)
    end = np.clip(np.maximum(off[:, 1], start + 1), 1, n_chars)
    last = end - 1
    change = np.zeros(n_chars, dtype=bool)
    change[1:] = idx_c[1:] != idx_c[:-1]
    priority = None
    if sampled_c is not None:
        priority = sampled_c.astype(np.int8) * 2 + (content_c.astype(np.int8) if content_c is not None else 0)
        change[1:] |= priority[1:] != priority[:-1]
    region = np.cumsum(change)
    rep = last.copy()
    if priority is not None:
        for k in np.flatnonzero(region[start] != region[last]).tolist():
            rep[k] = start[k] + int(np.argmax(priority[start[k] : end[k]]))
    return (
        idx_c[rep],
        None if sampled_c is None else sampled_c[rep],
        None if content_c is None else content_c[rep],
    )


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages as the chat template should see them.

    - Keys whose value is None are dropped from each message, as transformers 5's ``apply_chat_template`` does: an
      OpenAI assistant turn ``{"content": None, "tool_calls": [...]}`` then renders as the template renders a turn
      without content, instead of failing on ``None``.
    - In list content, None-valued keys of each part are dropped (renderers' rule): ``{"type": "text", "text": ...,
      "image": None}``, the shape every part of a Parquet struct column has, is a text part, not an image.

    Nothing deeper is touched: a null inside tool-call arguments is data and renders as ``null``. Messages that need
    no change are passed as they are (no copy).
    """
    out = []
    for message in messages:
        if any(v is None for v in message.values()):
            message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(p, Mapping) and any(v is None for v in p.values()) for p in content
        ):
            parts = [{k: v for k, v in p.items() if v is not None} if isinstance(p, Mapping) else p for p in content]
            message = {**message, "content": parts}
        out.append(message)
    return out


def check_structure(messages: object) -> None:
    """Raise ``SFTRenderError`` unless ``messages`` is a non-empty list of dicts with a ``role`` string."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise SFTRenderError(f"messages must be a list of chat messages, got {type(messages).__name__}")
    if not messages:
        raise SFTRenderError("messages is an empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise SFTRenderError(f"message {i} must be a dict with 'role', got {type(message).__name__}")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise SFTRenderError(f"message {i} has no 'role' string")
