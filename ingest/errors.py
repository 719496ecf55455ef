"""Errors users see: one line naming the file, row and column involved, whatever Ray layer raised them."""

from __future__ import annotations


class IngestError(Exception):
    """A problem with the input or the configuration, located as precisely as possible.

    ``file`` is the input file, ``row`` the 0-based row index inside that file, ``column`` the column involved.
    Pickles cleanly (it crosses Ray task and actor boundaries).
    """

    def __init__(self, reason: str, *, file: str | None = None, row: int | None = None, column: str | None = None):
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
