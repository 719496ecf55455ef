"""``tools/envs.py``: the environment matrix's command line (the matrix itself is ``make test-envs``)."""

import pytest

from tools.envs import TESTS, entry_environment, parse, pip


def test_the_environment_matrix_runs_every_entry_by_default_and_refuses_unknown_ones():
    default = parse([])
    assert (default.names, default.pytest, default.keep, default.lanes) == (sorted(TESTS), [], False, 2)
    chosen = parse(["verl-0.9", "--pytest", "-x -k text", "--keep", "--lanes", "1"])
    assert (chosen.names, chosen.pytest, chosen.keep, chosen.lanes) == (["verl-0.9"], ["-x", "-k", "text"], True, 1)
    with pytest.raises(SystemExit):
        parse(["verl-0.4"])


def test_the_matrix_installs_without_pip_s_cache():
    # a venv takes 6 to 8 GB (one or two on the disk at a time); cached torch wheels would add as much again per entry
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


def test_entries_side_by_side_have_their_own_ray_temp_dir_and_cache_and_import_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/with/ingest")
    first, second = entry_environment("verl-0.5", tmp_path / "a"), entry_environment("verl-0.6", tmp_path / "b")
    assert first["RAY_TMPDIR"] != second["RAY_TMPDIR"] and first["XDG_CACHE_HOME"] != second["XDG_CACHE_HOME"]
    assert "PYTHONPATH" not in first and "PYTHONPATH" not in second
