"""The test tiers: ``make test`` runs what is not marked ``slow`` (its budget: 10 minutes of pytest on the slowest
VM), ``make test-all`` runs everything; ``make test-envs-ci`` runs what is marked ``matrix`` in each verl release's
own environment (``make test-envs``: each release's modules whole). A parametrized test keeps its first case in the
fast tier with ``first_fast``, in the matrix's CI tier with ``first_in_matrix`` (or ``first_fast(..., matrix=True)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

slow = pytest.mark.slow
matrix = pytest.mark.matrix


def _first_marked(values: Iterable, ids: Sequence[str] | None, first: tuple, rest: tuple) -> list:
    return [
        pytest.param(*(value if isinstance(value, tuple) else (value,)), id=None if ids is None else ids[i], marks=mark)
        for i, value in enumerate(values)
        for mark in [first if i == 0 else rest]
    ]


def first_fast(values: Iterable, ids: Sequence[str] | None = None, *, matrix: bool = False) -> list:
    """``values`` for ``pytest.mark.parametrize``: the first runs in both tiers (and, with ``matrix``, in the
    matrix's CI tier), the others in the full one only (the test ids are those plain ``values`` / ``ids`` would give).
    A tuple is one value per argument name."""
    return _first_marked(values, ids, (pytest.mark.matrix,) if matrix else (), (slow,))


def first_in_matrix(values: Iterable, ids: Sequence[str] | None = None) -> list:
    """``values`` for ``pytest.mark.parametrize``: the first also runs in the matrix's CI tier; the test's own marks
    (``slow``) hold for every case."""
    return _first_marked(values, ids, (pytest.mark.matrix,), ())
