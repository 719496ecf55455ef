"""The Ray releases this package is tested with, and a clear error on any other. A Ray client must match its cluster's
Ray, and the pipeline uses Ray Data features whose behaviour changes between releases, so the range is a tested one:
``pyproject.toml`` states the same bounds (a test checks they agree)."""

from __future__ import annotations

import os
import sys

from ingest.errors import IngestError

ANY_RAY_ENV = "INGEST_ALLOW_ANY_RAY"  # "1": skip the check and run on an untested Ray at your own risk

OLDEST_RAY = (2, 48)  # vLLM's own floor (ray[cgraph]>=2.48), the oldest Ray a verl + vLLM environment has
NEWEST_RAY = (2, 60)  # the newest series tested; requirements/main.txt pins it


class UnsupportedRayError(IngestError):
    """The installed Ray is outside the tested range."""


def supported_range() -> str:
    return f">={OLDEST_RAY[0]}.{OLDEST_RAY[1]},<{NEWEST_RAY[0]}.{NEWEST_RAY[1] + 1}"


def ray_series(version: str) -> tuple[int, int]:
    """``"2.48.0"`` -> ``(2, 48)`` (a dev or rc suffix on the patch number is ignored)."""
    major, minor = (version.split("+")[0] + ".0").split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def installed_ray() -> str:
    """The installed Ray's version, without importing Ray when it is not imported yet (this runs at package import)."""
    if "ray" in sys.modules:
        return sys.modules["ray"].__version__
    from ingest.installed import installed_version

    return installed_version("ray") or "none"


def check_ray(version: str | None = None) -> None:
    """Raise ``UnsupportedRayError`` naming the installed Ray and the supported range when they do not match."""
    if os.environ.get(ANY_RAY_ENV) == "1":
        return
    version = installed_ray() if version is None else version
    if version == "none" or not OLDEST_RAY <= ray_series(version) <= NEWEST_RAY:
        shown = "no Ray" if version == "none" else f"Ray {version}"
        raise UnsupportedRayError(
            f"this environment has {shown}; ray-ingest is tested with Ray {supported_range()}: use a Ray in "
            "that range here and on the cluster (a Ray client must match its cluster's Ray), or set "
            f"{ANY_RAY_ENV}=1 to try this one at your own risk."
        )
