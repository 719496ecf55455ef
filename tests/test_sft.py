"""SFT samples (ingest.sft): the contract's examples, token ids vs transformers' apply_chat_template over generated
conversations (Qwen2-VL, Qwen2.5 and Qwen3 ChatML templates with tools; a non-ChatML fallback), loss masks against an
id-level oracle, images / videos against the Qwen2-VL processor, causal shift / truncation / packing. No Ray."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import random

import numpy as np
import pytest

from ingest.sft import (
    ChatMLRenderer,
    ModalityData,
    PlaceholderRange,
    RenderedTrainingSample,
    Renderer,
    SFTRenderError,
    TemplateRenderer,
    TrainingSequence,
    build_training_sample,
    conversation_problem,
    create_renderer,
    mm_token_type_ids,
    pack,
    shift_and_truncate,
)
from ingest.tokenizer.chat import ChatTokenizer
from tests.support.conversations import (
    IM_END,
    IMAGE_PAD,
    TOOLS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    encoded_image,
    expected_chatml_mask,
    hf_chat_ids,
    random_conversations,
    random_text,
)
from tests.support.templates import HEADER_TEMPLATE, PLAIN_TEMPLATE, QWEN3_TEMPLATE, QWEN25_TEMPLATE, template_dir


def _template_dir(tmp_path_factory, model_dir: str, name: str, template: str) -> str:
    return template_dir(tmp_path_factory.mktemp(name), model_dir, template)


@pytest.fixture(scope="module")
def dirs(model_dir, tmp_path_factory):
    return {
        "qwen2-vl": model_dir,
        "qwen2.5": _template_dir(tmp_path_factory, model_dir, "qwen25", QWEN25_TEMPLATE),
        "qwen3": _template_dir(tmp_path_factory, model_dir, "qwen3", QWEN3_TEMPLATE),
        "header": _template_dir(tmp_path_factory, model_dir, "header", HEADER_TEMPLATE),
        "plain": _template_dir(tmp_path_factory, model_dir, "plain", PLAIN_TEMPLATE),
    }


@pytest.fixture(scope="module")
def hf(dirs):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in dirs.items()}


@pytest.fixture(scope="module")
def renderers(dirs):
    return {name: create_renderer(path) for name, path in dirs.items()}


@pytest.fixture(scope="module")
def vl_renderer(model_dir):
    return create_renderer(model_dir, processor=model_dir)


@pytest.fixture(scope="module")
def processor(model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


# --- the contract's examples ------------------------------------------------------------------------------------------


def test_contract_mm_token_type_ids_examples():
    assert mm_token_type_ids(10, {"image": [PlaceholderRange(2, 3)], "video": [PlaceholderRange(7, 2)]}) == [
        0, 0, 1, 1, 1, 0, 0, 2, 2, 0,
    ]  # fmt: skip
    assert mm_token_type_ids(5, {"image": [PlaceholderRange(3, 10)]}) == [0, 0, 0, 1, 1]
    assert mm_token_type_ids(4, {"audio": [PlaceholderRange(0, 4)], "image": [(1, 1)]}) == [0, 1, 0, 0]
    assert mm_token_type_ids(3, {"image": [PlaceholderRange(5, 2)]}) == [0, 0, 0]
    assert mm_token_type_ids(0, {"image": [PlaceholderRange(0, 2)]}) == []


def test_contract_types():
    r = PlaceholderRange(offset=2, length=3)
    assert (r.offset, r.length) == (2, 3) and r == (2, 3)
    sample = RenderedTrainingSample([1, 2], [False, True])
    assert sample.multi_modal_data is None and sample.mm_token_type_ids is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.token_ids = [3]  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(RenderedTrainingSample)] == [
        "token_ids",
        "loss_mask",
        "multi_modal_data",
        "mm_token_type_ids",
    ]


def test_create_renderer_picks_chatml_or_fallback(renderers, model_dir):
    assert isinstance(renderers["qwen2-vl"], ChatMLRenderer)
    assert isinstance(renderers["qwen2.5"], ChatMLRenderer)
    assert isinstance(renderers["qwen3"], ChatMLRenderer)
    assert isinstance(renderers["header"], TemplateRenderer)
    assert isinstance(renderers["plain"], TemplateRenderer)
    assert all(isinstance(r, Renderer) for r in renderers.values())
    loaded = create_renderer(ChatTokenizer(model_dir))
    assert isinstance(loaded, ChatMLRenderer)
    assert isinstance(create_renderer("embedded:qwen2-vl"), ChatMLRenderer)
    assert isinstance(create_renderer(model_dir, kind="template"), TemplateRenderer)
    with pytest.raises(TypeError):
        create_renderer(42)  # type: ignore[arg-type]


# --- token ids equal apply_chat_template ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5", "qwen3"])
def test_chatml_ids_and_mask_over_generated_conversations(renderers, hf, name):
    renderer, tokenizer = renderers[name], hf[name]
    with_tools = name != "qwen2-vl"  # Qwen2-VL's template ignores tools / tool_calls (still compared below)
    checked_tools = 0
    for seed, messages in enumerate(random_conversations(7 + len(name), 120, tools=True)):
        tools = TOOLS if with_tools and seed % 3 else None
        sample = build_training_sample(renderer, messages, tools=tools)
        expected = hf_chat_ids(tokenizer, messages, tools)
        assert sample.token_ids == expected, (name, seed)
        assert sample.loss_mask == expected_chatml_mask(expected), (name, seed)
        assert sample.multi_modal_data is None and sample.mm_token_type_ids is None
        checked_tools += any(m["role"] == "tool" for m in messages) and (tools is not None or not with_tools)
    assert checked_tools > 20


def test_qwen2vl_tags_per_message(renderers, hf):
    renderer, tokenizer = renderers["qwen2-vl"], hf["qwen2-vl"]
    for messages in random_conversations(3, 60, tools=False):
        rendered = renderer.render(messages)
        ids, idx = rendered.token_ids, rendered.message_indices
        if messages[0]["role"] != "system":
            default = [t for t, j in zip(ids, idx, strict=True) if j == -1]
            assert tokenizer.decode(default) == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            assert ids[: len(default)] == default
        else:
            assert -1 not in idx
        assert idx == sorted(idx)  # messages appear in order, scaffolding first
        for j, message in enumerate(messages):
            own = [t for t, k in zip(ids, idx, strict=True) if k == j]
            assert tokenizer.decode(own) == f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
            body = [t for t, k, c in zip(ids, idx, rendered.content, strict=True) if k == j and c]
            sampled = [t for t, k, s in zip(ids, idx, rendered.sampled, strict=True) if k == j and s]
            # a body that starts with a newline shares its first token with the header's newline
            texts = (message["content"], "\n" + message["content"])
            if message["role"] == "assistant":
                assert sampled[-1] == IM_END and tokenizer.decode(sampled[:-1]) in texts
                # renderers' rule: on assistant tokens content == sampled (the closing <|im_end|> included)
                assert body == sampled
            else:
                assert tokenizer.decode(body) in texts
                assert sampled == []


def test_tool_turns_qwen25(renderers, hf):
    renderer = renderers["qwen2.5"]
    messages = [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "Paris 21 °C, Tokyo 25 °C."},
    ]
    rendered = renderer.render(messages, tools=TOOLS)
    assert rendered.token_ids == hf_chat_ids(hf["qwen2.5"], messages, TOOLS)
    decode = hf["qwen2.5"].decode
    ids, idx = rendered.token_ids, rendered.message_indices
    system = decode([t for t, j in zip(ids, idx, strict=True) if j == -1])
    assert system.startswith("<|im_start|>system\nYou are Qwen") and "# Tools" in system  # the template's own
    call = decode([t for t, j, s in zip(ids, idx, rendered.sampled, strict=True) if j == 1 and s])
    assert call.startswith('<tool_call>\n{"name": "get_weather"') and call.endswith("</tool_call><|im_end|>")
    first, second = (decode([t for t, j in zip(ids, idx, strict=True) if j == k]) for k in (2, 3))
    assert first.startswith("<|im_start|>user\n<tool_response>\n") and '{"temp": 21}' in first
    assert '{"temp": 25}' in second and second.endswith("</tool_response><|im_end|>\n")
    sample = build_training_sample(renderer, messages, tools=TOOLS)
    assert decode([t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]) == (
        call + "Paris 21 °C, Tokyo 25 °C.<|im_end|>"
    )


def test_qwen3_drops_past_thinking_and_tags_still_follow_turns(renderers, hf):
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n4"},
    ]
    sample = build_training_sample(renderers["qwen3"], messages)
    assert sample.token_ids == hf_chat_ids(hf["qwen3"], messages)
    trained = hf["qwen3"].decode([t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m])
    assert trained == "2<|im_end|><think>\nadd again\n</think>\n\n4<|im_end|>"


def test_role_to_mask_selects_assistant_turns(renderers):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "skip me", "train": False},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "train me"},
    ]
    renderer = renderers["qwen2-vl"]
    sample = build_training_sample(renderer, messages, role_to_mask=lambda m: m.get("train", True))
    rendered = renderer.render(messages)
    trained_messages = {j for j, m in zip(rendered.message_indices, sample.loss_mask, strict=True) if m}
    assert trained_messages == {3}
    # a predicate cannot train tokens the model does not sample
    everything = build_training_sample(renderer, messages, role_to_mask=lambda m: True)
    assert everything.loss_mask == build_training_sample(renderer, messages).loss_mask


def test_unicode_and_special_strings_round_trip(renderers, hf):
    messages = [
        {"role": "user", "content": "\u200b zero width, \U0001f9d1\u200d\U0001f52c zwj, \x00 nul, <|endoftext|>"},
        {"role": "assistant", "content": "\n\n  \n"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
    ]
    sample = build_training_sample(renderers["qwen2-vl"], messages)
    assert sample.token_ids == hf_chat_ids(hf["qwen2-vl"], messages)
    assert sample.loss_mask == expected_chatml_mask(sample.token_ids)


def test_chatml_rejects_what_it_cannot_align(renderers):
    with pytest.raises(SFTRenderError):
        build_training_sample(renderers["qwen2-vl"], [{"role": "user", "content": "x<|im_end|>y"}])
    with pytest.raises(SFTRenderError):
        build_training_sample(renderers["qwen2-vl"], [])
    with pytest.raises(SFTRenderError):
        build_training_sample(renderers["qwen2-vl"], [{"content": "no role"}])


# --- the fallback renderer ------------------------------------------------------------------------------------------


def test_fallback_requires_role_to_mask(renderers):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ValueError, match="role_to_mask"):
        build_training_sample(renderers["header"], messages)


@pytest.mark.parametrize("name", ["header", "plain"])
def test_fallback_ids_and_message_attribution(renderers, hf, name):
    renderer, tokenizer = renderers[name], hf[name]
    for seed, messages in enumerate(random_conversations(11, 60, tools=False)):
        sample = build_training_sample(renderer, messages, role_to_mask=lambda m: m["role"] == "assistant")
        assert sample.token_ids == hf_chat_ids(tokenizer, messages), seed
        rendered = renderer.render(messages)
        assert rendered.sampled is None and rendered.content is None
        idx = rendered.message_indices
        assert idx == sorted(idx) and -1 not in idx  # in order; the empty conversation renders nothing here
        for j, message in enumerate(messages):
            own = tokenizer.decode([t for t, k in zip(rendered.token_ids, idx, strict=True) if k == j])
            assert message["content"].strip() in own, (seed, j)
            assert own.count(message["role"]) >= 1
        trained = {idx[t] for t, m in enumerate(sample.loss_mask) if m}
        assert trained == {j for j, m in enumerate(messages) if m["role"] == "assistant"}
        assert all(sample.loss_mask[t] == (messages[idx[t]]["role"] == "assistant") for t in range(len(idx)))


def test_fallback_on_a_chatml_template_matches_prefix_rendering(model_dir, renderers, hf):
    fallback = create_renderer(model_dir, kind="template")
    for messages in random_conversations(5, 30, tools=False):
        rendered = fallback.render(messages)
        chatml = renderers["qwen2-vl"].render(messages)
        assert rendered.token_ids == chatml.token_ids
        # the default system prompt renders only with the first message, so the fallback gives it to message 0
        shift = [0 if j == -1 else j for j in chatml.message_indices]
        assert rendered.message_indices == shift


def test_ensure_final_stop(renderers, hf):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    plain = renderers["plain"]
    base = build_training_sample(plain, messages, role_to_mask=lambda m: m["role"] == "assistant")
    stopped = build_training_sample(
        plain, messages, role_to_mask=lambda m: m["role"] == "assistant", ensure_final_stop=True
    )
    assert stopped.token_ids == base.token_ids + [IM_END] and stopped.loss_mask == base.loss_mask + [True]
    chatml = build_training_sample(renderers["qwen2-vl"], messages)
    assert build_training_sample(renderers["qwen2-vl"], messages, ensure_final_stop=True) == chatml
    user_last = messages + [{"role": "user", "content": "bye"}]
    assert build_training_sample(
        plain, user_last, role_to_mask=lambda m: True, ensure_final_stop=True
    ) == build_training_sample(plain, user_last, role_to_mask=lambda m: True)


# --- images and videos ------------------------------------------------------------------------------------------------


def _mm_conversation(rng: random.Random) -> tuple[list[dict], list[bytes]]:
    kinds = ["png", "jpeg", "gray", "palette", "rgba", "tiny", "wide", "tall"]
    encoded: list[bytes] = []
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": "You look at pictures."})
    for _ in range(rng.randint(1, 3)):
        parts = []
        for _ in range(rng.randint(0, 2)):
            data = encoded_image(rng, rng.choice(kinds))
            parts.append({"type": "image", "image": data})
            if rng.random() < 0.7:
                parts.append({"type": "text", "text": random_text(rng)})
        parts.append({"type": "text", "text": random_text(rng)})
        rng.shuffle(parts)
        encoded += [p["image"] for p in parts if p["type"] == "image"]
        messages.append({"role": "user", "content": parts})
        messages.append({"role": "assistant", "content": random_text(rng)})
    return messages, encoded


def _as_pil_rgb(messages: list[dict]) -> list[dict]:
    """The same conversation with PIL RGB images (what the processor's loader takes; RGB conversion as verl does)."""
    from PIL import Image

    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {**p, "image": Image.open(io.BytesIO(p["image"])).convert("RGB")} if p.get("type") == "image" else p
                for p in content
            ]
        out.append({**message, "content": content})
    return out


