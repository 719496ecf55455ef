"""Input files: expanding paths / directories / globs on local disk, S3, HDFS and WebHDFS, and opening them.

Everything goes through fsspec, so ``storage_options`` are fsspec's (``key``, ``secret``,
``client_kwargs={"endpoint_url": ...}`` for s3fs; ``host``/``port``/``user`` for HDFS). Local paths use pyarrow's
native reader, and so does ``s3://`` where s3fs is not installed. Nothing is copied to local disk: Parquet is read
by byte ranges.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from ingest.errors import SourceError, StoreError, redact, secret_values

REMOTE_PROTOCOLS = ("s3", "s3a", "hdfs", "webhdfs", "swebhdfs", "gs", "gcs", "abfs", "az", "http", "https")
_GLOB_CHARS = "*?["


def protocol_of(path: str) -> str:
    return path.split("://", 1)[0].lower() if "://" in path else "file"


def filesystem_for(path: str, storage_options: dict | None = None) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem for ``path``, with options from the URL too (host:port for (web)hdfs). ``s3://`` goes
    through s3fs where it is installed, else through pyarrow's own S3 filesystem (``pyarrow_s3``)."""
    if protocol_of(path) == "s3a":
        path = "s3" + path[3:]
    try:
        fs, _ = fsspec.core.url_to_fs(path, **(storage_options or {}))
    except ImportError as missing:
        if protocol_of(path) == "s3":
            return pyarrow_s3(path, storage_options)
        raise SourceError(
            f"reading {protocol_of(path)}:// paths needs a package this environment lacks: {missing}",
            file=printable_path(path),
        ) from None
    return fs


# s3fs's storage options -> pyarrow.fs.S3FileSystem's arguments (client_kwargs' endpoint_url and region_name too)
PYARROW_S3_OPTIONS = {
    "key": "access_key",
    "secret": "secret_key",
    "token": "session_token",
    "anon": "anonymous",
    "region_name": "region",
}


def pyarrow_s3(path: str, storage_options: dict | None = None) -> fsspec.AbstractFileSystem:
    """``s3://`` through pyarrow's own S3 filesystem, for environments without s3fs: s3fs needs botocore, which caps
    python-dateutil below 3 (verl 0.9's environment has 4), so installing it would change the user's environment.
    Takes s3fs's options for what both clients have; any other is refused by name."""
    from fsspec.implementations.arrow import ArrowFSWrapper
    from pyarrow.fs import S3FileSystem

    options = dict(storage_options or {})
    client = dict(options.pop("client_kwargs", None) or {})
    endpoint = client.pop("endpoint_url", None) or options.pop("endpoint_url", None)
    options.update(client)
    unknown = sorted(set(options) - set(PYARROW_S3_OPTIONS))
    if unknown:
        raise SourceError(
            f"storage_options {unknown} need s3fs, which is not installed (pip install s3fs: its botocore caps "
            "python-dateutil below 3); without it s3:// is read by pyarrow, which takes key, secret, token, anon, "
            "region_name and client_kwargs' endpoint_url",
            file=printable_path(path),
        )
    kwargs = {PYARROW_S3_OPTIONS[name]: value for name, value in options.items()}
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    # one client per options, as fsspec keeps one s3fs instance per options: each file a read opens asks for it
    cached = repr(sorted(kwargs.items()))
    if cached not in _PYARROW_S3:
        _PYARROW_S3[cached] = ArrowFSWrapper(S3FileSystem(**kwargs))
    return _PYARROW_S3[cached]


_PYARROW_S3: dict[str, fsspec.AbstractFileSystem] = {}


def _qualify(entry: str, protocol: str, found: str) -> str:
    """A listed path as a full URL again: fsspec lists ``bucket/key`` or ``/path`` without scheme (and host)."""
    if protocol == "file" or "://" in found:
        return found
    if protocol in ("hdfs", "webhdfs", "swebhdfs"):  # keep the namenode host:port of the entry
        netloc = entry.split("://", 1)[1].split("/", 1)[0]
        return f"{protocol}://{netloc}/{found.lstrip('/')}"
    return f"{protocol}://{found}"


