"""A prompt's hand-off payload (``ingest.rollout_media``) made with the pipeline's own kernels, with no verl,
transformers or torch in the process: image prompts of Qwen-VL models whose image processor options the kernels
implement (``ImagePixels.supports``) and no ``mm_processor_kwargs``, where transformers 5 or later is installed.
``KernelMediaMaker.make`` returns None for any other prompt (videos, audio, an item's own pixel options), which the
stage then makes with verl's functions (``PromptMediaMaker``).

The steps are verl's agent loop's, each done as the code it stands for does it (the agent-loop oracle tests compare
the result with verl's own, key by key and bit by bit):
- qwen-vl-utils' ``fetch_image``: RGB (RGBA composited on white), its ``smart_resize`` size (``fetch_image_size``),
  PIL's resize;
- the prompt ids: the processor's chat template rendered (``ChatTokenizer``), encoded, each image pad repeated to its
  grid's tokens; ``attention_mask`` ones and ``mm_token_type_ids`` 1 at the image pads (the processor's);
- ``pixel_values`` / ``image_grid_thw``: ``ImagePixels`` (torch's uint8 resize, the processor's patch order), carried
  as uint8 patches that the rollout normalizes as the processor does (``encoded_patches``).

A block's prompts are rendered one by one and encoded in one call (``make_many``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ingest.media.geometry import IMAGE_PAD, grid_tokens
from ingest.media.image import fetched_image
from ingest.media.pixels import ImagePixels
from ingest.rollout_media import encoded_image, encoded_patches, encoded_tensor, media_items
from ingest.tokenizer.chat import ChatTokenizer

# the model types whose processors these kernels stand for (verl 0.9's Qwen VL continuous-token builder, verl 0.7's
# processor path), proven by the oracle tests
KERNEL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})
# the transformers whose processors' outputs the kernels make: 5 adds mm_token_type_ids, which 4.57's lack (verl 0.7.1's
# own environment): under an older one verl's functions make the payload, as that release's processor does
KERNEL_TRANSFORMERS_MAJOR = 5


def kernels_serve_installed_transformers() -> bool:
    """Whether the installed transformers' processors give the outputs the kernels make (read from its metadata, not
    imported: the kernels' actors never import it)."""
    from ingest.installed import installed_version

    try:
        return int((installed_version("transformers") or "").split(".")[0]) >= KERNEL_TRANSFORMERS_MAJOR
    except ValueError:  # not installed, or a version that is not numbers
        return False


# an image item the kernels make: an HF Image() column's ({type, image}), or a plain {bytes, path} struct's (verl 0.9
# keeps the struct's keys beside the image as opened; fetch_image reads only "image"). An item with other keys
# (min_pixels, ...) goes to verl's functions
_PLAIN_IMAGE_ITEMS = (frozenset({"type", "image"}), frozenset({"type", "image", "bytes", "path"}))


def _model_type(model_path: str) -> str | None:
    config = Path(model_path) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


class KernelMediaMaker:
    """``PromptMediaMaker``'s payload for image prompts, made with the pipeline's kernels (``for_model`` says where
    they serve)."""

    def __init__(self, model_path: str, pixels: ImagePixels, template_kwargs: Mapping[str, Any]):
        self.pixels = pixels
        self.tokenizer = ChatTokenizer(model_path)
        self.template_kwargs = dict(template_kwargs)
        self.image_pad_id = self.tokenizer.token_id(IMAGE_PAD)

    @classmethod
    def for_model(cls, model_path: str, data: Mapping[str, Any]) -> KernelMediaMaker | None:
        """The maker for the model folder ``model_path`` and verl's ``data`` section, None where the kernels do not
        stand for its processor."""
        if _model_type(model_path) not in KERNEL_MODEL_TYPES or data.get("mm_processor_kwargs"):
            return None
        if not kernels_serve_installed_transformers():
            return None
        pixels = ImagePixels.from_dir(model_path)
        return None if pixels is None else cls(model_path, pixels, data.get("apply_chat_template_kwargs") or {})

    def make(self, messages: list[dict]) -> dict | None:
        """One prompt's payload in ``encode_payload``'s form (``made_by`` "kernels"), None where the prompt is not
        plain images (PIL images in items of no other keys)."""
        made = self.make_many([messages])[0]
        if isinstance(made, Exception):
            raise made
        return made

    def make_many(self, prompts: list[list[dict]]) -> list[dict | Exception | None]:
        """``make`` of each prompt (its error where it raised), their texts encoded in one call."""
        from PIL import Image

        def plain_images(messages: list[dict]) -> bool:
            items = media_items(messages)
            return bool(items) and all(
                item.get("type") == "image"
                and set(item) in _PLAIN_IMAGE_ITEMS
                and isinstance(item["image"], Image.Image)
                for item in items
            )

        out: list[dict | Exception | None] = [None] * len(prompts)
        texts: dict[int, str] = {}
        for i, messages in enumerate(prompts):
            if plain_images(messages):
                try:
                    texts[i] = self.tokenizer.render(messages, **self.template_kwargs)
                except Exception as exc:
                    out[i] = exc
        for i, ids in zip(texts, self.tokenizer.encode_batch(list(texts.values())), strict=True):
            try:
                out[i] = self._payload(prompts[i], ids)
            except Exception as exc:
                out[i] = exc
        return out

    def _payload(self, messages: list[dict], ids: list[int]) -> dict | None:
        spec = self.pixels.spec
        images = [fetched_image(item["image"], spec.patch_size) for item in media_items(messages)]
        if ids.count(self.image_pad_id) != len(images):
            return None  # the processor's own error names the mismatch
        pixels = [np.asarray(image) for image in images]
        patches, grids = self.pixels.patches(pixels)
        pending = iter(grids.tolist())
        expanded: list[int] = []
        for token in ids:
            expanded.extend([token] * grid_tokens(next(pending), spec) if token == self.image_pad_id else (token,))
        input_ids = np.asarray(expanded, np.int64)[None]
        mm_token_type_ids = encoded_tensor((input_ids == self.image_pad_id).astype(np.int64))
        # the patches leave the kernels' reused buffer
        pixel_values = encoded_patches(np.array(patches), *self.pixels.norm, spec.temporal_patch_size)
        image_grid_thw = encoded_tensor(np.ascontiguousarray(grids, np.int64))
        return {
            "images": [encoded_image(image, array) for image, array in zip(images, pixels, strict=True)],
            "videos": None,
            "audios": None,
            "prompt_ids": expanded,
            "prompt_inputs": {
                "attention_mask": encoded_tensor(np.ones_like(input_ids)),
                "mm_token_type_ids": mm_token_type_ids,
                "pixel_values": pixel_values,
                "image_grid_thw": image_grid_thw,
            },
            "training_inputs": {  # rollout_media.training_inputs of the above
                "mm_token_type_ids": mm_token_type_ids,
                "pixel_values": pixel_values,
                "image_grid_thw": image_grid_thw,
                "images_seqlens": encoded_tensor(np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])),
            },
            "made_by": "kernels",
        }