def test_images_match_the_processor(vl_renderer, processor):
    rng = random.Random(5)
    seen_images = 0
    for seed in range(12):
        messages, encoded = _mm_conversation(rng)
        sample = build_training_sample(vl_renderer, messages)
        expected = processor.apply_chat_template(
            _as_pil_rgb(messages), tokenize=True, return_dict=True, add_generation_prompt=False, return_tensors="np"
        )
        assert sample.token_ids == expected["input_ids"][0].tolist(), seed
        assert sample.loss_mask == expected_chatml_mask(sample.token_ids)
        if not encoded:
            assert sample.multi_modal_data is None and sample.mm_token_type_ids is None
            continue
        seen_images += len(encoded)
        assert sample.mm_token_type_ids == expected["mm_token_type_ids"][0].tolist()
        data = sample.multi_modal_data["image"]
        assert isinstance(data, ModalityData) and list(sample.multi_modal_data) == ["image"]
        assert data.hashes == [hashlib.sha256(b).hexdigest() for b in encoded]
        grids = np.concatenate([item["image_grid_thw"] for item in data.items])
        np.testing.assert_array_equal(grids, expected["image_grid_thw"])
        pixels = np.concatenate([item["pixel_values"] for item in data.items])
        assert pixels.shape == expected["pixel_values"].shape and pixels.dtype == np.float32
        np.testing.assert_allclose(pixels, expected["pixel_values"], atol=1e-4, rtol=0)
        for item, placeholder in zip(data.items, data.placeholders, strict=True):
            offset, length = placeholder
            assert length == int(np.prod(item["image_grid_thw"])) // 4
            assert item["pixel_values"].shape[0] == int(np.prod(item["image_grid_thw"]))
            assert sample.token_ids[offset - 1] == VISION_START and sample.token_ids[offset + length] == VISION_END
            assert set(sample.token_ids[offset : offset + length]) == {IMAGE_PAD}
            assert not any(sample.loss_mask[offset : offset + length])
    assert seen_images >= 8


