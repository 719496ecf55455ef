"""The installed releases of the packages this one works beside, read from their metadata (nothing imported)."""

from __future__ import annotations

from importlib import metadata


def installed_version(package: str) -> str | None:
    """``package``'s installed version; None where it is not installed. ``metadata.version`` is looked up at each call,
    so that tests can stand in for it."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
