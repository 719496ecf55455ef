"""The rollout's side of ``data.media_handoff`` (the pipeline's: ``ingest.rollout_media``): a prompt's media,
made once by the pipeline, fetched once per rollout worker process and given to each of its samples.

``prompt_media`` resolves the URIs of a prompt's messages to its payload (through the loader's ``MediaStore``, then
this process's cache); ``sample_media`` gives a sample lists of its own; ``handed_off`` tells whether a sample's media
are still exactly its payload's, so that ``ingest.verl.agent_loop``'s classes may use the payload's prompt ids and
training inputs for them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from ingest.rollout_media import MEDIA_KINDS, NAMESPACE, URI_PREFIX, media_items, parse_media_uri, prompt_media_key

# prompts whose media a rollout worker process keeps (a prompt's n samples mostly run in one worker, one after another)
PROCESS_CACHE_PROMPTS = 64


# --- the rollout side -----------------------------------------------------------------------------------------------


class _ProcessCache:
    """The payloads this process fetched, most recent last."""

    def __init__(self, size: int):
        self.size = size
        self.payloads: OrderedDict[str, dict] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: str) -> dict | None:
        with self.lock:
            payload = self.payloads.get(key)
            if payload is not None:
                self.payloads.move_to_end(key)
            return payload

    def put(self, key: str, payload: dict) -> dict:
        with self.lock:
            self.payloads[key] = payload
            while len(self.payloads) > self.size:
                self.payloads.popitem(last=False)
            return payload


class HandedOffMedia(list):
    """A sample's own list of a payload's images (or videos), knowing its payload: verl's loops may add to the list
    they are given (the tool loop appends a tool's images), so each sample gets a list of its own, and the payload's
    prompt ids and training inputs are used only while the list still holds exactly the payload's media. Pickled as
    a plain list (it goes to the LLM server as verl's own would)."""

    def __init__(self, media: Iterable, payload: dict):
        super().__init__(media)
        self.payload = payload

    def __reduce__(self):
        return list, (list(self),)


_CACHE = _ProcessCache(PROCESS_CACHE_PROMPTS)
_STORES: dict[str, Any] = {}  # store name -> its actor handle (a read's store serves all its prompts)


def fetch_payload(store: str, key: str) -> dict:
    """One prompt's payload from the store ``store`` (this process's copy when it has one)."""
    payload = _CACHE.get(key)
    return payload if payload is not None else fetch_payloads(store, [key])[0]


def fetch_payloads(store: str, keys: list[str]) -> list[dict]:
    """Prompts' payloads from the store ``store`` in one lookup and one fetch (this process's copies where it has
    them), each kept in this process's cache."""
    import ray
    from ray.exceptions import ObjectLostError, OwnerDiedError, RayActorError

    from ingest.rollout_media import decode_payload

    payloads = {key: _CACHE.get(key) for key in keys}
    missing = [key for key, payload in payloads.items() if payload is None]
    if missing:
        try:
            actor = _STORES.get(store) or _STORES.setdefault(store, ray.get_actor(store, namespace=NAMESPACE))
            found = ray.get(actor.lookup_many.remote(missing))
        except (ValueError, RayActorError) as exc:
            _STORES.pop(store, None)
            raise LookupError(
                f"{URI_PREFIX}{store}/{missing[0]}: its media store is gone (the loader that made these rows ended, "
                "or its node was lost): the rows must be read again"
            ) from exc
        for key, entry in zip(missing, found, strict=True):
            if entry is None:
                (row,) = ray.get(actor.released_rows.remote([key]))
                where = "from another run" if row is None else f"released after its step; {row[0]}: row {row[1]}"
                raise LookupError(
                    f"{URI_PREFIX}{store}/{key}: no such prompt media in the store ({where}): rows with media URIs "
                    "are valid only while the loader that made them holds them"
                )
        refs = list(dict.fromkeys(entry[0][0] for entry in found))  # a store object holds several prompts' payloads
        try:
            objects = dict(zip(refs, ray.get(refs), strict=True))
        except (ObjectLostError, OwnerDiedError) as exc:
            gone = {ref for ref in refs if _is_lost(ref)}  # each object asked once (it holds several prompts')
            lost = [f"{file}: row {row}" for (ref,), _, file, row in found if ref in gone]
            raise RuntimeError(f"prompt media lost from the object store; rows: {', '.join(lost)} ({exc})") from exc
        for key, ((ref,), index, _, _) in zip(missing, found, strict=True):
            payloads[key] = _CACHE.put(key, decode_payload(objects[ref][index]))
    return [payloads[key] for key in keys]


def _is_lost(ref: Any) -> bool:
    """Whether the object ``ref`` can no longer be fetched (asked once a batch fetch failed: which rows to name)."""
    import ray
    from ray.exceptions import ObjectLostError, OwnerDiedError

    try:
        ray.get(ref)
    except (ObjectLostError, OwnerDiedError):
        return True
    return False


def batch_raw_prompts(batch: Any) -> Iterable[Any] | None:
    """A worker's batch's ``raw_prompt`` messages: a ``DataProto``'s non-tensor column (verl's legacy worker) or a
    ``TensorDict``'s non-tensor stack (its v1 worker, which gets each step's prompts for it as one batch too)."""
    non_tensor = getattr(batch, "non_tensor_batch", None)
    if non_tensor is not None:
        return non_tensor.get("raw_prompt")
    if not hasattr(batch, "keys") or "raw_prompt" not in batch.keys():
        return None
    raw = batch.get("raw_prompt")
    return raw.tolist() if hasattr(raw, "tolist") else raw


def prefetch(raw_prompts: Iterable[Any]) -> None:
    """Fetches the payloads of a batch's prompts (its ``raw_prompt`` messages) in one call per store, so that its
    samples find them in this process's cache (at most ``PROCESS_CACHE_PROMPTS`` of them). Best effort: where one
    payload cannot be had (released, lost), each prompt fetches its own, and only that prompt fails, with its error
    (verl's v1 worker then tags that prompt alone ``failure``)."""
    by_store: dict[str, dict[str, None]] = {}
    for messages in raw_prompts:
        found = prompt_media_key(messages)
        if found is not None:
            by_store.setdefault(found[0], {})[found[1]] = None
    for store, keys in by_store.items():
        keys = list(keys)[-PROCESS_CACHE_PROMPTS:]
        try:
            fetch_payloads(store, keys)
        except (LookupError, RuntimeError):
            continue


def prompt_media(messages: Iterable[Mapping]) -> dict | None:
    """The payload of the prompt whose ``messages`` hold media URIs, None where they hold none. Every media item
    must be a URI of one prompt: a row mixing URIs and media is an error (it was not made by the hand-off)."""
    items = media_items(messages)
    parsed = [parse_media_uri(item.get(item["type"])) for item in items]
    if not any(parsed):
        return None
    if not all(parsed) or len({(p[0], p[1]) for p in parsed}) != 1:
        raise ValueError("a prompt's media items must all be ingest-media URIs of one prompt (data.media_handoff)")
    store, key, _, _ = parsed[0]
    payload = fetch_payload(store, key)
    counts = {kind: len(payload[f"{kind}s"] or ()) for kind in MEDIA_KINDS}
    if any(index >= counts[kind] for _, _, kind, index in parsed) or len(parsed) != sum(counts.values()):
        raise ValueError(f"{URI_PREFIX}{store}/{key}: the prompt's media items do not match its payload {counts}")
    return payload


def handed_off(images: Any, videos: Any) -> dict | None:
    """The payload whose media ``images`` / ``videos`` are (``HandedOffMedia`` of one payload, each still holding
    exactly that payload's items, and no other kind of media), else None: media a trajectory added or made itself
    are never taken for the prompt's."""
    payload = None
    for media, kind in ((images, "images"), (videos, "videos")):
        if media is None:
            continue
        owner = getattr(media, "payload", None)
        if owner is None or (payload is not None and owner is not payload):
            return None
        own = owner[kind] or []
        if len(media) != len(own) or any(a is not b for a, b in zip(media, own, strict=True)):
            return None
        payload = owner
    if (
        payload is None
        or (images is None) != (payload["images"] is None)
        or (videos is None) != (payload["videos"] is None)
    ):
        return None
    return payload


def sample_media(payload: dict) -> tuple:
    """``(images, videos, audios)`` of a payload for one sample: lists of its own (``HandedOffMedia``)."""
    images, videos = payload["images"], payload["videos"]
    return (
        None if images is None else HandedOffMedia(images, payload),
        None if videos is None else HandedOffMedia(videos, payload),
        payload["audios"],
    )
