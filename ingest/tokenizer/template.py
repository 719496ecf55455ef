"""Chat-template rendering without importing transformers (its import alone is seconds of every actor start).

The Jinja environment is the one transformers builds in ``_cached_compile_jinja_template`` (sandboxed, trim/lstrip
blocks, loop controls, its ``tojson`` / ``raise_exception`` / ``strftime_now`` / ``dict`` / ``namespace`` globals);
``{% generation %}`` blocks render their body (what transformers does when no assistant mask is requested). Messages
are passed as given, as transformers 4.x (the verl 0.5.0 oracle) passed them.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """Namespaces that reject underscore names (no reaching CPython internals from a Hub template)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def render_chat(
    template: jinja2.Template,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    special_tokens: dict,
    tools: list | None = None,
) -> str:
    return template.render(
        messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **special_tokens
    )


def qwen2_vl_text_renderer(source: str):
    """A plain-Python renderer equal to ``source`` on text-only chats, when ``source`` is the published Qwen2-VL
    template (the embedded default's); None for any other template.

    Jinja's context set-up and sandbox checks per prompt are a large share of a tokenizer actor's time on short prompts
    (docs/design.md). The returned function gives the template's exact text for messages whose role and content are
    strings and returns None for anything else (content lists, other types), which then goes through Jinja.
    ``tests/tokenizer/test_template.py`` checks it against Jinja on generated chats."""
    from ingest.tokenizer.offline import QWEN2_VL_CHAT_TEMPLATE

    if source != QWEN2_VL_CHAT_TEMPLATE:
        return None
    default_system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"

    def render(messages: list, add_generation_prompt: bool) -> str | None:
        parts = []
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if type(role) is not str or type(content) is not str:
                return None
            if i == 0 and role != "system":
                parts.append(default_system)
            parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    return render