def printable_path(path: str) -> str:
    """A path safe to print: no credentials embedded in the URL (``s3://key:secret@bucket``)."""
    if "://" in path and "@" in path.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = path.split("://", 1)
        return f"{scheme}://{rest.split('@', 1)[1]}"
    return path


def _secrets(path: str, storage_options: dict | None) -> list[str]:
    """Strings to keep out of messages about ``path``: credentials in ``storage_options`` and in the URL itself."""
    secrets = secret_values(storage_options)
    if "://" in path:
        netloc = path.split("://", 1)[1].split("/", 1)[0]
        if "@" in netloc:
            userinfo = netloc.rsplit("@", 1)[0]
            secrets += [userinfo, *userinfo.split(":", 1)[1:]]
    return sorted({s for s in secrets if s}, key=len, reverse=True)


def redacted_failure(what: str, exc: Exception, path: str, storage_options: dict | None) -> str:
    """``what: ExcType: message`` with every credential removed (messages from s3fs / botocore can echo them)."""
    return redact(f"{what}: {type(exc).__name__}: {exc}", _secrets(path, storage_options))


def expand_files(files: str | os.PathLike | Sequence[str | os.PathLike], storage_options: dict | None = None) -> list:
    """Expand paths, directories (every ``*.parquet`` below, sorted) and globs into a list of Parquet files.

    Order is kept: entries in the order given, each directory or glob sorted. Duplicates are an error (they would
    silently double rows).
    """
    entries = [files] if isinstance(files, str | os.PathLike) else list(files)
    if not entries:
        raise SourceError("no input files given")
    out: list[str] = []
    for entry in entries:
        entry = os.fspath(entry)
        protocol = protocol_of(entry)
        try:
            fs = filesystem_for(entry, storage_options)
            if any(ch in entry for ch in _GLOB_CHARS):
                found = sorted(p for p in fs.glob(entry) if not fs.isdir(p))
                if not found:
                    raise SourceError("glob matched no files", file=printable_path(entry))
            elif fs.isdir(entry):
                found = sorted(p for p in fs.find(entry) if p.endswith(".parquet") or p.endswith(".parq"))
                if not found:
                    raise SourceError("directory holds no .parquet files", file=printable_path(entry))
            elif fs.exists(entry):
                found = [entry]
            else:
                raise SourceError("no such file or directory", file=printable_path(entry))
        except SourceError:
            raise
        except Exception as exc:  # permissions, bad endpoint, unreachable namenode, ...
            raise SourceError(
                redacted_failure("cannot list", exc, entry, storage_options), file=printable_path(entry)
            ) from None
        out.extend(p if p == entry else _qualify(entry, protocol, p) for p in found)
    duplicates = sorted({p for p in out if out.count(p) > 1})
    if duplicates:
        raise SourceError(f"file listed more than once: {', '.join(duplicates[:3])}")
    return out


class _TrackedFile:
    """A remote file handle that remembers the last exception its own reads raised.

    pyarrow re-raises what a Python file raises, so after a failed decode this tells a store failure (the
    filesystem client gave up: 5xx, throttling, timeouts, refused connections, denied access) from bad bytes.
    """

    def __init__(self, handle):
        self._handle = handle
        self.failure: Exception | None = None

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def _call(self, name, *args):
        try:
            return getattr(self._handle, name)(*args)
        except Exception as exc:
            self.failure = exc
            raise

    def read(self, *args):
        return self._call("read", *args)

    def readinto(self, *args):
        return self._call("readinto", *args)


def store_failed(pf: pq.ParquetFile) -> bool:
    """Whether a read of ``pf`` (from ``open_parquet``) failed in the filesystem client rather than in the decoder."""
    handle = getattr(pf, "_ingest_handle", None)
    return handle is not None and handle.failure is not None


