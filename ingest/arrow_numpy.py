"""pyarrow and numpy must import together before anything here can run. An environment can be broken before this package
arrives: a pyarrow built for NumPy 2 beside numpy 1.26 (which verl 0.5 to 0.7 pin) fails on ``import pyarrow``, deep
inside whatever imported it first. This names both versions and the fix in one line, at ``import ingest``."""

from __future__ import annotations

from ingest.errors import IngestError
from ingest.installed import installed_version


class BrokenNeighboursError(IngestError):
    """Two packages this one needs are installed in versions that do not import together."""


def check_arrow_numpy() -> None:
    """Raise ``BrokenNeighboursError`` when pyarrow does not import beside the installed numpy. Only a numpy older than
    2 is tried: every pyarrow this package accepts imports with NumPy 2, and the import would cost each process that
    imports the package (a CLI command, a Ray worker) its time whether or not it reads Arrow."""
    numpy = installed_version("numpy")
    if numpy is None or not numpy.split(".")[0].isdigit() or int(numpy.split(".")[0]) >= 2:
        return
    try:
        import pyarrow  # noqa: F401
    except ImportError as failed:
        pyarrow = installed_version("pyarrow") or "none"
        older = f"pyarrow<{pyarrow.split('.')[0]}" if pyarrow.split(".")[0].isdigit() else "an older pyarrow"
        raise BrokenNeighboursError(
            f"pyarrow {pyarrow} does not import beside numpy {numpy} ({failed}); this environment was broken before "
            f"ray-ingest: install numpy>=2 where your other packages allow it, else a pyarrow built for numpy 1.x "
            f"(pip install '{older}')."
        ) from None
