"""A minimal WebHDFS namenode on loopback (GETFILESTATUS, LISTSTATUS, OPEN with offset/length) over a local folder.

fsspec's ``webhdfs://`` client speaks exactly this HTTP API, so reading through it exercises the real client code.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

PREFIX = "/webhdfs/v1"


def _status(path: str, suffix: str = "") -> dict:
    st = os.stat(path)
    return {
        "pathSuffix": suffix,
        "type": "DIRECTORY" if os.path.isdir(path) else "FILE",
        "length": 0 if os.path.isdir(path) else st.st_size,
        "modificationTime": int(st.st_mtime * 1000),
        "permission": "644",
        "owner": "test",
        "group": "test",
        "replication": 1,
        "blockSize": 134217728,
    }


class WebHDFSServer:
    def __init__(self, root: str):
        self.root = root
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                op = query.get("op", "")
                server.requests.append(op)
                local = os.path.join(server.root, unquote(url.path[len(PREFIX) :]).lstrip("/"))
                if not os.path.exists(local):
                    exc = {"exception": "FileNotFoundException", "message": f"File does not exist: {url.path}"}
                    return self._json(404, {"RemoteException": exc})
                if op == "GETFILESTATUS":
                    return self._json(200, {"FileStatus": _status(local)})
                if op == "LISTSTATUS":
                    entries = [_status(os.path.join(local, n), n) for n in sorted(os.listdir(local))]
                    return self._json(200, {"FileStatuses": {"FileStatus": entries}})
                if op == "OPEN":
                    offset, length = int(query.get("offset", 0)), query.get("length")
                    with open(local, "rb") as f:
                        f.seek(offset)
                        data = f.read(int(length)) if length is not None else f.read()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return None
                return self._json(
                    400, {"RemoteException": {"exception": "UnsupportedOperationException", "message": op}}
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
