"""Chat templates (``ingest/tokenizer/template.py``): the plain Python Qwen2-VL renderer equals Jinja."""

from __future__ import annotations


def test_plain_python_qwen2_vl_renderer_equals_jinja():
    """The Python renderer of the embedded template gives Jinja's exact text, or None where it does not apply."""
    import random

    from ingest.tokenizer.offline import QWEN2_VL_CHAT_TEMPLATE
    from ingest.tokenizer.template import compile_chat_template, qwen2_vl_text_renderer, render_chat

    fast = qwen2_vl_text_renderer(QWEN2_VL_CHAT_TEMPLATE)
    jinja = compile_chat_template(QWEN2_VL_CHAT_TEMPLATE)
    rng = random.Random(5)
    pieces = ["", " ", "\n", "hi", "{{ x }}", "{% if %}", "<|im_end|>", "<image>", "日本語 🤖", "\t  \n\n", "None"]
    roles = ["system", "user", "assistant", "tool", "System", "ipython", ""]
    for _ in range(400):
        messages = [
            {"role": rng.choice(roles), "content": "".join(rng.choices(pieces, k=rng.randint(0, 5)))}
            for _ in range(rng.randint(1, 5))
        ]
        if rng.random() < 0.3:
            messages[0]["extra"] = None  # Arrow struct rows carry every field
        for generation in (True, False):
            expected = render_chat(jinja, messages, add_generation_prompt=generation, special_tokens={})
            assert fast(messages, generation) == expected, messages
    # content lists (after the <image> split) and non-strings are left to Jinja
    assert fast([{"role": "user", "content": [{"type": "text", "text": "x"}]}], True) is None
    assert fast([{"role": "user", "content": None}], True) is None
    assert qwen2_vl_text_renderer(QWEN2_VL_CHAT_TEMPLATE + " ") is None


def test_template_kwargs_reach_the_template_and_verl_05_rows_ignore_them(model_dir):
    """``apply_chat_template_kwargs``: the template's variables (Qwen2-VL's ``add_vision_id``), ``chat_template``;
    verl 0.5.0 never reads the key, so its rows render without them."""
    from ingest.config import DataConfig
    from ingest.stages.tokenize import PromptTokenizeStage
    from ingest.tokenizer.chat import ChatTokenizer

    chat = ChatTokenizer(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    assert "Picture 1: " in chat.render(messages, add_vision_id=True)
    assert "Picture 1: " not in chat.render(messages)
    assert chat.render(messages, chat_template="{{ messages[0]['role'] }}!") == "user!"
    kwargs = {"apply_chat_template_kwargs": {"add_vision_id": True}}
    assert PromptTokenizeStage(chat, DataConfig(**kwargs)).template_kwargs == {}
    assert PromptTokenizeStage(chat, DataConfig(row_format="verl-0.6", **kwargs)).template_kwargs == {
        "add_vision_id": True
    }
