"""A pyarrow that does not import beside the installed numpy (pyarrow 26 needs NumPy 2; verl 0.5 to 0.7 pin numpy 1.26)
is named at ``import ingest``, in one line with both versions and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _site(tmp_path: Path, numpy: str, pyarrow: str) -> Path:
    """A site directory whose numpy and pyarrow are stubs of those releases; the stub pyarrow refuses a numpy older than
    2 with pyarrow 26's own message."""
    site = tmp_path / "site"
    for name, release, init in (
        ("numpy", numpy, f"__version__ = {numpy!r}\n"),
        (
            "pyarrow",
            pyarrow,
            "import numpy\nif int(numpy.__version__.split('.')[0]) < 2:\n"
            "    raise ImportError(f'pyarrow requires NumPy 2.0 or newer, found {numpy.__version__}')\n",
        ),
    ):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(init)
        info = site / f"{name}-{release}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {release}\n")
    return site


def _import_ingest(site: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", "import ingest"], env=env, capture_output=True, text=True, timeout=60)


def test_a_pyarrow_built_for_numpy_2_beside_numpy_1_fails_in_one_line_naming_both_and_the_fix(tmp_path):
    done = _import_ingest(_site(tmp_path, numpy="1.26.4", pyarrow="26.0.1"))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    error = "ingest.arrow_numpy.BrokenNeighboursError: pyarrow 26.0.1 does not import beside numpy 1.26.4"
    assert last.startswith(error), done.stderr
    assert "pyarrow requires NumPy 2.0 or newer" in last and "numpy>=2" in last and "pyarrow<26" in last


def test_pairs_that_import_together_pass(tmp_path):
    for numpy, pyarrow in (("2.2.6", "26.0.1"), ("1.26.4", "19.0.1")):
        site = _site(tmp_path / pyarrow, numpy=numpy, pyarrow=pyarrow)
        if numpy.startswith("1."):  # a pyarrow that supports numpy 1.x
            (site / "pyarrow" / "__init__.py").write_text("import numpy\n")
        done = _import_ingest(site)
        assert done.returncode == 0, done.stderr
