"""A gs:// bucket on loopback for the tests and the pod rehearsal: ``gcp-storage-emulator``'s
storage and request handlers, served so that a request whose body ends before its
``Content-Length`` stores nothing, as GCS does.

  python scripts/gcs_emulator.py --port P [--bucket B]     # in memory; serves until killed

Why not the emulator's own server: its handler reads a body with ``rfile.read(Content-Length)``,
which returns short when the client closes early, and stores what arrived. It serves one request
at a time, so under load a client gives up on a queued upload and closes it part-sent (CI, the
reduced pod rehearsal of 2026-12-06: the emulator's log shows 6 uploads whose client was gone
before the answer, and the evaluation then read a checkpoint chunk as "Truncated Zstd-compressed
stream"). Here such a request fails on the server (``ShortBody``, one traceback in the log) and
the client's retry is the only write.
"""
from __future__ import annotations

import argparse
import functools
import http.server

from gcp_storage_emulator.handlers.buckets import create_bucket
from gcp_storage_emulator.server import RequestHandler
from gcp_storage_emulator.storage import Storage


class ShortBody(ConnectionError):
    """A request's body ended before its declared length: the client gave up on it."""


class _ExactReader:
    """A request's input stream whose ``read(n)`` returns ``n`` bytes or raises ``ShortBody``."""

    def __init__(self, stream):
        self._stream = stream

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        if n is not None and n >= 0 and len(data) < n:
            raise ShortBody(f"request body ended after {len(data)} of {n} bytes")
        return data

    def __getattr__(self, name):          # readline (the request line, headers), close, ...
        return getattr(self._stream, name)


class StrictRequestHandler(RequestHandler):
    """The emulator's handler, reading bodies through ``_ExactReader``."""

    def setup(self):
        super().setup()
        self.rfile = _ExactReader(self.rfile)


def make_server(host: str, port: int, bucket: str) -> http.server.HTTPServer:
    """An in-memory emulator holding one empty bucket, not yet serving."""
    storage = Storage(use_memory_fs=True)
    create_bucket(bucket, storage)
    return http.server.HTTPServer((host, port), functools.partial(StrictRequestHandler, storage))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bucket", default="ace-rehearsal")
    a = p.parse_args(argv)
    make_server(a.host, a.port, a.bucket).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