def open_parquet(path: str, storage_options: dict | None = None) -> pq.ParquetFile:
    """Open one Parquet file for reading by row group (footer read now, data on demand).

    ``StoreError`` when the store fails to serve it (after its client's retries), ``SourceError`` when the bytes
    are not Parquet.
    """
    if protocol_of(path) == "file":
        try:
            return pq.ParquetFile(path.removeprefix("file://"))
        except Exception as exc:
            reason = redacted_failure("cannot read as Parquet", exc, path, storage_options)
            raise SourceError(reason, file=printable_path(path)) from None
    try:
        handle = _TrackedFile(filesystem_for(path, storage_options).open(path, "rb"))
    except Exception as exc:
        raise StoreError(
            redacted_failure("cannot open", exc, path, storage_options), file=printable_path(path)
        ) from None
    try:
        pf = pq.ParquetFile(handle)
    except Exception as exc:
        error = StoreError if handle.failure is not None else SourceError
        raise error(
            redacted_failure("cannot read as Parquet", exc, path, storage_options), file=printable_path(path)
        ) from None
    pf._ingest_handle = handle
    return pf


@dataclass(frozen=True)
class FileInfo:
    path: str
    schema: pa.Schema
    row_group_rows: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return sum(self.row_group_rows)


@dataclass(frozen=True)
class BadFile:
    """A whole input file that cannot be used: why, and how many rows it holds when its footer could be read."""

    path: str
    error: SourceError
    num_rows: int | None


# Arrow extension types whose values are Python pickles: reading them as Python (``to_pylist``) runs code from the
# file. Ray registers the first one in every process that imports ``ray.data``; its own readers refuse it too.
PICKLE_EXTENSION_TYPES = ("ray.data.arrow_pickled_object", "arrow.py_extension_type")
_EXTENSION_NAME_KEY = b"ARROW:extension:name"


def _pickled(field: pa.Field) -> bool:
    name = (field.metadata or {}).get(_EXTENSION_NAME_KEY, b"").decode("utf-8", "replace")
    if name in PICKLE_EXTENSION_TYPES:
        return True  # the type is not registered in this process; the reading process may have it
    dtype = field.type
    if isinstance(dtype, pa.ExtensionType):
        if dtype.extension_name in PICKLE_EXTENSION_TYPES:
            return True
        dtype = dtype.storage_type
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    return any(_pickled(dtype.field(i)) for i in range(dtype.num_fields))


def check_no_pickles(schema: pa.Schema, path: str) -> None:
    """Refuse a file whose columns hold Python pickles: nothing from the data is ever unpickled or executed."""
    columns = [field.name for field in schema if _pickled(field)]
    if columns:
        raise SourceError(
            f"column(s) {', '.join(map(repr, columns))} hold pickled Python objects "
            f"({' / '.join(PICKLE_EXTENSION_TYPES)}); reading them would run code from the file, refused",
            file=printable_path(path),
            column=columns[0],
        )


# the Arrow storage of HF datasets' ``Image()`` feature
_HF_IMAGE_STORAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _hf_image_list_type(feature) -> pa.DataType | None:
    """The Arrow type HF datasets gives a list-of-``Image()`` feature (as its ``huggingface`` schema metadata spells
    it: ``List`` / ``Sequence`` / ``LargeList``, or a one-element JSON list), or None for any other feature and for
    ``Image(decode=False)`` (its values stay ``{bytes, path}`` dicts)."""

    def decoding_image(inner) -> bool:
        return isinstance(inner, dict) and inner.get("_type") == "Image" and inner.get("decode", True) is not False

    if isinstance(feature, list):
        return pa.list_(_HF_IMAGE_STORAGE) if len(feature) == 1 and decoding_image(feature[0]) else None
    if not isinstance(feature, dict) or not decoding_image(feature.get("feature")):
        return None
    if feature.get("_type") == "LargeList":
        return pa.large_list(_HF_IMAGE_STORAGE)
    if feature.get("_type") in ("List", "Sequence"):
        length = feature.get("length", -1)
        if isinstance(length, int) and length >= 0:  # a fixed-size list
            return pa.list_(_HF_IMAGE_STORAGE, length)
        return pa.list_(_HF_IMAGE_STORAGE)
    return None


