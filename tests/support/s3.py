"""A real S3 endpoint (moto server) on loopback."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def moto_s3():
    """A real S3 endpoint (moto server) on loopback for the block; yields its URL."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
