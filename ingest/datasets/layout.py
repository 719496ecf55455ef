"""Which actors run the stages, chosen from the cluster when the config leaves the pool sizes unset.

Text rows: up to one tokenizer actor per CPU but one, the consumer's (the process that collates the batches). A
tokenizer actor's batch encode already runs on every core of its machine; on a 2-CPU machine a second actor adds a
process and no rows/s, while a 16-CPU machine goes on gaining up to 16 actors (figures in docs/benchmarks.md).

Media rows: the one-pool layout runs decode and vision in the tokenizer actors; the separate layout gives each stage
a pool of its own. On a small CPU-only cluster every extra actor process costs a start-up and one more object-store
copy of the pixels, and the one pool is faster; with more cores, or GPU vision actors, stages scale apart
(docs/benchmarks.md has the measurements behind the threshold). Sizes set in the config always win.

No pool is larger than its input can keep busy (``fit_to_input``): an actor takes whole read units, so a pool has at
most one per unit; a text pool at most one per ``TEXT_ROWS_PER_ACTOR`` rows, since an actor's start (a process, Ray
Data, the tokenizer: 1-2 s of CPU) costs more than the rows it would take from the others below that. A validation
set of a few thousand rows then gets one tokenizer actor, not one per CPU (figures in docs/benchmarks.md).

Where the driver makes an epoch's first rows while the cluster starts (``datasets/handoff.py``), text rows on a
cluster whose layout is a single tokenizer actor stay in the driver for the whole epoch: that actor plus the driver's
collate make fewer rows/s than the driver alone, and its process costs memory. So do media rows on a CPU-only
cluster of two CPUs: the driver's two threads (decode, resize and encode release the GIL) beat the one-pool actors,
whose pixels also cross the object store (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ingest.config import SEPARATE_POOL_SIZE, DataConfig

# a text tokenizer actor for each this many rows of the input (about two seconds of one actor's tokenizing)
TEXT_ROWS_PER_ACTOR = 8192
# a CPU-only cluster with at most this many CPUs gets the one-pool layout
ONE_POOL_MAX_CPUS = 4
# media rows stay in the driver (two threads) on a cluster with at most this many CPUs (measured on 2)
DRIVER_MEDIA_MAX_CPUS = 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """The pools' sizes a run uses and why (printed in the run's log and summary)."""

    name: str  # "text", "one-pool", "separate" or "config" (sizes set by the user)
    reason: str
    tokenizer_pool_max_size: int
    decode_pool_max_size: int = 0
    vision_pool_max_size: int = 0

    def apply(self, cfg: DataConfig) -> DataConfig:
        """``cfg`` with this layout's pool sizes."""
        return dataclasses.replace(
            cfg,
            tokenizer_pool_max_size=self.tokenizer_pool_max_size,
            decode_pool_max_size=self.decode_pool_max_size,
            vision_pool_max_size=self.vision_pool_max_size,
        )

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_layout(cfg: DataConfig, resources: Mapping[str, float], *, media: bool = True) -> Layout:
    """The layout for ``cfg`` on a cluster with ``resources`` (``ray.cluster_resources()``); ``media``: rows with
    images or videos (a processor), else text rows."""
    cpus = resources.get("CPU", 0.0)
    if not media:
        if cfg.tokenizer_pool_max_size is not None:
            return Layout("config", "pool size set in the config", cfg.tokenizer_pool_max_size)
        size = max(cfg.tokenizer_pool_min_size, int(cpus) - 1, 1)
        actors = "actor" if size == 1 else "actors"
        return Layout("text", f"{cpus:g} CPUs: up to {size} tokenizer {actors}, one per CPU but the consumer's", size)
    tokenizer = cfg.pool_max_size("tokenizer")
    decode, vision = cfg.decode_pool_max_size, cfg.vision_pool_max_size
    if decode is not None or vision is not None:
        decode = SEPARATE_POOL_SIZE if decode is None else decode
        vision = SEPARATE_POOL_SIZE if vision is None else vision
        return Layout("config", "pool sizes set in the config", tokenizer, decode, vision)
    if cfg.vision_num_gpus:
        reason = f"GPU vision actors (vision_num_gpus {cfg.vision_num_gpus:g}) need a pool of their own"
        return Layout("separate", reason, tokenizer, SEPARATE_POOL_SIZE, SEPARATE_POOL_SIZE)
    if cpus <= ONE_POOL_MAX_CPUS:
        reason = f"{cpus:g} CPUs <= {ONE_POOL_MAX_CPUS}: decode and vision in the tokenizer actors"
        return Layout("one-pool", reason, tokenizer, 0, 0)
    reason = f"{cpus:g} CPUs > {ONE_POOL_MAX_CPUS}: decode and vision pools of their own"
    return Layout("separate", reason, tokenizer, SEPARATE_POOL_SIZE, SEPARATE_POOL_SIZE)


def fit_to_input(layout: Layout, cfg: DataConfig, *, units: int, rows: int, media: bool) -> Layout:
    """``layout`` with no pool larger than an input of ``units`` read units and ``rows`` rows can keep busy: at most
    one actor per unit, and for text rows one per ``TEXT_ROWS_PER_ACTOR`` rows (a pool's min size stays). Sizes the
    user set are kept as they are."""
    if layout.name == "config":
        return layout
    cap = units if media else min(units, -(-rows // TEXT_ROWS_PER_ACTOR))
    sizes = {}
    for pool in ("tokenizer", "decode", "vision"):
        size = getattr(layout, f"{pool}_pool_max_size")
        sizes[f"{pool}_pool_max_size"] = max(min(size, cap), getattr(cfg, f"{pool}_pool_min_size")) if size else 0
    if all(sizes[name] == getattr(layout, name) for name in sizes):
        return layout
    what = "read units" if media else f"rows (one actor per {TEXT_ROWS_PER_ACTOR:,})"
    amount = units if media else rows
    return dataclasses.replace(layout, **sizes, reason=f"{layout.reason}; {amount:,} {what}: at most {max(cap, 1)}")


def driver_keeps_epoch(cfg: DataConfig, resources: Mapping[str, float], *, media: bool) -> str | None:
    """Why the driver, already making an epoch's rows, should make the whole epoch rather than hand it to the actors
    on a cluster with ``resources``; None where the actors are worth their start (or the user set the sizes).
    ``media``: rows with images or videos whose stages the driver runs on the CPU."""
    layout = choose_layout(cfg, resources, media=media)
    if media:
        cpus = resources.get("CPU", 0.0)
        if layout.name != "one-pool" or cpus > DRIVER_MEDIA_MAX_CPUS:
            return None
        return f"media rows, {layout.describe()}: the driver's two threads make them faster than those actors"
    if layout.name != "text" or layout.tokenizer_pool_max_size > 1:
        return None
    return f"text rows, {layout.describe()}: the driver alone makes them faster than that actor with its collate"
