"""The README's install lines (``tools.envs.readme_install_lines``; the matrix runs them as written in every verl
release's environment, ``make test-envs``): here, what they do beside a Ray outside the tested range, and what a build
without a C compiler says."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tools.envs import copy_clone, readme_install_lines

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _run(command: str | list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``command`` (a string: a bash line, as a user types it) in ``cwd``, its output captured."""
    args = ["bash", "-c", command] if isinstance(command, str) else command
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_readme_installs_with_the_environments_versions_as_constraints():
    freeze, from_clone, from_wheel = readme_install_lines()
    assert freeze == "pip list --format=freeze > my-env.txt"  # no `-e` lines: pip refuses those as constraints
    assert from_clone == 'pip install -c my-env.txt ".[verl]"'
    assert from_wheel == 'pip install -c my-env.txt "$(ls dist/ray_ingest-*.whl)[verl]"'


def test_beside_a_ray_outside_the_range_the_readme_install_refuses_naming_ray(tmp_path):
    # the README says so: without the constraints pip would upgrade the user's Ray (and torch, transformers, numpy)
    freeze, from_clone, _ = readme_install_lines()
    clone = copy_clone(tmp_path / "clone")
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PIP_NO_CACHE_DIR": "1"}
    subprocess.run(["bash", "-c", freeze], cwd=clone, env=env, check=True)
    versions = (clone / "my-env.txt").read_text().splitlines()
    older = [("ray==2.47.1" if line.startswith("ray==") else line) for line in versions if "ray-ingest" not in line]
    (clone / "my-env.txt").write_text("\n".join(older) + "\n")
    dry_run = from_clone.replace("pip install", "pip install --dry-run", 1)
    done = _run(dry_run, clone, env)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "ResolutionImpossible" in done.stderr, done.stderr[-2000:]
    assert "The user requested (constraint) ray==2.47.1" in done.stdout + done.stderr
    # and with the user's own Ray the same line resolves, changing nothing
    (clone / "my-env.txt").write_text("\n".join(v for v in versions if "ray-ingest" not in v) + "\n")
    kept = _run(from_clone.replace("[verl]", "").replace("pip install", "pip install --dry-run", 1), clone, env)
    assert kept.returncode == 0, kept.stderr[-2000:]
    assert "Would install ray-ingest-" in kept.stdout and kept.stdout.count("Would install") == 1, kept.stdout


def test_a_wheel_built_without_a_c_compiler_says_so_once(tmp_path):
    """pip shows no build output: ``make wheel`` checks the wheel and says that the C resize is missing."""
    clone = copy_clone(tmp_path / "clone")
    make_wheel = ["make", "-o", ".venv/.installed", "wheel", f"PY={sys.executable}"]
    done = _run(make_wheel, clone, {**os.environ, "CC": "/bin/false"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("note: the C image resize was not built") == 1, done.stdout[-3000:]
    (wheel,) = (clone / "dist").glob("ray_ingest-*.whl")
    assert not [name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".so")]
    made = _run(make_wheel, clone)  # and a build that found its compiler says nothing
    assert made.returncode == 0 and "note: the C image resize" not in made.stdout, made.stdout[-3000:]
