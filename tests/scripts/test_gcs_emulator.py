"""scripts/gcs_emulator.py: an upload whose body ends before its Content-Length stores nothing
(GCS's behaviour; gcp-storage-emulator's own server stores the part that arrived), and a whole
upload, plain or resumable in chunks, is stored byte for byte."""
import http.client
import importlib.util
import pathlib
import socket
import threading

import pytest

pytest.importorskip("gcp_storage_emulator")
REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gcs_emulator", REPO / "scripts" / "gcs_emulator.py")
gcs_emulator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gcs_emulator)


@pytest.fixture
def port():
    server = gcs_emulator.make_server("127.0.0.1", 0, "b")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _upload(port: int, name: str, declared: int, body: bytes) -> None:
    """A media upload declaring ``declared`` bytes that sends ``body`` and closes."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST /upload/storage/v1/b/b/o?uploadType=media&name={name} HTTP/1.1\r\n"
                  f"Host: x\r\nContent-Type: application/octet-stream\r\n"
                  f"Content-Length: {declared}\r\n\r\n".encode() + body)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        while s.recv(65536):       # until the server has handled it and closed
            pass


def _get(port: int, name: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", f"/storage/v1/b/b/o/{name}?alt=media")
    r = c.getresponse()
    return r.status, r.read()


def test_an_upload_cut_short_stores_nothing(port):
    body = bytes(range(256)) * 40
    _upload(port, "cut", len(body), body[:len(body) // 2])
    _upload(port, "whole", len(body), body)
    assert _get(port, "cut")[0] == 404
    assert _get(port, "whole") == (200, body)


def test_a_resumable_upload_in_chunks_is_stored_whole(port):
    body = bytes(range(256)) * 1024           # 256 KiB in two chunks
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/upload/storage/v1/b/b/o?uploadType=resumable&name=r", body=b"{}",
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    location = r.getheader("Location").split(f":{port}", 1)[1]
    half = len(body) // 2
    for start, chunk in ((0, body[:half]), (half, body[half:])):
        c.request("PUT", location, body=chunk, headers={
            "Content-Range": f"bytes {start}-{start + len(chunk) - 1}/{len(body)}"})
        c.getresponse().read()
    assert _get(port, "r") == (200, body)
