"""Generated chats for the SFT tests: Qwen's special token ids, tools, random text and conversations (tool calls
included), encoded sample images."""

from __future__ import annotations

import json
import random

IM_END, IMAGE_PAD = 151645, 151655


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    },
]


PIECES = [
    "Hello",
    "What is 12 * 7?",
    "  leading spaces",
    "trailing spaces   ",
    "\nleading newline",
    "\n\nTwo leading newlines",
    "ends with newline\n",
    "tabs\tand\ttabs",
    "naïve café — “quotes”",
    "日本語のテキスト",
    "emoji 😀🎉 mixed",
    "Ελληνικά και русский",
    "code: `def f(x):\n    return x**2`",
    "#### 84",
    "1234567890",
    "<think>\nreasoning here\n</think>\n\nThe answer.",
    "<tool_call>not really</tool_call>",
    "",
    " ",
    "a\r\nwindows\r\nlines",
    "math $\\frac{a}{b}$",
]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) + rng.choice(["", " ", "\n", ". "]) for _ in range(rng.randint(1, 4)))


def random_conversation(rng: random.Random, *, tools: bool) -> list[dict]:
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": random_text(rng)})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": random_text(rng)})
        if tools and rng.random() < 0.5:
            calls = [
                {
                    "type": "function",
                    "id": f"call_{rng.randint(0, 10**6)}",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": rng.choice(["Paris", "東京"]), "days": 2},
                    },
                }
                for _ in range(rng.randint(1, 3))
            ]
            messages.append(
                {
                    "role": "assistant",
                    "content": rng.choice(["", "Let me check.", random_text(rng)]),
                    "tool_calls": calls,
                }
            )
            for call in calls:
                messages.append(
                    {"role": "tool", "content": json.dumps({"temp": rng.randint(-10, 35)}), "tool_call_id": call["id"]}
                )
        messages.append({"role": "assistant", "content": random_text(rng)})
    return messages


def random_conversations(seed: int, n: int, *, tools: bool) -> list[dict]:
    rng = random.Random(seed)
    return [random_conversation(rng, tools=tools) for _ in range(n)]


def inline_images(messages: list[dict], images: list[bytes] | None) -> list[dict]:
    """renderers' form of a row, written for the tests apart from the pipeline's: the images column's values in the
    image parts that have none, in order."""
    pending = iter(images or [])
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {**p, "image": next(pending)} if p.get("type") == "image" and p.get("image") is None else p
                for p in content
            ]
        out.append({**message, "content": content})
    return out


def encoded_image(rng: random.Random, kind: str):
    from tools.samples import encode_image, make_image

    image, fmt = make_image(kind, rng)
    return encode_image(image, fmt)