def test_image_value_kinds_and_side_list(vl_renderer, model_dir):
    from PIL import Image

    rng = random.Random(1)
    data = encoded_image(rng, "png")
    pil = Image.open(io.BytesIO(data)).convert("RGB")
    base = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    answer = [{"role": "assistant", "content": "A figure."}]

    def with_image(value):
        return [{"role": "user", "content": [{"type": "image", "image": value}, {"type": "text", "text": "What?"}]}]

    by_bytes = build_training_sample(vl_renderer, with_image(data) + answer)
    by_struct = build_training_sample(vl_renderer, with_image({"bytes": data, "path": None}) + answer)
    by_side = build_training_sample(vl_renderer, base + answer, images=[data])
    by_pil = build_training_sample(vl_renderer, with_image(pil) + answer)
    by_array = build_training_sample(vl_renderer, with_image(np.asarray(pil)) + answer)
    assert by_bytes.token_ids == by_struct.token_ids == by_side.token_ids == by_pil.token_ids == by_array.token_ids
    assert by_bytes.multi_modal_data["image"].hashes == by_side.multi_modal_data["image"].hashes
    assert by_pil.multi_modal_data["image"].hashes == by_array.multi_modal_data["image"].hashes
    np.testing.assert_array_equal(
        by_bytes.multi_modal_data["image"].items[0]["pixel_values"],
        by_pil.multi_modal_data["image"].items[0]["pixel_values"],
    )
    # a loaded processor object works like the directory
    from transformers import AutoProcessor

    loaded = create_renderer(model_dir, processor=AutoProcessor.from_pretrained(model_dir))
    again = build_training_sample(loaded, with_image(data) + answer)
    assert again.token_ids == by_bytes.token_ids
    np.testing.assert_array_equal(
        again.multi_modal_data["image"].items[0]["pixel_values"],
        by_bytes.multi_modal_data["image"].items[0]["pixel_values"],
    )
    # tokenization without pixel work (what a tokenize stage would do)
    rendered = vl_renderer.render(with_image(data) + answer, process_media=False)
    assert rendered.token_ids == by_bytes.token_ids and rendered.media[0].outputs is None
    assert rendered.media[0].data == data


