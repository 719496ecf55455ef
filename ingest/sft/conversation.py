"""The pipeline's checks of a conversation before renderers renders it: what no renderer can train on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class SFTRenderError(ValueError):
    """A row that cannot become a training sample (bad row: quarantine or raise)."""


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


def conversation_problem(messages: object) -> str | None:
    """Why ``messages`` is not a trainable conversation, or None: not a message list, empty, no assistant turn, a
    tool message without a matching call of the assistant before it."""
    try:
        check_structure(messages)
    except SFTRenderError as exc:
        return str(exc)
    if not any(m["role"] == "assistant" for m in messages):
        return "conversation has no assistant turn"
    open_calls: list = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant":
            open_calls = [_call_id(c) for c in message.get("tool_calls") or []]
        elif role == "tool":
            if not open_calls:
                return f"message {i} (tool) answers no open tool call"
            call_id = message.get("tool_call_id")
            if call_id is not None and None not in open_calls and call_id not in open_calls:
                return f"message {i} (tool) answers tool call {call_id!r}, which the assistant did not make"
            open_calls.remove(call_id if call_id in open_calls else open_calls[0])
    return None


def _call_id(call) -> object:
    return call.get("id") if isinstance(call, Mapping) else None
