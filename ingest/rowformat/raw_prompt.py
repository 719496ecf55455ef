"""The verl 0.9 row (verl 0.7 and later): ``raw_prompt``, the chat whose ``<image>`` / ``<video>`` placeholders are
replaced by content items carrying the media (``RLHFDataset._build_messages``), and no ids: the rollout's agent loop
tokenizes and processes the media.

Blocks carry the messages as JSON with ``{"type": "image"}`` items where a decoded image goes; the consumer puts the
RGB PIL image in (``fill_images``), so pixels travel as plain Arrow, never as pickled images.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

_SPLIT = re.compile("(<image>|<video>|<audio>)")


def raw_prompt_messages(messages: list[dict], images: list, videos: list) -> tuple[list[dict], list[int]]:
    """verl 0.9.1 ``_build_messages`` on a row whose media lists are ``images`` / ``videos`` (empty: none), in place.

    Only a row with media is split, and only its string contents. Returns the messages and the positions in
    ``images`` of those the consumer fills in decoded (an HF ``Image()`` value; verl: ``img.convert("RGB")``); a path
    string stays the item's ``image``. Videos are items of their own values (``{"type": "video", **video}``).
    Raises ``ValueError`` where placeholders and media do not match (verl asserts).
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
        for segment in _SPLIT.split(content):
            if segment == "":
                continue
            if segment == "<image>":
                if image_at >= len(images):
                    raise ValueError(f"more <image> placeholders than the row's {len(images)} images")
                image = images[image_at]
                if isinstance(image, str):
                    items.append({"type": "image", "image": image})
                elif isinstance(image, Mapping):
                    items.append({"type": "image"})
                    to_decode.append(image_at)
                else:
                    raise ValueError(f"image must be an image struct or a path, got {type(image).__name__}")
                image_at += 1
            elif segment == "<video>":
                if video_at >= len(videos):
                    raise ValueError(f"more <video> placeholders than the row's {len(videos)} videos")
                video = videos[video_at]
                if isinstance(video, Mapping):
                    items.append({"type": "video", **video})
                elif isinstance(video, str | list):
                    items.append({"type": "video", "video": video})
                else:
                    raise ValueError(f"video must be a dict, a path or a frame list, got {type(video).__name__}")
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
