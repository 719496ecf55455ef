"""``model_for_actors``: what the SFT actors load for a tokenizer or processor: a path or hub name as it is, a
transformers object as the directory it was loaded from (when unchanged since) or else saved once to a temporary
directory (``actors.sft.SavedModel``). Objects are never pickled to the actors."""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

import ray

from ingest.tokenizer.chat import ChatTokenizer

# saved tokenizer / processor objects of this driver: (what they looked like when saved, the SavedModel)
_SAVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_for_actors(model: Any, what: str = "tokenizer") -> Any:
    """What the actors load for ``model``: paths and names as they are (as strings); a transformers tokenizer loaded
    from a local directory and unchanged since (same chat template, special tokens, vocabulary and ids) as that
    directory; any other tokenizer or processor object saved once to a temporary directory (``SavedModel``).

    Objects are never pickled to the actors: a tokenizer can be large, can hold state that does not pickle, and its
    class may not even be importable where the actors run.
    """
    if model is None or isinstance(model, str | os.PathLike):
        return None if model is None else os.fspath(model)
    if isinstance(model, ChatTokenizer):
        return model.path
    if not (is_tokenizer_object(model) or is_processor_object(model) or hasattr(model, "save_pretrained")):
        raise TypeError(
            f"{what} must be a path, a hub name or a transformers {what} object, got {type(model).__name__}"
        )
    name = getattr(model, "name_or_path", "") or ""
    if is_tokenizer_object(model) and name and os.path.isdir(name) and _same_tokenizer(model, name):
        return name
    fingerprint = _model_fingerprint(model)
    try:
        saved = _SAVED.get(model)
    except TypeError:  # not weakly referenceable: no reuse
        saved = None
    if saved is not None and saved[0] == fingerprint:
        return saved[1]
    from actors.sft import SAVED_MODEL_MARKER, SavedModel

    directory = tempfile.mkdtemp(prefix=f"ray-ingest-{what}-")
    atexit.register(shutil.rmtree, directory, True)
    try:
        model.save_pretrained(directory)
    except Exception as exc:
        raise ValueError(
            f"cannot hand the {what} object ({type(model).__name__}) to the actors: its name_or_path {name!r} is not a "
            f"local directory holding the same {what}, and save_pretrained failed ({type(exc).__name__}: {exc}); "
            f"pass a {what} directory or hub name"
        ) from exc
    files = {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(Path(directory).rglob("*"))
        if path.is_file()
    }
    digest = hashlib.sha256()
    for rel, data in files.items():
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    (Path(directory) / SAVED_MODEL_MARKER).write_text(digest.hexdigest())
    from ingest.datasets.pools import ensure_ray

    ensure_ray()
    saved_model = SavedModel(directory, digest.hexdigest(), ray.put(files))
    try:
        _SAVED[model] = (fingerprint, saved_model)
    except TypeError:
        pass
    return saved_model


def _model_fingerprint(model: Any) -> tuple:
    """What a saved object looked like: a changed template or vocabulary means saving again."""
    tokenizer = getattr(model, "tokenizer", model)
    template = getattr(model, "chat_template", None)
    vocabulary = len(tokenizer) if is_tokenizer_object(tokenizer) else None
    special = sorted(getattr(tokenizer, "special_tokens_map", {}).items(), key=str) if vocabulary else None
    return (type(model).__name__, str(template), vocabulary, str(special))


def _same_tokenizer(model: Any, directory: str) -> bool:
    """Whether ``directory`` loads the tokenizer ``model`` is, as far as a render can tell: chat template, special
    tokens, vocabulary size and the ids of a probe holding every added token."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(directory)
    except Exception:
        return False
    if model.chat_template != loaded.chat_template or model.special_tokens_map != loaded.special_tokens_map:
        return False
    if len(model) != len(loaded):
        return False
    added = "".join(str(t) for t in getattr(model, "added_tokens_decoder", {}).values())
    probe = f"Hello, world! 123 \u00fc\u4e2d\n\n  x{added}"
    return model(probe, add_special_tokens=False)["input_ids"] == loaded(probe, add_special_tokens=False)["input_ids"]


def is_transformers_instance(obj: object, *class_names: str) -> bool:
    """``isinstance(obj, transformers.<name>)`` for any of ``class_names``, without importing transformers (an object
    of one of its classes can only exist once the caller imported it)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    for name in class_names:
        try:
            cls = getattr(transformers, name)
        except Exception:  # a lazy attribute whose backend is missing
            continue
        if isinstance(obj, cls):
            return True
    return False


def is_tokenizer_object(obj: object) -> bool:
    return is_transformers_instance(obj, "PreTrainedTokenizerBase")


def is_processor_object(obj: object) -> bool:
    return is_transformers_instance(obj, "ProcessorMixin")
