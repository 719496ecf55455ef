"""The embedded default model files: a real Qwen2-VL tokenizer + processor built with no network.

The ``dashscope`` wheel ships ``qwen.tiktoken`` (the 151,643 BPE ranks Qwen2 / Qwen2-VL use). From it we build a
``tokenizers.Tokenizer``, add Qwen's special tokens on their real ids, wrap it with the published Qwen2-VL chat template
and save a processor directory that transformers 5 (and 4.57, for the verl oracle) loads like a hub download, with a
``config.json`` naming the model type, so that the folder is a model path verl's own loaders take.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

EMBEDDED_NAME = "embedded:qwen2-vl"

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen's added tokens, in id order from 151643 (order matters: added in this order they land on Qwen's real ids),
# with the "special" flag of the published tokenizers. Each family has a prefix of this list: Qwen2-VL the first 14,
# Qwen2.5 (and Qwen2.5-VL) 22, Qwen3 (and Qwen3-VL) all 26.
QWEN_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
QWEN2_VL_ADDED_TOKENS = 14

QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# bumped when the directory's files change form; an older directory is rebuilt
FORMAT_MARKER, FORMAT_VERSION = ".ray-ingest-format", "4"
# the folder's config.json (no weights): verl's hf_processor and rollout read the model type from it
MODEL_CONFIG = {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]}


def default_model_dir() -> Path:
    """Where the embedded tokenizer is built: ``$INGEST_MODEL_DIR`` or a per-user cache directory."""
    env = os.environ.get("INGEST_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ray-ingest" / "qwen2-vl-offline"


def _tiktoken_file() -> Path:
    import dashscope

    path = Path(dashscope.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"the installed dashscope package has no {path}; cannot build the offline tokenizer")
    return path


def build_offline_model_dir(out_dir: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Build (once) the Qwen2-VL tokenizer + processor directory from ``dashscope`` and return its path.

    Safe to call from many processes at once: the directory is written under a temporary name and renamed.
    """
    out = Path(out_dir) if out_dir is not None else default_model_dir()
    marker = out / FORMAT_MARKER
    if (out / "tokenizer_config.json").is_file() and not force:
        if marker.is_file() and marker.read_text() == FORMAT_VERSION:
            return out
        force = True  # built by an older version of this function

    tokenizer = build_qwen_tokenizer(QWEN2_VL_ADDED_TOKENS, QWEN2_VL_CHAT_TEMPLATE)

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

        processor = Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessor(),
            tokenizer=tokenizer,
            video_processor=Qwen2VLVideoProcessor(),
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
        )
        processor.save_pretrained(tmp)
        # transformers 4.57 (the verl oracle) reads these two files rather than processor_config.json's sections
        processor.image_processor.save_pretrained(tmp)
        processor.video_processor.save_pretrained(tmp)
    except ImportError:  # no torchvision: still a usable text tokenizer
        tokenizer.save_pretrained(tmp)
    finish_tokenizer_dir(tmp)
    (tmp / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2))
    (tmp / FORMAT_MARKER).write_text(FORMAT_VERSION)
    if out.exists() and force:
        import shutil

        shutil.rmtree(out)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


@functools.cache
def _qwen_bpe() -> str:
    """The ``tokenizers.Tokenizer`` of Qwen's BPE ranks alone, as JSON: converting the ranks takes seconds, and one
    process that builds several families' tokenizers converts them once."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # additional_special_tokens=[]: transformers 4.x iterates it (None fails); the added tokens are added after
    converter = TikTokenConverter(vocab_file=str(_tiktoken_file()), pattern=QWEN_PATTERN, additional_special_tokens=[])
    return converter.converted().to_str()


def build_qwen_tokenizer(added_tokens: int, chat_template: str):
    """A transformers tokenizer with Qwen's 151,643 BPE ranks (from ``dashscope``), the first ``added_tokens`` of
    ``QWEN_ADDED_TOKENS`` on their real ids, eos ``<|im_end|>``, pad ``<|endoftext|>`` and no unknown token, as the
    published Qwen tokenizers have them."""
    import transformers
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_qwen_bpe())
    for token, special in QWEN_ADDED_TOKENS[:added_tokens]:  # one at a time: each lands on the next id
        add = backend.add_special_tokens if special else backend.add_tokens
        add([AddedToken(token, special=special, normalized=False)])
    tokenizer_class = PreTrainedTokenizerFast
    if int(transformers.__version__.split(".")[0]) < 5:  # 4.x's Qwen2-VL processor takes only its Qwen2 class
        from transformers import Qwen2TokenizerFast as tokenizer_class
    tokenizer = tokenizer_class(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=chat_template,
    )
    if tokenizer.encode("Hello world") != [9707, 1879] or tokenizer.convert_tokens_to_ids("<|image_pad|>") != 151655:
        raise RuntimeError("the offline Qwen tokenizer does not reproduce Qwen's ids; dashscope's vocabulary changed?")
    return tokenizer


def finish_tokenizer_dir(model_dir: Path) -> None:
    """A saved tokenizer directory in the published form: loadable by transformers 4 and 5, merges compacted."""
    _make_loadable_by_transformers4(model_dir)
    _compact_tokenizer_json(model_dir / "tokenizer.json")


def _compact_tokenizer_json(path: Path) -> None:
    """Write merges as "a b" strings on one line, as Qwen's published tokenizer.json has them.

    tokenizers saves pretty-printed ``[a, b]`` pairs; the hub's form, half the size, parses in about half the time,
    which every tokenizer actor pays when it starts. The ids are the same: byte-level BPE tokens hold no spaces.
    """
    data = json.loads(path.read_text(encoding="utf-8"))
    merges = data["model"]["merges"]
    if any(" " in part for pair in merges if isinstance(pair, list) for part in pair):
        return  # a space inside a token: only the pair form can say it
    data["model"]["merges"] = [" ".join(pair) if isinstance(pair, list) else pair for pair in merges]
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")


def _make_loadable_by_transformers4(model_dir: Path) -> None:
    """transformers 5 writes ``TokenizersBackend``, unknown to 4.57 (the verl oracle); Qwen2Tokenizer works in both."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config["unk_token"] = None  # as published; a missing key gives Qwen2Tokenizer's default, <|endoftext|>
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def resolve_model_path(name_or_path: str | os.PathLike | None) -> str:
    """Map ``None`` / ``embedded:qwen2-vl`` to the offline directory (building it on this node if needed)."""
    if name_or_path is None or str(name_or_path) == EMBEDDED_NAME:
        return str(build_offline_model_dir())
    return os.fspath(name_or_path)