def test_media_errors(vl_renderer, renderers):
    data = encoded_image(random.Random(2), "png")
    answer = [{"role": "assistant", "content": "ok"}]
    with pytest.raises(SFTRenderError, match="more image parts"):
        build_training_sample(vl_renderer, [{"role": "user", "content": [{"type": "image"}]}] + answer)
    with pytest.raises(SFTRenderError, match="only 0 image parts"):
        build_training_sample(vl_renderer, [{"role": "user", "content": "no placeholder"}] + answer, images=[data])
    with pytest.raises(SFTRenderError, match="placeholders"):  # a literal pad in text: counts disagree
        build_training_sample(
            vl_renderer,
            [{"role": "user", "content": [{"type": "text", "text": "<|image_pad|>"}, {"type": "image", "image": data}]}]
            + answer,
        )
    with pytest.raises(SFTRenderError, match="no processor"):
        build_training_sample(renderers["qwen2-vl"], [{"role": "user", "content": [{"type": "image", "image": data}]}])
    with pytest.raises(SFTRenderError, match="bad image"):
        build_training_sample(vl_renderer, [{"role": "user", "content": [{"type": "image", "image": b"notanimage"}]}])


def test_text_samples_from_a_vision_renderer_have_no_media_fields(vl_renderer, renderers):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "yo"}]
    sample = build_training_sample(vl_renderer, messages)
    assert sample.multi_modal_data is None and sample.mm_token_type_ids is None
    assert sample == build_training_sample(renderers["qwen2-vl"], messages)


