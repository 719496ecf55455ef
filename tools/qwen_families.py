"""Offline tokenizers of the Qwen families the SFT tests render with, built like the embedded default (Qwen's BPE ranks
from ``dashscope``, no network), each with its family's published added tokens, ids and chat template.

- ``qwen2.5``: Qwen/Qwen2.5-*-Instruct: 22 added tokens (151643-151664, ``<tool_call>`` and the FIM tokens not
  special), its chat template (``templates/qwen2.5.jinja``, the published one).
- ``qwen3``: Qwen/Qwen3-*: 26 added tokens (to ``</think>`` 151668), the hybrid-thinking template
  (``templates/qwen3.jinja``); renderers' hand-written Qwen3 renderer gives the same ids as
  ``apply_chat_template`` with it (tests/test_sft_renderers.py).
- ``qwen3-vl``: Qwen3's tokenizer in the Qwen3-VL processor directory of ``tools.samples.qwen3_vl_model_dir``.

Qwen3.5 and later use a vocabulary no PyPI package ships; their renderers are exercised on Qwen3's vocabulary, which
holds every special token they ask for (not their published ids).
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


def qwen3_vl_sft_dir(out_dir: str | os.PathLike) -> str:
    """The Qwen3-VL processor directory with Qwen3's tokenizer (its 26 added tokens)."""
    from tools.samples import qwen3_vl_model_dir

    out = Path(out_dir)
    if (out / "tokenizer.json").is_file() and (out / "preprocessor_config.json").is_file():
        return str(out)
    tmp = Path(f"{out}.tmp-{os.getpid()}")
    qwen3_vl_model_dir(tmp)
    tokenizer = Path(qwen_tokenizer_dir(f"{tmp}-tokenizer", "qwen3"))
    shutil.copy(tokenizer / "tokenizer.json", tmp / "tokenizer.json")
    config = json.loads((tmp / "tokenizer_config.json").read_text())
    config.update({k: v for k, v in json.loads((tokenizer / "tokenizer_config.json").read_text()).items()
                   if k not in ("processor_class", "chat_template")})  # fmt: skip
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(tokenizer)
    tmp.rename(out)
    return str(out)
