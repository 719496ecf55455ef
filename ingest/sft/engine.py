"""The renderers package as the SFT engine: one renderer per actor, renderers' own ``build_training_sample`` per row.

What the pipeline adds around it (reading, media columns, truncation, packing, accounting) lives in
``ingest.stages.sft``; this module only turns a row's values into renderers' call and back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

MIN_PYTHON = (3, 11)  # renderers' own floor


def import_renderers():
    """The ``renderers`` module, or one ImportError line that says what to install."""
    if sys.version_info < MIN_PYTHON:
        raise ImportError(
            "SFT samples are built by the renderers package, which needs Python 3.11 or newer; this is Python "
            f"{sys.version_info[0]}.{sys.version_info[1]}"
        )
    try:
        import renderers
    except ImportError as exc:
        raise ImportError(
            f"SFT samples are built by the renderers package, which does not import here ({exc}): "
            "pip install 'ray-ingest[sft]'"
        ) from None
    return renderers


def renderer_config(renderer: Any) -> Any:
    """The renderers config of ``renderer``: a renderers config (``Qwen3RendererConfig()``, ...) as it is, a renderer
    made by ``renderers.create_renderer`` its ``config``, None as None (``create_renderer``'s own choice)."""
    renderers = import_renderers()
    if renderer is None or isinstance(renderer, renderers.BaseRendererConfig):
        return renderer
    config = getattr(renderer, "config", None)
    if callable(getattr(renderer, "render", None)) and isinstance(config, renderers.BaseRendererConfig):
        return config
    raise TypeError(
        f"renderer must be a renderers config or a renderer made by renderers.create_renderer, got "
        f"{type(renderer).__name__}"
    )


# a conversation every renderer renders: what the driver-side checks render
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def check_role_to_mask(renderer: Any, role_to_mask: Callable | None) -> None:
    """A renderer that does not tell sampled tokens (renderers' default renderer) needs ``role_to_mask``: say so once
    on the driver, in renderers' words, rather than in every row's quarantine record."""
    if role_to_mask is not None:
        return
    rendered = renderer.render(PROBE)
    if len(rendered.sampled_mask) != len(rendered.token_ids):
        raise ValueError(
            f"{type(renderer).__name__} does not populate sampled_mask: renderers' build_training_sample needs "
            "role_to_mask with it (e.g. a function returning message['role'] == 'assistant'); pass role_to_mask "
            "to build_sft_dataset"
        )


class SampleBuilder:
    """renderers' ``build_training_sample`` with one renderer and the caller's keyword arguments.

    ``tokenizer``: a loaded transformers tokenizer; a multimodal renderer loads its processor from the tokenizer's
    directory (renderers' rule). ``config``: a renderers config (``renderer_config``).
    """

    def __init__(
        self,
        tokenizer: Any,
        config: Any,
        *,
        role_to_mask: Callable[[Mapping[str, Any]], bool] | None = None,
        content_sft_roles: Collection[str] | None = None,
        ensure_final_stop: bool = False,
    ):
        self.renderers = import_renderers()
        self.renderer = self.renderers.create_renderer(tokenizer, config)
        self.kwargs = {
            "role_to_mask": role_to_mask,
            "content_sft_roles": frozenset(content_sft_roles) if content_sft_roles else None,
            "ensure_final_stop": ensure_final_stop,
        }

    def __call__(self, messages: list[dict], *, tools: list | None = None, message_loss_mask: list | None = None):
        """renderers' ``RenderedTrainingSample`` of one conversation (media parts hold their values:
        ``attach_media``)."""
        return self.renderers.build_training_sample(
            self.renderer, messages, tools=tools, message_loss_mask=message_loss_mask, **self.kwargs
        )


def attach_media(messages: list[dict], media: Mapping[str, Sequence[Any]]) -> list[dict]:
    """The k-th image (video) part without a value of its own (``{"type": "image"}``, as verl's ``<image>`` markers
    split) gets the k-th value of ``media["image"]`` (``media["video"]``), as renderers' parts hold it
    (``{"type": "image", "image": bytes}``)."""
    remaining = {modality: iter(values) for modality, values in media.items()}
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                modality = part.get("type") if isinstance(part, dict) else None
                if modality in remaining and part.get(modality) is None:
                    value = next(remaining[modality], None)
                    if value is None:
                        raise ValueError(f"the conversation has more {modality} parts than the row has {modality}s")
                    part = {**part, modality: value}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    for modality, values in remaining.items():
        if next(values, None) is not None:
            raise ValueError(f"the row has more {modality}s than the conversation has {modality} parts")
    return out