def test_videos_and_images_match_the_processor(vl_renderer, processor):
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (4, 90, 120, 3), dtype=np.uint8)
    odd = rng.integers(0, 256, (3, 64, 64, 3), dtype=np.uint8)  # odd frame count: padded to the temporal patch
    image = encoded_image(random.Random(4), "jpeg")
    messages = [
        {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "A clip."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "video", "video": odd},
                {"type": "text", "text": "?"},
            ],
        },
        {"role": "assistant", "content": "A picture and a clip."},
    ]
    sample = build_training_sample(vl_renderer, messages)
    text = vl_renderer.render(messages, process_media=False).text
    from PIL import Image

    expected = processor(
        text=[text],
        images=[Image.open(io.BytesIO(image)).convert("RGB")],
        videos=[frames, odd],
        return_tensors="np",
    )
    assert sample.token_ids == expected["input_ids"][0].tolist()
    assert sample.mm_token_type_ids == expected["mm_token_type_ids"][0].tolist()
    assert sorted(set(sample.mm_token_type_ids)) == [0, 1, 2]
    videos = sample.multi_modal_data["video"]
    np.testing.assert_array_equal(
        np.concatenate([v["video_grid_thw"] for v in videos.items]), expected["video_grid_thw"]
    )
    np.testing.assert_allclose(
        np.concatenate([v["pixel_values_videos"] for v in videos.items]),
        expected["pixel_values_videos"],
        atol=1e-4,
        rtol=0,
    )
    for item, (offset, length) in zip(videos.items, videos.placeholders, strict=True):
        assert length == int(np.prod(item["video_grid_thw"])) // 4
        assert set(sample.token_ids[offset : offset + length]) == {VIDEO_PAD}
    # frames given as encoded images hash per frame and process the same
    pngs = []
    for frame in frames:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    as_list = build_training_sample(
        vl_renderer, [{"role": "user", "content": [{"type": "video", "video": pngs}]}, messages[1]]
    )
    np.testing.assert_array_equal(
        as_list.multi_modal_data["video"].items[0]["pixel_values_videos"], videos.items[0]["pixel_values_videos"]
    )
    assert as_list.multi_modal_data["video"].hashes[0] != videos.hashes[0]  # encoded bytes vs raw pixels


# --- consumer side: shift, truncation, packing ----------------------------------------------------------------------


