"""Consumer side: causal shift in lockstep, truncation that never splits a placeholder run, packing with seq_lens."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ingest.sft.data import ModalityData, PlaceholderRange, TrainingSequence


def media_of(sample: Any) -> dict[str, ModalityData]:
    """A renderers sample's ``multi_modal_data`` (``mm_items`` / ``mm_hashes`` / ``mm_placeholders`` per modality)
    per modality, in stream order."""
    mm = sample.multi_modal_data
    if mm is None:
        return {}
    return {
        modality: ModalityData(
            [dict(item) for item in mm.mm_items.get(modality, [])],
            list(mm.mm_hashes.get(modality, [])),
            [PlaceholderRange(int(r.offset), int(r.length)) for r in ranges],
        )
        for modality, ranges in mm.mm_placeholders.items()
    }


def shift_and_truncate(sample: Any, max_length: int | None = None) -> TrainingSequence:
    """A renderers ``RenderedTrainingSample`` shifted in lockstep (inputs = ids[:-1], targets = ids[1:]) with at
    most ``max_length`` inputs, as prime-rl's SFT data does.

    A cut inside a placeholder run moves back to the run's start; media items past the cut are dropped (with their
    ``multi_modal_data`` entries). A sample of fewer than 2 tokens (or cut to 0 inputs) gives empty lists.
    """
    ids = sample.token_ids
    cut = max(len(ids) - 1, 0)
    if max_length is not None:
        if max_length < 0:
            raise ValueError(f"max_length must be >= 0, got {max_length}")
        cut = min(cut, max_length)
    data = media_of(sample)
    ranges = [r for d in data.values() for r in d.placeholders]
    moved = True
    while moved:
        moved = False
        for offset, length in ranges:
            if offset < cut < offset + length:
                cut, moved = offset, True
    kept: dict[str, ModalityData] = {}
    dropped = 0
    for modality, d in data.items():
        keep = [k for k, r in enumerate(d.placeholders) if r.offset + r.length <= cut]
        dropped += len(d.placeholders) - len(keep)
        if keep:
            kept[modality] = ModalityData(
                [d.items[k] for k in keep], [d.hashes[k] for k in keep], [d.placeholders[k] for k in keep]
            )
    types = sample.mm_token_type_ids
    return TrainingSequence(
        inputs=list(ids[:cut]),
        targets=list(ids[1 : cut + 1]),
        loss_mask=[bool(m) for m in sample.loss_mask[1 : cut + 1]],
        mm_token_type_ids=None if types is None else list(types[:cut]),
        multi_modal_data=kept or None,
        seq_lens=[cut] if cut else [],
        dropped_media=dropped,
    )


def pack(samples: Iterable[Any], token_budget: int) -> list[TrainingSequence]:
    """Greedy in-order packing into sequences of at most ``token_budget`` inputs, with per-sample ``seq_lens``.

    renderers' ``RenderedTrainingSample``s are shifted and truncated to the budget first; a ``TrainingSequence``
    longer than the budget is an error. Empty samples are skipped. Placeholder offsets are moved to the packed
    positions; ``mm_token_type_ids`` is None only when no packed sample has it (zeros fill in for text samples).
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    packs: list[list[TrainingSequence]] = []
    used = 0
    for sample in samples:
        seq = sample if isinstance(sample, TrainingSequence) else shift_and_truncate(sample, token_budget)
        n = len(seq.inputs)
        if n == 0:
            continue
        if n > token_budget:
            raise ValueError(f"a sample of {n} tokens does not fit token_budget={token_budget}; truncate it first")
        if not packs or used + n > token_budget:
            packs.append([])
            used = 0
        packs[-1].append(seq)
        used += n
    return [_concat(group) for group in packs]


def _concat(group: list[TrainingSequence]) -> TrainingSequence:
    inputs, targets, loss_mask, types, seq_lens = [], [], [], [], []
    typed = any(s.mm_token_type_ids is not None for s in group)
    data: dict[str, ModalityData] = {}
    for s in group:
        base = len(inputs)
        inputs += s.inputs
        targets += s.targets
        loss_mask += s.loss_mask
        if typed:
            types += s.mm_token_type_ids if s.mm_token_type_ids is not None else [0] * len(s.inputs)
        seq_lens += s.seq_lens or [len(s.inputs)]
        for modality, d in (s.multi_modal_data or {}).items():
            out = data.setdefault(modality, ModalityData([], [], []))
            out.items.extend(d.items)
            out.hashes.extend(d.hashes)
            out.placeholders.extend(PlaceholderRange(r.offset + base, r.length) for r in d.placeholders)
    return TrainingSequence(
        inputs,
        targets,
        loss_mask,
        types if typed else None,
        data or None,
        seq_lens,
        sum(s.dropped_media for s in group),
    )
