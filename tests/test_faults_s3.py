"""Faults on the S3 path: a fault-injecting HTTP proxy in front of a real moto S3 server on loopback.

The pipeline's S3 reads go ``open_parquet`` -> s3fs -> aiobotocore -> this proxy -> moto. The proxy answers some
requests itself (an error status with an S3 error body, or after a stall) and forwards the rest unchanged. Faults
are armed after ``build_dataset`` has planned (footers read on the driver), so they hit the reads in the tokenizer
actors (Ray Data fuses the read into them).

Which layer recovers (Ray 2.60, s3fs 2026.9, aiobotocore 3.10 / botocore 1.43, default settings):

1. **botocore** (legacy retry mode: ``max_attempts`` 5, i.e. 4 retries, backoff ``rand * 2**n`` s, ~7.5 s in all on
   average) retries a request answered 500 / 502 / 503 / 504 or a throttling code, and connection errors and read
   timeouts (s3fs sets ``read_timeout`` 15 s, ``connect_timeout`` 5 s). Tunable through ``storage_options``:
   ``{"config_kwargs": {"retries": {"max_attempts": N, "mode": "standard"}, "read_timeout": S}}``.
2. **s3fs** (``S3FileSystem.retries`` = 5, a class attribute, not a storage option; backoff ``0.1 * 1.7**i`` s): when
   botocore gives up, ``_call_s3`` repeats the whole botocore call for connection / timeout errors and ``SlowDown``
   (5 x 5 = 25 attempts: a permanent SlowDown fails a read after ~40 s here), not for other codes (a 500
   ``InternalError`` surfaces after botocore's 5 attempts as ``OSError(EREMOTEIO)``).
3. **our code**: ``open_parquet`` / ``read_unit`` do not retry; they turn the error into one ``SourceError`` naming
   the file (and the unit's first row), credentials redacted. With ``on_bad_row="raise"`` it ends the run. With the
   default ``"quarantine"``, ``_UnitReader`` quarantines the unit only when its row groups' bytes can be fetched
   again (a corrupt data page); a store that keeps failing raises the same error (that second fetch runs the
   client's retries once more: ~2 x 40 s for a permanent SlowDown with default settings).
4. **Ray Data** does not retry it either. The read runs inside the actor task; actor tasks are retried only when the
   actor dies (``max_task_retries=-1``) or on ``RaySystemError``; application errors only if
   ``DataContext.actor_task_retry_on_errors`` is set (default ``False``), and with ``max_errored_blocks`` 0 the first
   failed unit fails the dataset. ``DataContext.retried_io_errors`` applies to Ray's own file datasources (pyarrow
   filesystems), not to our ``ParquetUnitsDatasource``.

So a transient fault is absorbed by botocore + s3fs inside one read; a unit yields nothing before its read succeeded
(nothing is delivered twice; the ledger counts each batch once). A permanent fault ends a strict run after those
bounded retries with a ``SourceError`` naming the file.
"""

from __future__ import annotations

import http.client
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import ray

from ingest import SourceError, VerlCollate, build_dataset
from ingest.demo import write_gsm8k_parquet
from ingest.errors import find_ingest_error
from ingest.read.files import filesystem_for
from ingest.stats import RunLedger
from tests.support.s3 import moto_s3
from tests.support.tiers import slow

ROWS, LONG_EVERY = 2000, 50
KEY, SECRET = "AKIAFAULTTESTKEY0001", "fault-test-secret-do-not-print"
CONFIG = {"truncation": "left", "shuffle": False, "read_rows_per_task": 200, "tokenizer_batch_size": 100}


def s3_error(status: int, code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<RequestId>fault-proxy</RequestId></Error>"
    ).encode()