def _mm_sample() -> RenderedTrainingSample:
    """10 tokens: image run (2, 3), video run (7, 2)."""
    image = ModalityData([{"pixel_values": np.zeros((12, 4), np.float32)}], ["img"], [PlaceholderRange(2, 3)])
    video = ModalityData([{"pixel_values_videos": np.ones((8, 4), np.float32)}], ["vid"], [PlaceholderRange(7, 2)])
    ids = list(range(100, 110))
    mask = [False] * 5 + [True] * 5
    types = mm_token_type_ids(10, {"image": image.placeholders, "video": video.placeholders})
    return RenderedTrainingSample(ids, mask, {"image": image, "video": video}, types)


def test_shift_in_lockstep():
    sample = _mm_sample()
    seq = shift_and_truncate(sample)
    assert seq.inputs == sample.token_ids[:-1] and seq.targets == sample.token_ids[1:]
    assert seq.loss_mask == sample.loss_mask[1:] and seq.mm_token_type_ids == sample.mm_token_type_ids[:-1]
    assert seq.seq_lens == [9] and seq.dropped_media == 0
    assert seq.multi_modal_data == sample.multi_modal_data
    text = RenderedTrainingSample([1, 2, 3], [False, True, True])
    shifted = shift_and_truncate(text)
    assert (shifted.inputs, shifted.targets, shifted.loss_mask) == ([1, 2], [2, 3], [True, True])
    assert shifted.mm_token_type_ids is None and shifted.multi_modal_data is None
    assert shift_and_truncate(RenderedTrainingSample([1], [True])).inputs == []


@pytest.mark.parametrize(
    ("max_length", "cut", "kept"),
    [
        (9, 9, {"image", "video"}),  # no cut
        (8, 7, {"image"}),  # inside the video run (7, 2): back to 7, video dropped
        (7, 7, {"image"}),  # exactly at the video run's start
        (6, 6, {"image"}),
        (5, 5, {"image"}),  # exactly after the image run
        (4, 2, set()),  # inside the image run (2, 3): back to 2
        (3, 2, set()),
        (2, 2, set()),
        (1, 1, set()),
    ],
)
def test_truncation_never_splits_a_placeholder_run(max_length, cut, kept):
    sample = _mm_sample()
    seq = shift_and_truncate(sample, max_length)
    assert len(seq.inputs) == cut and seq.inputs == sample.token_ids[:cut]
    assert seq.targets == sample.token_ids[1 : cut + 1] and seq.loss_mask == sample.loss_mask[1 : cut + 1]
    assert seq.mm_token_type_ids == sample.mm_token_type_ids[:cut]
    assert set(seq.multi_modal_data or {}) == kept
    assert seq.dropped_media == 2 - len(kept)
    for modality in kept:
        assert seq.multi_modal_data[modality] == sample.multi_modal_data[modality]


def test_truncating_a_real_sample_keeps_runs_whole(vl_renderer):
    rng = random.Random(9)
    data = [encoded_image(rng, "png") for _ in range(2)]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": data[0]}, {"type": "text", "text": "one"}]},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": [{"type": "image", "image": data[1]}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "second"},
    ]
    sample = build_training_sample(vl_renderer, messages)
    second = sample.multi_modal_data["image"].placeholders[1]
    seq = shift_and_truncate(sample, second.offset + second.length // 2)
    assert len(seq.inputs) == second.offset and seq.dropped_media == 1
    assert seq.multi_modal_data["image"].hashes == [hashlib.sha256(data[0]).hexdigest()]
    assert seq.mm_token_type_ids.count(1) == sample.multi_modal_data["image"].placeholders[0].length


def test_pack_with_seq_lens():
    text = [RenderedTrainingSample(list(range(n)), [True] * n) for n in (5, 4, 7, 3)]
    mm = _mm_sample()
    packs = pack([text[0], mm, text[1], text[2], text[3]], 14)
    assert [p.seq_lens for p in packs] == [[4, 9], [3, 6, 2]]
    first, second = packs
    assert all(isinstance(p, TrainingSequence) for p in packs)
    assert first.inputs == list(range(4)) + mm.token_ids[:-1]
    assert first.targets == list(range(1, 5)) + mm.token_ids[1:]
    assert first.mm_token_type_ids == [0] * 4 + mm.mm_token_type_ids[:-1]
    assert first.multi_modal_data["image"].placeholders == [PlaceholderRange(6, 3)]
    assert first.multi_modal_data["video"].placeholders == [PlaceholderRange(11, 2)]
    assert second.mm_token_type_ids is None and second.multi_modal_data is None
    assert sum(second.seq_lens) == len(second.inputs) == len(second.targets) == len(second.loss_mask)
    # over-long samples are truncated to the budget (runs kept whole) when given unshifted
    (single,) = pack([mm], 8)
    assert single.seq_lens == [7] and set(single.multi_modal_data) == {"image"}
    with pytest.raises(ValueError, match="does not fit"):
        pack([shift_and_truncate(mm)], 5)
    with pytest.raises(ValueError):
        pack([mm], 0)
    assert pack([], 8) == []


# --- conversation checks for the pipeline's quarantine -------------------------------------------------------------


def test_conversation_problem():
    ok = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert conversation_problem(ok) is None
    assert "empty" in conversation_problem([])
    assert "no assistant" in conversation_problem([{"role": "user", "content": "q"}])
    assert "list" in conversation_problem("not a list")
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {}}}],
    }
    assert conversation_problem([*ok, call, {"role": "tool", "content": "r", "tool_call_id": "c1"}, ok[1]]) is None
    assert "no open tool call" in conversation_problem([*ok, {"role": "tool", "content": "r"}])
    assert "did not make" in conversation_problem([*ok, call, {"role": "tool", "content": "r", "tool_call_id": "c9"}])
    assert "no open tool call" in conversation_problem(
        [*ok, call, {"role": "tool", "content": "r"}, {"role": "tool", "content": "again"}]
    )


