"""``build_training_sample``: a rendered conversation -> token ids, loss mask, media (the contract's sample)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ingest.sft.data import MediaItem, ModalityData, RenderedTrainingSample, SFTRenderError, mm_token_type_ids
from ingest.sft.render import Renderer, check_structure


def build_training_sample(
    renderer: Renderer,
    messages: Sequence[Mapping[str, Any]],
    *,
    role_to_mask: Callable[[Mapping[str, Any]], bool] | None = None,
    tools: list | None = None,
    images: Sequence | None = None,
    videos: Sequence | None = None,
    ensure_final_stop: bool = False,
    content_sft_roles: Collection[str] | None = None,
) -> RenderedTrainingSample:
    """Token ids, loss mask and media of one conversation, as the contract says.

    loss_mask[t]: False for scaffolding (message index -1) and for tokens the model does not sample; otherwise True,
    or ``role_to_mask(message)`` when given. A renderer that cannot tell sampled tokens requires ``role_to_mask``
    (ValueError otherwise); then every token of a message the predicate selects is trained.
    ``images`` / ``videos``: values for media parts that carry none (``{"type": "image"}``), consumed in order.
    ``ensure_final_stop``: when the last message is the assistant's and its last trained token is not the stop
    token, append the stop token as a trained token.
    ``content_sft_roles``: body-only supervision (renderers' rule): for messages of these roles the loss mask is
    the content tag, whatever ``role_to_mask`` and the sampled tags say, so their text is trained and the template's
    scaffolding around it (headers, ``<|im_end|>``, ``<tool_response>`` wrappers, newlines) is not. A renderer that
    cannot tell content (the template fallback) ignores it, as renderers' opaque renderers do.
    """
    if not renderer.tells_sampled and role_to_mask is None:
        raise ValueError(
            f"{type(renderer).__name__} cannot tell which tokens the model samples; pass role_to_mask "
            "(e.g. lambda m: m['role'] == 'assistant')"
        )
    rendered = renderer.render(messages, tools=tools, images=images, videos=videos, process_media=True)
    token_ids = list(rendered.token_ids)
    selected: dict[int, bool] = {}

    def trained(j: int) -> bool:
        if j not in selected:
            selected[j] = True if role_to_mask is None else bool(role_to_mask(messages[j]))
        return selected[j]

    sampled, content = rendered.sampled, rendered.content
    body_roles = frozenset(content_sft_roles or ()) if content is not None else frozenset()
    if body_roles:
        body = [m.get("role") in body_roles for m in messages]
        loss_mask = [
            j >= 0 and (content[t] if body[j] else (sampled is None or sampled[t]) and trained(j))
            for t, j in enumerate(rendered.message_indices)
        ]
    else:
        loss_mask = [
            j >= 0 and (sampled is None or sampled[t]) and trained(j) for t, j in enumerate(rendered.message_indices)
        ]
    last = len(messages) - 1
    if ensure_final_stop and messages[last].get("role") == "assistant" and renderer.stop_token_id is not None:
        own = [t for t, j in enumerate(rendered.message_indices) if j == last and (sampled is None or sampled[t])]
        if not own or token_ids[own[-1]] != renderer.stop_token_id:
            token_ids.append(renderer.stop_token_id)
            loss_mask.append(trained(last))
    if not rendered.media:
        return RenderedTrainingSample(token_ids, loss_mask)
    data = _modality_data(rendered.media)
    types = mm_token_type_ids(len(token_ids), {m: d.placeholders for m, d in data.items()})
    return RenderedTrainingSample(token_ids, loss_mask, data, types)


def _modality_data(media: Sequence[MediaItem]) -> dict[str, ModalityData]:
    out: dict[str, ModalityData] = {}
    for item in media:
        data = out.setdefault(item.modality, ModalityData([], [], []))
        data.items.append(dict(item.outputs) if item.outputs is not None else {})
        data.hashes.append(item.hash)
        data.placeholders.append(item.placeholder)
    return out


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