class FaultProxy:
    """A loopback HTTP proxy to ``upstream`` that lets ``policy`` answer or delay requests.

    ``policy(request) -> None`` (forward), ``("stall", seconds)`` (wait, then forward) or
    ``("error", status, code, message)`` (answer with an S3 error). ``request`` is a dict with ``method``, ``path``,
    ``headers`` and ``data`` (a GET with a Range header on a ``.parquet`` object: a data read). ``log`` records
    ``(method, path, data, action)`` for every request.
    """

    def __init__(self, upstream: str):
        self.upstream = upstream.split("://", 1)[1]
        self.policy = None
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                request = {
                    "method": self.command,
                    "path": self.path,
                    "headers": self.headers,
                    "data": self.command == "GET" and "Range" in self.headers and ".parquet" in self.path,
                }
                with proxy.lock:
                    action = proxy.policy(request) if proxy.policy else None
                    proxy.log.append((self.command, self.path, request["data"], action and action[0]))
                try:
                    if action and action[0] == "error":
                        _, status, code, message = action
                        self._reply(status, {"Content-Type": "application/xml"}, s3_error(status, code, message))
                        return
                    if action and action[0] == "stall":
                        time.sleep(action[1])
                    conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                    try:
                        conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                        resp = conn.getresponse()
                        payload = resp.read()
                        headers = {
                            k: v for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "connection")
                        }
                        self._reply(resp.status, headers, payload)
                    finally:
                        conn.close()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its read timeout)
                    self.close_connection = True

            def _reply(self, status: int, headers: dict, payload: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() != "content-length":
                        self.send_header(k, v)
                # HEAD: moto's Content-Length is the object's size, and no body follows
                sizes = [v for k, v in headers.items() if k.lower() == "content-length"]
                length = sizes[0] if sizes and self.command == "HEAD" else len(payload)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def data_reads(self) -> list[tuple]:
        with self.lock:
            return [entry for entry in self.log if entry[2]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def access_key(request) -> str:
    match = re.search(r"Credential=([^/]+)/", request["headers"].get("Authorization", ""))
    return match.group(1) if match else "?"


@pytest.fixture(scope="module")
def s3_data(tmp_path_factory):
    """A moto S3 server holding 2 gsm8k files (2,000 rows, 200-row row groups, every 50th prompt overlong)."""
    files = write_gsm8k_parquet(
        tmp_path_factory.mktemp("s3faults"), ROWS, num_files=2, row_group_size=200, long_every=LONG_EVERY
    )
    with moto_s3() as upstream:
        fs = filesystem_for("s3://bucket", {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": upstream}})
        fs.mkdir("faults")
        for path in files:
            fs.put(path, f"faults/gsm8k/{os.path.basename(path)}")
        yield upstream


@pytest.fixture
def proxy(s3_data):
    proxy = FaultProxy(s3_data)
    yield proxy
    proxy.close()


def options(proxy: FaultProxy, **extra) -> dict:
    return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": proxy.url}, **extra}


EXPECTED = [i for i in range(ROWS) if i % LONG_EVERY != LONG_EVERY - 1]


def run_through(proxy: FaultProxy, policy, storage_options: dict, **config) -> tuple[list[int], dict]:
    ledger = RunLedger.remote()
    config = {**CONFIG, **config, "storage_options": storage_options}
    ds = build_dataset("s3://faults/gsm8k/", None, config, ledger=ledger)
    with proxy.lock:  # planned (footers read on the driver): from here on the faults hit the actors' reads
        proxy.log.clear()
        proxy.policy = policy
    seen = []
    for batch in ds.iter_torch_batches(batch_size=64, collate_fn=VerlCollate()):
        seen += [int(i) for i in batch["index"]]
    return seen, ray.get(ledger.get.remote())


def assert_exactly_once(seen: list[int], counts: dict) -> None:
    assert seen == EXPECTED  # every row once, in input order (shuffle off)
    assert counts["rows_in"] == ROWS and counts["rows_out"] == len(EXPECTED)
    assert counts["filtered_overlong"] == ROWS - len(EXPECTED) and counts["quarantined"] == 0
    assert counts["rows_in"] == counts["rows_out"] + counts["filtered_overlong"] + counts["quarantined"]


class FirstN:
    """The first ``n`` data reads get ``action``; the rest are forwarded."""

    def __init__(self, n: int, action: tuple):
        self.n, self.action, self.hits = n, action, 0

    def __call__(self, request):
        if request["data"] and self.hits < self.n:
            self.hits += 1
            return self.action
        return None


class Outage:
    """Every data read answers ``action`` for ``seconds`` after the first data read, and at least the first
    ``min_hits`` (on a loaded machine fewer reads than that can come in the time)."""

    def __init__(self, seconds: float, action: tuple, min_hits: int = 0):
        self.seconds, self.action, self.min_hits, self.started, self.hits = seconds, action, min_hits, None, 0

    def __call__(self, request):
        if not request["data"]:
            return None
        now = time.monotonic()
        self.started = self.started or now
        if now - self.started < self.seconds or self.hits < self.min_hits:
            self.hits += 1
            return self.action
        return None


@slow
def test_server_errors_for_a_while_lose_and_repeat_nothing(ray_session, proxy):
    """The first 3 data reads answer 500 InternalError: botocore retries each request (up to 5 attempts)."""
    policy = FirstN(3, ("error", 500, "InternalError", "We encountered an internal error. Please try again."))
    seen, counts = run_through(proxy, policy, options(proxy))
    assert policy.hits == 3
    assert_exactly_once(seen, counts)


@slow
def test_throttling_outage_is_ridden_out(ray_session, proxy):
    """Every data read answers 503 SlowDown for 4 s, and the first 5 at least: botocore's 5 attempts on a request all
    fail, so s3fs's ``SlowDown`` retry of the whole call takes over."""
    policy = Outage(4.0, ("error", 503, "SlowDown", "Please reduce your request rate."), min_hits=5)
    started = time.monotonic()
    seen, counts = run_through(proxy, policy, options(proxy))
    assert policy.hits >= 5, policy.hits
    assert time.monotonic() - started >= 4.0
    assert_exactly_once(seen, counts)


@slow
def test_stalled_endpoint_is_ridden_out(ray_session, proxy):
    """The first 4 data reads stall: two for 3 s (under the read timeout: slow answers), two for 6 s (over the 4 s
    read timeout set here: botocore retries the ``ReadTimeoutError``)."""
    stalls = iter([3.0, 3.0, 6.0, 6.0])

    def policy(request):
        if request["data"]:
            seconds = next(stalls, None)
            return None if seconds is None else ("stall", seconds)
        return None

    seen, counts = run_through(proxy, policy, options(proxy, config_kwargs={"read_timeout": 4}))
    assert [a for *_, a in proxy.data_reads()].count("stall") == 4
    assert_exactly_once(seen, counts)


class Permanent:
    """Every data read answers 503 SlowDown, the caller's access key echoed in the message (endpoints do echo it,
    e.g. in ``SignatureDoesNotMatch``); ``first`` is when the first one was answered."""

    def __init__(self):
        self.first = None

    def __call__(self, request):
        if not request["data"]:
            return None
        self.first = self.first or time.monotonic()
        return ("error", 503, "SlowDown", f"Please reduce your request rate, {access_key(request)}.")


def assert_clear_store_error(exc: BaseException) -> SourceError:
    err = find_ingest_error(exc)
    assert isinstance(err, SourceError), repr(exc)
    assert err.file is not None and re.fullmatch(r"s3://faults/gsm8k/train-0000[01]\.parquet", err.file), err
    assert "reduce your request rate" in err.reason, err
    for text in (str(err), str(exc), repr(exc)):
        assert KEY not in text and SECRET not in text
    return err


@slow
def test_permanent_failure_fails_after_bounded_retries_with_a_clear_error(ray_session, proxy):
    """Strict policy, default client settings: the first unit whose read exhausts botocore's and s3fs's retries (5 x 5
    attempts, about 40 s) ends the run with one ``SourceError`` naming the file; neither key nor secret is in it."""
    policy = Permanent()
    with pytest.raises(Exception) as info:
        run_through(proxy, policy, options(proxy), on_bad_row="raise")
    elapsed = time.monotonic() - policy.first
    err = assert_clear_store_error(info.value)
    reads = len(proxy.data_reads())
    assert elapsed < 120, elapsed  # bounded: from the first failed request to the error
    assert 25 <= reads <= 100, reads  # 25 attempts for the failed read (its neighbour may have started retrying too)
    print(f"permanent SlowDown, strict: failed {elapsed:.1f} s after the first error, {reads} data reads: {err}")


@slow
def test_permanent_failure_is_not_quarantined_as_bad_data(ray_session, proxy):
    """Default (quarantine) policy: an endpoint that keeps failing is not bad data. The run must stop with the same
    clear error, not quarantine every unit (each after its own retries) and report success. Botocore's
    ``max_attempts`` 1 here keeps the test short (s3fs's 5 attempts a read)."""
    fast = options(proxy, config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}})
    with pytest.raises(Exception) as info:
        run_through(proxy, Permanent(), fast)
    assert_clear_store_error(info.value)
