"""Errors users see: one line naming the file, row and column involved, whatever Ray layer raised them."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# ``scheme://user:password@host`` -> ``scheme://***@host`` (credentials embedded in a URL)
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]+@")
# signed-URL and token query parameters (S3 presigned URLs, SAS tokens, ``?token=``)
_SECRET_QUERY = re.compile(
    r"(?P<name>[?&](?:X-Amz-(?:Signature|Credential|Security-Token)|Signature|sig|token|access_token|api_key|apikey|delegation)=)"
    r"[^&\s'\"]+",
    re.IGNORECASE,
)
# storage_options keys whose (string) values are credentials
_SECRET_KEY_WORDS = ("secret", "token", "pass", "key", "credential", "auth", "session", "signature")
MIN_SECRET_LENGTH = 4  # shorter values would mangle ordinary text


def secret_values(options: Mapping | None) -> list[str]:
    """The credential strings inside ``storage_options`` (nested dicts included), longest first."""
    found: set[str] = set()

    def walk(value, secret: bool) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, secret or any(word in str(key).lower() for word in _SECRET_KEY_WORDS))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item, secret)
        elif secret and isinstance(value, str | bytes) and len(value) >= MIN_SECRET_LENGTH:
            found.add(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)

    walk(options or {}, False)
    return sorted(found, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without URL credentials, signed-URL tokens and the given secret strings (each becomes ``***``)."""
    text = _URL_USERINFO.sub(r"\g<scheme>***@", text)
    text = _SECRET_QUERY.sub(r"\g<name>***", text)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


class IngestError(Exception):
    """A problem with the input or the configuration, located as precisely as possible.

    ``file`` is the input file, ``row`` the 0-based row index inside that file, ``column`` the column involved.
    Pickles cleanly (it crosses Ray task and actor boundaries). Credentials embedded in URLs (``s3://key:secret@``,
    signed-URL tokens) are removed from ``reason`` and ``file``; callers redact ``storage_options`` secrets with
    ``redact(text, secret_values(storage_options))`` before building the reason.
    """

    def __init__(self, reason: str, *, file: str | None = None, row: int | None = None, column: str | None = None):
        reason = redact(str(reason))
        file = None if file is None else redact(str(file))
        self.reason, self.file, self.row, self.column = reason, file, row, column
        super().__init__(reason, file, row, column)

    def __reduce__(self):
        return (_rebuild, (type(self), self.reason, self.file, self.row, self.column))

    def __str__(self) -> str:
        where = []
        if self.file is not None:
            where.append(f"file {self.file}")
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.column is not None:
            where.append(f"column {self.column!r}")
        return f"{', '.join(where)}: {self.reason}" if where else self.reason


def _rebuild(cls, reason, file, row, column):
    return cls(reason, file=file, row=row, column=column)


class BadRowError(IngestError):
    """A row that cannot become a verl row (bad prompt, overlong with ``truncation='error'``, ...)."""


class SourceError(IngestError):
    """A file that cannot be listed, opened or read as Parquet."""


class StoreError(SourceError):
    """The storage system failed to serve a file (after its client's own retries): not bad data, never quarantined."""


class ModelLoadError(IngestError):
    """A tokenizer or processor that cannot be loaded."""


def find_ingest_error(exc: BaseException) -> IngestError | None:
    """Dig the original ``IngestError`` out of Ray's wrappers (RayTaskError, ActorDiedError, cause chains)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        cause = getattr(err, "cause", None)  # RayTaskError(IngestError) carries the original as .cause
        if isinstance(cause, IngestError):
            return cause
        if isinstance(err, IngestError):
            return err
        stack.extend([err.__cause__, err.__context__, getattr(err, "cause", None)])
        for arg in getattr(err, "args", ()):
            if isinstance(arg, BaseException):
                stack.append(arg)
    return None
