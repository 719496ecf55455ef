"""The two test tiers: ``make test`` runs what is not marked ``slow`` (its budget: 10 minutes of pytest on 2 cores),
``make test-all`` runs everything. A parametrized test keeps its first case in the fast tier with ``first_fast``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

slow = pytest.mark.slow


def first_fast(values: Iterable, ids: Sequence[str] | None = None) -> list:
    """``values`` for ``pytest.mark.parametrize``: the first runs in both tiers, the others in the full one only (the
    test ids are those plain ``values`` / ``ids`` would give). A tuple is one value per argument name."""
    return [
        pytest.param(*(value if isinstance(value, tuple) else (value,)), id=None if ids is None else ids[i], marks=mark)
        for i, value in enumerate(values)
        for mark in [() if i == 0 else slow]
    ]
