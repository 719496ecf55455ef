"""The verl 0.7 and 0.9 rows: ``raw_prompt``, the chat whose ``<image>`` / ``<video>`` placeholders are replaced by
content items carrying the media (``RLHFDataset._build_messages``), and no ids: the rollout's agent loop tokenizes and
processes the media. The two releases build the same items from the same media; ``RawPromptDialect`` holds where
they part (which media values they take, what their overlong filter measures).

Blocks carry the messages as JSON with ``{"type": "image"}`` items where a decoded image goes; the consumer puts the
RGB PIL image in (``fill_images``), so pixels travel as plain Arrow, never as pickled images. An image column that
HF datasets reads as plain ``{bytes, path}`` dicts (no ``Image()`` feature in the file's metadata) gives verl 0.9.1
``{"type": "image", **struct, "image": Image.open(BytesIO(struct["bytes"]))}``: the struct's keys in its order, the
PIL image as opened (not converted). Those items travel with ``bytes`` and ``image`` null, the bytes in an Arrow
column of their own, and the consumer opens them (``fill_struct_images``).
"""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Iterator, Mapping


@dataclasses.dataclass(frozen=True)
class RawPromptDialect:
    """Where verl 0.7.1's ``RLHFDataset`` and 0.9.1's part on the same data (their rows are otherwise equal)."""

    media_paths: bool  # path-string images and videos, and frame-list videos, become items (0.7.1: a TypeError)
    # audio is a modality: ``<audio>`` is a placeholder and the audio column leaves the row (0.7.1: plain text, and a
    # column like any other)
    audio: bool
    # the overlong filter measures media prompts with every image and video expanded to its grid; 0.7.1's filter
    # pops the media before it measures (``_build_messages``), so a placeholder counts as the template writes it
    filter_expands_media: bool


RAW_PROMPT_DIALECTS = {
    "verl-0.7": RawPromptDialect(media_paths=False, audio=False, filter_expands_media=False),
    "verl-0.9": RawPromptDialect(media_paths=True, audio=True, filter_expands_media=True),
}
_SPLIT = {True: re.compile("(<image>|<video>|<audio>)"), False: re.compile("(<image>|<video>)")}


def struct_image_problem(image) -> str | None:
    """Why verl 0.9.1 gives no image for a plain image struct (read without an HF ``Image()`` feature), or None.

    It opens only the struct's ``bytes`` (``Image.open(BytesIO(image["bytes"]))``): a struct whose bytes are null
    or empty fails there (its overlong filter drops the row, ``__getitem__`` raises), and one without a ``bytes``
    field gets an item with no image at all (the rollout's ``fetch_image`` fails on it)."""
    if not isinstance(image, Mapping):
        return None
    if "bytes" not in image:
        return "image struct without a bytes field (read without an HF Image() feature, verl 0.9.1 gives no image)"
    if not image["bytes"]:
        return (
            "image struct with null or empty bytes (read without an HF Image() feature, verl 0.9.1 opens only the "
            "bytes, not the path: its filter drops the row, __getitem__ raises)"
        )
    return None


def raw_prompt_messages(
    messages: list[dict],
    images: list,
    videos: list,
    images_decoded: bool = True,
    dialect: RawPromptDialect = RAW_PROMPT_DIALECTS["verl-0.9"],
) -> tuple[list[dict], list[int]]:
    """verl 0.9.1 ``_build_messages`` (or 0.7.1's, per ``dialect``) on a row whose media lists are ``images`` /
    ``videos`` (empty: none), in place.

    Only a row with media is split, and only its string contents. Returns the messages and the positions in
    ``images`` of those the consumer fills in decoded (an HF ``Image()`` value; verl: ``img.convert("RGB")``); a path
    string stays the item's ``image``. ``images_decoded`` False: the image structs are plain dicts (the file has no
    HF ``Image()`` feature for the column), each an item of its own fields with ``bytes`` and ``image`` left null
    for the consumer (``fill_struct_images``). Videos are items of their own values (``{"type": "video", **video}``).
    Raises ``ValueError`` where placeholders and media do not match (verl asserts), a struct gives no image, or the
    dialect takes no such media value (verl raises ``TypeError``).
    """
    if not images and not videos:
        return messages, []
    to_decode: list[int] = []
    image_at = video_at = 0
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            continue
        items: list[dict] = []
        for segment in _SPLIT[dialect.audio].split(content):
            if segment == "":
                continue
            if segment == "<image>":
                if image_at >= len(images):
                    raise ValueError(f"more <image> placeholders than the row's {len(images)} images")
                image = images[image_at]
                if isinstance(image, str) and dialect.media_paths:
                    items.append({"type": "image", "image": image})
                elif isinstance(image, Mapping) and images_decoded:
                    items.append({"type": "image"})
                    to_decode.append(image_at)
                elif isinstance(image, Mapping):
                    problem = struct_image_problem(image)
                    if problem is not None:
                        raise ValueError(problem)
                    # verl: image["image"] = Image.open(...), then {"type": "image", **image}: the struct's key order
                    item = {"type": "image", **image, "bytes": None}
                    item["image"] = None
                    items.append(item)
                else:
                    kinds = "an image struct or a path" if dialect.media_paths else "an image struct"
                    raise ValueError(f"image must be {kinds}, got {type(image).__name__}")
                image_at += 1
            elif segment == "<video>":
                if video_at >= len(videos):
                    raise ValueError(f"more <video> placeholders than the row's {len(videos)} videos")
                video = videos[video_at]
                if isinstance(video, Mapping):
                    items.append({"type": "video", **video})
                elif isinstance(video, str | list) and dialect.media_paths:
                    items.append({"type": "video", "video": video})
                else:
                    kinds = "a dict, a path or a frame list" if dialect.media_paths else "a dict"
                    raise ValueError(f"video must be {kinds}, got {type(video).__name__}")
                video_at += 1
            elif segment == "<audio>":
                raise ValueError("<audio> placeholder: audio prompts are not built by this pipeline")
            else:
                items.append({"type": "text", "text": segment})
        message["content"] = items
    if image_at != len(images):
        raise ValueError(f"{image_at} <image> placeholders for {len(images)} images")
    if video_at != len(videos):
        raise ValueError(f"{video_at} <video> placeholders for {len(videos)} videos")
    return messages, to_decode


def fill_images(messages: list[dict], images: Iterator) -> list[dict]:
    """Put the next of ``images`` into each image item left for the consumer (``{"type": "image"}``), in order."""
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            if isinstance(item, dict) and item.get("type") == "image" and len(item) == 1:
                item["image"] = next(images)
    return messages


def fill_struct_images(messages: list[dict], encoded: Iterator[bytes]) -> list[dict]:
    """Put the next of ``encoded`` into each struct image item (``bytes`` null), with its image opened as verl 0.9.1
    opens it: ``Image.open(BytesIO(bytes))``, lazily, in the file's own mode."""
    from PIL import Image

    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            if isinstance(item, dict) and item.get("type") == "image" and "bytes" in item and item["bytes"] is None:
                data = next(encoded)
                item["bytes"] = data
                item["image"] = Image.open(io.BytesIO(data))
    return messages
