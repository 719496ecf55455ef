"""Chat messages as verl 0.5.0 builds them (``RLHFDataset._build_messages``), with validation that names the row."""

from __future__ import annotations

import re
from collections.abc import Mapping

_MEDIA_SPLIT = re.compile("(<image>|<video>)")


def validate_messages(messages: object) -> str | None:
    """Why ``messages`` is not a usable chat (a non-empty list of ``{role: str, content: str|list}``), or None."""
    if not isinstance(messages, list):
        return f"prompt must be a list of chat messages, got {type(messages).__name__}"
    if not messages:
        return "prompt is an empty message list"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}"
        role = message.get("role")
        if not isinstance(role, str) or not role:
            return f"message {i} has no 'role' string"
        content = message.get("content")
        if not isinstance(content, str | list):
            return f"message {i} ({role}) has content {type(content).__name__}, expected a string"
    return None


def split_media_placeholders(messages: list[dict]) -> list[dict]:
    """verl's split of every string content on ``<image>`` / ``<video>`` into typed content items (in place)."""
    for message in messages:
        content = message["content"]
        items = []
        for segment in _MEDIA_SPLIT.split(content):
            if segment == "":
                continue
            if segment == "<image>":
                items.append({"type": "image"})
            elif segment == "<video>":
                items.append({"type": "video"})
            else:
                items.append({"type": "text", "text": segment})
        message["content"] = items
    return messages


def build_messages(messages: list[dict], *, has_media_column: bool) -> list[dict]:
    """verl 0.5.0 ``_build_messages``: the split happens whenever the image or video column exists in the row."""
    return split_media_placeholders(messages) if has_media_column else messages
