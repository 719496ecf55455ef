"""The supported Ray range: the same in pyproject.toml and the code, and a one-line error on a Ray outside it, at the
package's import (before any Ray Data module could fail on a missing name)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ingest.ray_version import ANY_RAY_ENV, UnsupportedRayError, check_ray, supported_range

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_states_the_range_the_code_checks():
    ray = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.strip().startswith('"ray['))
    ray = ray.strip().strip('",')
    assert ray.endswith(supported_range()), (ray, supported_range())
    main = (ROOT / "requirements" / "main.txt").read_text()
    pinned = next(line for line in main.splitlines() if line.startswith("ray[")).split("==")[1]
    check_ray(pinned)  # the pinned Ray is inside the range


@pytest.mark.parametrize("version", ["2.48.0", "2.55.1", "2.60.0"])
def test_ends_and_middle_of_the_range_pass(version):
    check_ray(version)


@pytest.mark.parametrize("version", ["2.47.1", "2.41.0", "2.61.0", "3.0.0.dev0"])
def test_outside_the_range_names_both(version):
    with pytest.raises(UnsupportedRayError) as raised:
        check_ray(version)
    assert f"Ray {version}" in str(raised.value) and supported_range() in str(raised.value)


def _fake_ray(tmp_path: Path, version: str) -> Path:
    """A site directory whose only Ray is a stub of release ``version`` (metadata and an empty package)."""
    site = tmp_path / "site"
    (site / "ray").mkdir(parents=True)
    (site / "ray" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"ray-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ray\nVersion: {version}\n")
    return site


def test_importing_the_package_on_an_old_ray_fails_in_one_line(tmp_path):
    site = _fake_ray(tmp_path, "2.41.0")
    code = "import ingest"
    env = {"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ingest.ray_version.UnsupportedRayError: this environment has Ray 2.41.0;"), done.stderr
    assert supported_range() in last
    allowed = subprocess.run(
        [sys.executable, "-c", code], env={**env, ANY_RAY_ENV: "1"}, capture_output=True, text=True, timeout=60
    )
    assert allowed.returncode == 0, allowed.stderr