# --- renderers' and prime-rl's call shapes and conversations ----------------------------------------------------------


def _byt5_chatml():
    """A slow (Python) tokenizer with a ChatML template: ByT5's bytes plus <|im_start|> / <|im_end|>."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer(extra_ids=0, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    return tokenizer


def test_create_renderer_takes_transformers_tokenizer_and_processor_objects(
    renderers, hf, vl_renderer, processor, model_dir
):
    """renderers' call: ``create_renderer(tokenizer)`` with a loaded tokenizer (fast or slow) or processor object."""
    for name in ("qwen2.5", "qwen3"):
        renderer = create_renderer(hf[name])
        assert isinstance(renderer, ChatMLRenderer)
        for seed, messages in enumerate(random_conversations(21, 25, tools=True)):
            tools = TOOLS if seed % 2 else None
            sample = build_training_sample(renderer, messages, tools=tools)
            assert sample.token_ids == hf_chat_ids(hf[name], messages, tools), (name, seed)
            assert sample == build_training_sample(renderers[name], messages, tools=tools)
    # a processor object: its tokenizer, its template, and its media processing
    data = encoded_image(random.Random(6), "png")
    messages = [
        {"role": "user", "content": [{"type": "image", "image": data}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A figure."},
    ]
    from_processor = build_training_sample(create_renderer(processor), messages)
    by_path = build_training_sample(vl_renderer, messages)
    assert from_processor.token_ids == by_path.token_ids and from_processor.loss_mask == by_path.loss_mask
    np.testing.assert_array_equal(
        from_processor.multi_modal_data["image"].items[0]["pixel_values"],
        by_path.multi_modal_data["image"].items[0]["pixel_values"],
    )
    # a slow tokenizer: ids through the object, token spans from decoding (a 2-byte character spans two tokens)
    slow = _byt5_chatml()
    assert not slow.is_fast
    renderer = create_renderer(slow)
    assert isinstance(renderer, ChatMLRenderer)
    chat = [{"role": "user", "content": "Grüße?"}, {"role": "assistant", "content": "Hallo, Wörld."}]
    sample = build_training_sample(renderer, chat)
    assert sample.token_ids == hf_chat_ids(slow, chat)
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    assert slow.decode(trained) == "Hallo, Wörld.<|im_end|>"
    with pytest.raises(TypeError, match="transformers tokenizer"):
        create_renderer(object())


def test_openai_tool_call_turn_with_null_content_renders_as_apply_chat_template(renderers, hf):
    """``{"role": "assistant", "content": None, "tool_calls": [...]}``: transformers 5 drops None-valued message keys;
    a null inside the arguments is data and renders as ``null``."""
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "reasoning_effort": None}},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "21", "tool_call_id": None},
        {"role": "assistant", "content": "21 °C.", "tool_calls": None},
    ]
    for name in ("qwen2-vl", "qwen2.5", "qwen3"):
        sample = build_training_sample(renderers[name], messages, tools=TOOLS)
        expected = hf_chat_ids(hf[name], messages, TOOLS)
        assert sample.token_ids == expected, name
        assert sample.loss_mask == expected_chatml_mask(expected), name
        if name != "qwen2-vl":  # Qwen2-VL's template does not render tool calls
            assert '"reasoning_effort": null' in hf[name].decode(sample.token_ids)
    assert messages[1]["content"] is None  # the caller's messages are not changed


