"""``tools/envs.py``: the environment matrix's command line (the matrix itself is ``make test-envs``)."""

import pytest

from tools.envs import TESTS, parse


def test_the_environment_matrix_runs_every_entry_by_default_and_refuses_unknown_ones():
    assert parse([]) == (sorted(TESTS), [])
    assert parse(["verl-0.9", "--pytest", "-x -k text"]) == (["verl-0.9"], ["-x", "-k", "text"])
    with pytest.raises(SystemExit):
        parse(["verl-0.4"])
