"""``tools/envs.py``: the environment matrix's command line (the matrix itself is ``make test-envs``)."""

import pytest

from tools.envs import TESTS, parse, pip


def test_the_environment_matrix_runs_every_entry_by_default_and_refuses_unknown_ones():
    default = parse([])
    assert (default.names, default.pytest, default.keep) == (sorted(TESTS), [], False)
    chosen = parse(["verl-0.9", "--pytest", "-x -k text", "--keep"])
    assert (chosen.names, chosen.pytest, chosen.keep) == (["verl-0.9"], ["-x", "-k", "text"], True)
    with pytest.raises(SystemExit):
        parse(["verl-0.4"])


def test_the_matrix_installs_without_pip_s_cache():
    # a CI disk holds one venv of 6 to 8 GB at a time; cached torch wheels would add as much again per entry
    assert pip("python", "install", "-q", "-r", "x.txt") == [
        "python",
        "-m",
        "pip",
        "install",
        "--no-cache-dir",
        "-q",
        "-r",
        "x.txt",
    ]
