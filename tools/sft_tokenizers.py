"""Offline tokenizers of the families the SFT tests render with, from vocabularies PyPI packages ship (no network).

Qwen's are built like the embedded default (Qwen's BPE ranks from ``dashscope``), each with its family's published
added tokens, ids and chat template:

- ``qwen2.5``: Qwen/Qwen2.5-*-Instruct: 22 added tokens (151643-151664, ``<tool_call>`` and the FIM tokens not
  special), its chat template (``templates/qwen2.5.jinja``, the published one).
- ``qwen3``: Qwen/Qwen3-*: 26 added tokens (to ``</think>`` 151668), the hybrid-thinking template
  (``templates/qwen3.jinja``); renderers' hand-written Qwen3 renderer gives the same ids as
  ``apply_chat_template`` with it (tests/test_sft_renderers.py).
- ``qwen3-vl``: Qwen3's tokenizer in the Qwen3-VL processor directory of ``tools.samples.qwen3_vl_model_dir``.

Qwen3.5 and later use a vocabulary no PyPI package ships; their renderers are exercised on Qwen3's vocabulary, which
holds every special token they ask for (not their published ids).

``llama-3``: Llama 3's 128,000 BPE ranks and pre-tokenizer pattern from Meta's ``llama-models`` wheel, with the 256
special tokens on their published ids (128000 ``<|begin_of_text|>`` ... 128009 ``<|eot_id|>``, 128010
``<|python_tag|>``, the rest reserved, named as in the published tokenizers) and ``<|begin_of_text|>`` added in
front as they add it. No chat template: renderers' Llama 3 renderer is written out, and no template was at hand.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
# family -> (added tokens, chat template file)
FAMILIES = {"qwen2.5": (22, "qwen2.5.jinja"), "qwen3": (26, "qwen3.jinja")}


def qwen_tokenizer_dir(out_dir: str | os.PathLike, family: str) -> str:
    """A tokenizer directory of ``family`` (``qwen2.5``, ``qwen3``), built once."""
    from ingest.tokenizer.offline import build_qwen_tokenizer, finish_tokenizer_dir

    out = Path(out_dir)
    if (out / "tokenizer_config.json").is_file():
        return str(out)
    added, template = FAMILIES[family]
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    build_qwen_tokenizer(added, (TEMPLATES / template).read_text()).save_pretrained(tmp)
    finish_tokenizer_dir(tmp)
    tmp.rename(out)
    return str(out)


def qwen3_vl_sft_dir(out_dir: str | os.PathLike, qwen3_dir: str | os.PathLike | None = None) -> str:
    """The Qwen3-VL processor directory with Qwen3's tokenizer (its 26 added tokens; ``qwen3_dir``: a built one)."""
    from tools.samples import qwen3_vl_model_dir

    out = Path(out_dir)
    if (out / "tokenizer.json").is_file() and (out / "preprocessor_config.json").is_file():
        return str(out)
    tmp = Path(f"{out}.tmp-{os.getpid()}")
    qwen3_vl_model_dir(tmp)
    tokenizer = Path(qwen3_dir or qwen_tokenizer_dir(f"{tmp}-tokenizer", "qwen3"))
    shutil.copy(tokenizer / "tokenizer.json", tmp / "tokenizer.json")
    config = json.loads((tmp / "tokenizer_config.json").read_text())
    config.update({k: v for k, v in json.loads((tokenizer / "tokenizer_config.json").read_text()).items()
                   if k not in ("processor_class", "chat_template")})  # fmt: skip
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if qwen3_dir is None:
        shutil.rmtree(tokenizer)
    tmp.rename(out)
    return str(out)


# Llama 3.1 / 3.2's named special tokens by their offset from 128000; every other one of the 256 is reserved
LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens in id order: the named ones, the others ``<|reserved_special_token_K|>`` counted up."""
    tokens, reserved = [], 0
    for offset in range(256):
        if offset in LLAMA3_NAMED:
            tokens.append(LLAMA3_NAMED[offset])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


def llama3_tokenizer_dir(out_dir: str | os.PathLike) -> str:
    """A Llama 3 tokenizer directory from ``llama-models``' vocabulary, built once; checked against its own tiktoken
    encoding."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    out = Path(out_dir)
    if (out / "tokenizer_config.json").is_file():
        return str(out)
    from llama_models.llama3 import tokenizer as meta

    model_file = Path(meta.__file__).parent / "tokenizer.model"
    converter = TikTokenConverter(
        vocab_file=str(model_file), pattern=meta.Tokenizer.pat_str, additional_special_tokens=[]
    )
    backend = converter.converted()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in llama3_special_tokens()])
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 128000)],
    )  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", unk_token=None
    )
    probe = "Hello, world! 123456 naïve café — 日本語\n\n  x"
    reference = meta.Tokenizer(model_file)
    if tokenizer.encode(probe, add_special_tokens=False) != reference.encode(probe, bos=False, eos=False):
        raise RuntimeError("the offline Llama 3 tokenizer does not encode as llama-models' own")
    if tokenizer.convert_tokens_to_ids("<|eot_id|>") != 128009 or len(tokenizer) != 128256:
        raise RuntimeError("the offline Llama 3 tokenizer's special tokens are not on their ids")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return str(out)
