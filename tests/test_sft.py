"""The pipeline's parts around renderers (ingest.sft): renderers' samples shifted, truncated (never inside a media
run) and packed as prime-rl consumes them; the conversation checks before rendering; the engine's media parts, its
renderer configs and its one-line answer where renderers cannot run. No Ray (tests/test_sft_renderers.py compares
the pipeline's rows with renderers itself)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ingest.sft import PlaceholderRange, TrainingSequence, conversation_problem, pack, shift_and_truncate
from ingest.sft.engine import attach_media, import_renderers, renderer_config

renderers = pytest.importorskip("renderers")
from renderers import MultiModalData, RenderedTrainingSample  # noqa: E402
from renderers import PlaceholderRange as RenderersRange  # noqa: E402


def test_renderers_names_stay_renderers_own():
    """A prime-rl user's ``from renderers import create_renderer, build_training_sample`` is unchanged beside ours:
    ingest.sft exports nothing under those names."""
    import ingest.sft

    assert not hasattr(ingest.sft, "create_renderer") and not hasattr(ingest.sft, "build_training_sample")
    assert "create_renderer" not in ingest.sft.__all__ and "build_training_sample" not in ingest.sft.__all__
    from renderers import build_training_sample, create_renderer

    assert create_renderer.__module__ == build_training_sample.__module__ == "renderers.base"


def test_without_renderers_or_on_python_3_10_sft_says_so_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "renderers", None)  # import renderers -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'ray-ingest\[sft\]'") as missing:
        import_renderers()
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    with pytest.raises(ImportError, match="needs Python 3.11 or newer; this is Python 3.10") as old:
        import_renderers()
    assert "\n" not in str(missing.value) and "\n" not in str(old.value)


def test_renderer_config_takes_a_config_or_a_renderer():
    from renderers import create_renderer
    from renderers.configs import Qwen3RendererConfig

    config = Qwen3RendererConfig(enable_thinking=False)
    assert renderer_config(config) is config and renderer_config(None) is None

    class Tokenizer:  # what the Qwen3 renderer asks of a tokenizer at construction
        name_or_path = "stand-in"
        unk_token_id = None

        def convert_tokens_to_ids(self, token):
            return 7

    assert renderer_config(create_renderer(Tokenizer(), config)) == config
    with pytest.raises(TypeError, match="renderers config or a renderer"):
        renderer_config("qwen3")


def test_media_fill_their_parts_in_order():
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image", "image": b"own"}, {"type": "video"}]},
    ]
    out = attach_media(messages, {"image": [b"a", b"b"], "video": [[b"f1", b"f2"]]})
    assert [p.get("image") for p in out[0]["content"]] == [b"a", None, b"b"]
    assert out[2]["content"] == [{"type": "image", "image": b"own"}, {"type": "video", "video": [b"f1", b"f2"]}]
    assert messages[0]["content"][0] == {"type": "image"}  # the caller's messages are not changed
    with pytest.raises(ValueError, match="more image parts than the row has images"):
        attach_media(messages, {"image": [b"a"]})
    with pytest.raises(ValueError, match="more images than the conversation has image parts"):
        attach_media(messages, {"image": [b"a", b"b", b"c"]})


# --- consumer side: shift, truncation, packing ----------------------------------------------------------------------


def _mm_sample() -> RenderedTrainingSample:
    """renderers' sample of 10 tokens: image run (2, 3), video run (7, 2)."""
    mm = MultiModalData(
        mm_hashes={"image": ["img"], "video": ["vid"]},
        mm_placeholders={"image": [RenderersRange(2, 3)], "video": [RenderersRange(7, 2)]},
        mm_items={
            "image": [{"pixel_values": np.zeros((12, 4), np.float32)}],
            "video": [{"pixel_values_videos": np.ones((8, 4), np.float32)}],
        },
    )
    ids = list(range(100, 110))
    mask = [False] * 5 + [True] * 5
    return RenderedTrainingSample(ids, mask, mm, [0, 0, 1, 1, 1, 0, 0, 2, 2, 0])


def _kept(sample, modality: str):
    """The sample's media of ``modality`` as a sequence holds them."""
    mm = sample.multi_modal_data
    return (
        mm.mm_items[modality],
        mm.mm_hashes[modality],
        [PlaceholderRange(r.offset, r.length) for r in mm.mm_placeholders[modality]],
    )


def test_shift_in_lockstep():
    sample = _mm_sample()
    seq = shift_and_truncate(sample)
    assert seq.inputs == sample.token_ids[:-1] and seq.targets == sample.token_ids[1:]
    assert seq.loss_mask == sample.loss_mask[1:] and seq.mm_token_type_ids == sample.mm_token_type_ids[:-1]
    assert seq.seq_lens == [9] and seq.dropped_media == 0
    for modality in ("image", "video"):
        data = seq.multi_modal_data[modality]
        assert (data.items, data.hashes, data.placeholders) == _kept(sample, modality)
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
        data = seq.multi_modal_data[modality]
        assert (data.items, data.hashes, data.placeholders) == _kept(sample, modality)


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


def test_a_renderer_that_cannot_tell_sampled_tokens_needs_role_to_mask_said_once():
    from renderers import create_renderer
    from renderers.configs import DefaultRendererConfig

    from ingest.sft.engine import check_role_to_mask

    class Tokenizer:  # apply_chat_template's shape, as renderers' default renderer calls it
        name_or_path = "stand-in"
        eos_token_id = 2

        def apply_chat_template(self, messages, **kwargs):
            return [1] * (3 * len(messages))

    renderer = create_renderer(Tokenizer(), DefaultRendererConfig())
    with pytest.raises(ValueError, match="does not populate sampled_mask.*pass role_to_mask"):
        check_role_to_mask(renderer, None)
    check_role_to_mask(renderer, lambda m: m["role"] == "assistant")
