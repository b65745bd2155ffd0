"""Fixtures for ace_jax tests: a real GCS emulator on loopback (``scripts/gcs_emulator.py``) and a
fault-injecting HTTP proxy.

gcsfs is told not to probe for hierarchical/zonal buckets over gRPC+TLS (which an emulator cannot
answer and which stalls for minutes): ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` must be set
before gcsfs is first imported, hence at the top of this file. The tests also build the plain
``gcsfs.core.GCSFileSystem`` directly (``token="anon"``: no credential or metadata-server lookup).
"""
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("NO_GCE_CHECK", "true")

BUCKET = "ace-test"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    def __init__(self, endpoint: str, bucket: str, proc, log_path: Path):
        self.endpoint, self.bucket, self.proc, self.log_path = endpoint, bucket, proc, log_path

    def fs(self, endpoint=None):
        import gcsfs.core
        return gcsfs.core.GCSFileSystem(endpoint_url=endpoint or self.endpoint, token="anon",
                                        project="test", skip_instance_cache=True)

    def prefix(self) -> str:
        return f"{self.bucket}/run-{uuid.uuid4().hex[:8]}"

    def env(self) -> dict:
        """The variables a subprocess needs to reach this emulator by gs:// URLs alone: gcsfs
        (fsspec) and tensorstore (Orbax checkpoints), anonymous, no GCE metadata probe."""
        return dict(STORAGE_EMULATOR_HOST=self.endpoint, TENSORSTORE_GCS_HTTP_URL=self.endpoint,
                    GOOGLE_AUTH_TOKEN_FOR_TESTING="fake", FSSPEC_GS_TOKEN="anon",
                    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", NO_GCE_CHECK="true")


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    pytest.importorskip("gcp_storage_emulator", reason="pip install -r requirements-test.txt")
    port = _free_port()
    # Its log goes to a file: the emulator serves one request at a time and prints a traceback
    # for a request it cannot handle, so an undrained pipe would stall it once full.
    log_path = tmp_path_factory.mktemp("gcs_emulator") / "emulator.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "gcs_emulator.py"),
                             "--port", str(port), "--bucket", BUCKET],
                            stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 30
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", f"/storage/v1/b/{BUCKET}")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            err = log_path.read_text(errors="replace")[-2000:]
            pytest.fail(f"GCS emulator did not start on port {port}: {err}")
        time.sleep(0.1)
    yield Emulator(f"http://127.0.0.1:{port}", BUCKET, proc, log_path)
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


class FaultyProxy:
    """HTTP reverse proxy in front of the emulator; answers the next ``fail_next`` requests with
    ``fail_status`` (a transient server error at the transport) instead of forwarding them."""

    def __init__(self, upstream_port: int):
        self.fail_next, self.fail_status, self.failed, self.forwarded = 0, 503, 0, 0
        proxy = self
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _body(self):
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        chunk = self.rfile.read(size + 2)[:size]
                        if size == 0:
                            return out
                        out += chunk
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self):
                body = self._body()
                with lock:
                    fail = proxy.fail_next > 0
                    if fail:
                        proxy.fail_next -= 1
                        proxy.failed += 1
                if fail:
                    msg = b'{"error": {"code": %d, "message": "injected failure"}}' % proxy.fail_status
                    self.send_response(proxy.fail_status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                up = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "transfer-encoding", "connection", "content-length")}
                headers["Content-Length"] = str(len(body))
                up.request(self.command, self.path, body=body, headers=headers)
                r = up.getresponse()
                data = r.read()
                with lock:
                    proxy.forwarded += 1
                self.send_response(r.status, r.reason)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "keep-alive"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                up.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def faulty_proxy(gcs_emulator):
    proxy = FaultyProxy(int(gcs_emulator.endpoint.rsplit(":", 1)[1]))
    yield proxy
    proxy.close()