def reads_as_pil_images(schema: pa.Schema, column: str) -> bool:
    """Whether HF datasets (verl's ``load_dataset("parquet")``) reads ``column`` of a file with this schema as PIL
    images: the file's ``huggingface`` schema metadata gives it a list-of-``Image()`` feature whose Arrow type is
    exactly the column's (datasets' ``Features.from_arrow_schema`` ignores a feature that does not match). Otherwise
    the values arrive as the plain dicts or strings the file holds."""
    import json

    if column not in schema.names or not schema.metadata or b"huggingface" not in schema.metadata:
        return False
    try:
        features = (json.loads(schema.metadata[b"huggingface"]).get("info") or {}).get("features") or {}
    except (ValueError, AttributeError):  # metadata that is not the JSON datasets writes
        return False
    expected = _hf_image_list_type(features.get(column)) if isinstance(features, dict) else None
    field = schema.field(column)
    return expected is not None and field.type == expected and field.nullable


def _empty_file(path: str, storage_options: dict | None) -> bool:
    try:
        if protocol_of(path) == "file":
            return os.path.getsize(path.removeprefix("file://")) == 0
        return filesystem_for(path, storage_options).size(path) == 0
    except Exception:
        return False


def inspect_files(
    paths: Sequence[str], storage_options: dict | None = None, max_workers: int = 16, *, bad: list | None = None
) -> list:
    """Read every file's footer (in parallel for remote stores): schema and row counts per row group.

    A file that cannot be read as Parquet, or whose columns hold pickled Python objects, raises ``SourceError``; with
    ``bad`` (a list) it is appended there as a ``BadFile`` and left out of the result instead.
    """

    def one(path: str) -> FileInfo | BadFile:
        num_rows = None
        try:
            pf = open_parquet(path, storage_options)
            try:
                meta = pf.metadata
                num_rows = meta.num_rows
                row_groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
                info = FileInfo(path, pf.schema_arrow, row_groups)
            except Exception as exc:  # e.g. a logical type Arrow cannot map
                reason = redacted_failure("cannot read the Parquet footer", exc, path, storage_options)
                raise SourceError(reason, file=printable_path(path)) from None
            check_no_pickles(info.schema, path)
            return info
        except SourceError as exc:
            if bad is None or isinstance(exc, StoreError):  # the store failing is not a bad file
                raise
            if num_rows is None and _empty_file(path, storage_options):
                num_rows = 0
            return BadFile(path, exc, num_rows)

    remote = any(protocol_of(p) != "file" for p in paths)
    if len(paths) <= 1 or not remote:
        results = [one(p) for p in paths]
    else:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(paths))) as pool:
            results = list(pool.map(one, paths))
    if bad is not None:
        bad.extend(r for r in results if isinstance(r, BadFile))
    return [r for r in results if isinstance(r, FileInfo)]


def conflicting_column(exc: Exception) -> str | None:
    """The top-level column named in pyarrow's schema-merge error, if any."""
    match = re.search(r"Field (\S+) has incompatible types", str(exc))
    return match.group(1) if match else None


def unify_schemas(infos: Iterable[FileInfo]) -> pa.Schema:
    """One schema for all files (columns missing from a file read as null)."""
    infos = list(infos)
    try:
        return pa.unify_schemas([info.schema for info in infos], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        first = infos[0]
        for info in infos[1:]:
            try:
                pa.unify_schemas([first.schema, info.schema], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                raise SourceError(
                    f"schema conflicts with {printable_path(first.path)}: {exc}",
                    file=printable_path(info.path),
                    column=conflicting_column(exc),
                ) from None
        raise SourceError(f"schemas cannot be unified: {exc}", column=conflicting_column(exc)) from None


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Reorder / add null columns / cast so ``table`` has exactly ``schema``."""
    if table.schema.equals(schema):
        return table
    columns = []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            columns.append(column if column.type.equals(field.type) else column.cast(field.type))
        else:
            columns.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(columns, schema=schema)