def test_content_parts_with_null_media_keys_are_text(vl_renderer, renderers, processor, hf):
    """Parts as a Parquet struct column gives them (every part has every key) are text (renderers' rule), both for
    the media they carry and for what the template renders."""
    data = encoded_image(random.Random(8), "png")
    filled = {"type": None, "text": None, "image": None, "image_url": None, "video": None}
    messages = [
        {
            "role": "user",
            "content": [{**filled, "type": "text", "text": "Compare "}, {**filled, "type": "image", "image": data}],
        },
        {"role": "assistant", "content": [{**filled, "type": "text", "text": "A figure."}]},
    ]
    clean = [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": data}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A figure."}]},
    ]
    sample = build_training_sample(vl_renderer, messages)
    reference = build_training_sample(vl_renderer, clean)
    assert (sample.token_ids, sample.loss_mask, sample.mm_token_type_ids) == (
        reference.token_ids,
        reference.loss_mask,
        reference.mm_token_type_ids,
    )
    assert sample.multi_modal_data["image"].placeholders == reference.multi_modal_data["image"].placeholders
    assert len(sample.multi_modal_data["image"].items) == 1
    expected = processor.apply_chat_template(
        _as_pil_rgb(clean), tokenize=True, return_dict=True, add_generation_prompt=False, return_tensors="np"
    )
    assert sample.token_ids == expected["input_ids"][0].tolist()
    # text only: no image, so a renderer without a processor takes it
    text_only = [{"role": "user", "content": [{"text": "Hi", "image": None}]}, {"role": "assistant", "content": "Yo"}]
    got = build_training_sample(renderers["qwen2-vl"], text_only)
    assert got.token_ids == hf_chat_ids(hf["qwen2-vl"], [text_only[0] | {"content": [{"text": "Hi"}]}, text_only[1]])
    assert got.multi_modal_data is None


def _trained_by_message(sample, rendered, decode) -> dict[int, str]:
    out: dict[int, list[int]] = {}
    for t, (j, m) in enumerate(zip(rendered.message_indices, sample.loss_mask, strict=True)):
        if m:
            out.setdefault(j, []).append(sample.token_ids[t])
    return {j: decode(ids) for j, ids in out.items()}


def test_content_sft_roles_trains_message_bodies_only(renderers, hf):
    """renderers' ``content_sft_roles``: the chosen roles' own text is trained, not the template around it (headers,
    ``<|im_end|>``, ``<tool_response>`` wrappers, a tools prompt around the system message); other roles keep the
    sampled-token mask; the assistant's content equals its sampled tokens."""
    renderer, decode = renderers["qwen2.5"], hf["qwen2.5"].decode
    messages = [
        {"role": "system", "content": "Be terse"},  # ends in a letter: no token joins it to the "\n\n" after it
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}},
            ],
        },
        {"role": "tool", "content": "Sunny, 21 C"},
        {"role": "tool", "content": "Rain, 25 C"},
        {"role": "assistant", "content": "Paris sunny, Tokyo rain."},
    ]
    rendered = renderer.render(messages, tools=TOOLS)
    base = build_training_sample(renderer, messages, tools=TOOLS)
    sample = build_training_sample(renderer, messages, tools=TOOLS, content_sft_roles={"tool", "system"})
    assert sample.token_ids == base.token_ids
    trained = _trained_by_message(sample, rendered, decode)
    assert trained[0] == "Be terse"  # not the tools prompt the template wraps around it
    assert trained[3] == "Sunny, 21 C" and trained[4] == "Rain, 25 C"  # not <tool_response> nor the user header
    assert 1 not in trained
    assert trained[5] == "Paris sunny, Tokyo rain.<|im_end|>"
    assert trained[2].startswith("<tool_call>") and trained[2].endswith("</tool_call><|im_end|>")
    # role_to_mask does not apply to body roles; RL on the assistant + SFT on tool bodies (renderers' example)
    tools_only = build_training_sample(
        renderer, messages, tools=TOOLS, role_to_mask=lambda m: False, content_sft_roles=["tool"]
    )
    assert _trained_by_message(tools_only, rendered, decode) == {3: "Sunny, 21 C", 4: "Rain, 25 C"}
    # content == sampled on assistant tokens: body-only supervision of the assistant is the default mask
    assert build_training_sample(renderer, messages, tools=TOOLS, content_sft_roles={"assistant"}) == base
    # a renderer that cannot tell content ignores it (renderers' opaque renderers do)
    header = renderers["header"]
    assistant = {"role_to_mask": lambda m: m["role"] == "assistant"}
    short = [messages[1], messages[5]]
    assert build_training_sample(header, short, content_sft_roles={"user"}, **assistant) == build_training_sample(
        header, short, **assistant
    )
