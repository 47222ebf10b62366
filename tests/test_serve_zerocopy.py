"""Blob bodies sent with sendfile(2) (sync/registry/zerocopy.py), over a real socket.

The server runs in process (`sync.serve.serve` on 127.0.0.1:0, hypercorn underneath); the
client is h11 on a trio socket, so framing is checked to the byte and several requests can
share one keep-alive connection. `os.sendfile` is counted, so a test knows the fast path ran.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import h11
import pytest
import trio

import modelfs.sync.registry.zerocopy as zerocopy
from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.sync.registry.blobs import OpenBlob, open_blob
from modelfs.sync.registry.serve import serve
from modelfs.sync.registry.server import RegistryApp
from modelfs.sync.registry.view import View
from tests.builders import TinyStore

SIZE = (24 << 20) + 13  # past SMALL_BLOB, and more than a loopback socket buffer takes at once
REPO = "library/big"

Answer = tuple[int, dict[str, str], bytes]
Blob = tuple[TinyStore, Digest, bytes]  # a store with one big blob: its digest and bytes


class Client:
    """One HTTP/1.1 connection; `get` sends a request and reads its whole answer."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def send(self, path: str, headers: dict[str, str], method: str) -> None:
        request = h11.Request(
            method=method, target=path, headers=[("Host", "modelfs"), *headers.items()]
        )
        await self.stream.send_all(self.conn.send(request) + self.conn.send(h11.EndOfMessage()))

    async def answer(self, chunk: int = 1 << 20) -> Answer:
        status, headers, body = 0, {}, bytearray()
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(chunk))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return status, headers, bytes(body)
            else:
                raise AssertionError(f"unexpected {event!r}")

    async def get(self, path: str, method: str = "GET", **headers: str) -> Answer:
        await self.send(path, {k.replace("_", "-"): v for k, v in headers.items()}, method)
        return await self.answer()


@pytest.fixture
def store(tmp_path: Path) -> Blob:
    tiny = TinyStore(tmp_path / "models")
    payload = os.urandom(SIZE)
    tiny.legacy("big:latest", tiny.manifest([tiny.layer("model", payload)]))
    return tiny, Digest.of_bytes(payload), payload


@pytest.fixture
def sendfiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each os.sendfile call sent."""
    calls: list[int] = []
    real = os.sendfile

    def counted(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        n = real(out_fd, in_fd, offset, count)
        calls.append(n)
        return n

    monkeypatch.setattr(zerocopy.os, "sendfile", counted)
    return calls


@asynccontextmanager
async def connected(tiny: TinyStore) -> AsyncIterator[Client]:
    """A server over the store on 127.0.0.1:0 and one connection to it."""
    app = RegistryApp(Layout(tiny.root), token=None)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve, app, "127.0.0.1:0")
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        try:
            yield Client(stream)
        finally:
            await stream.aclose()
            nursery.cancel_scope.cancel()


def blob_path(digest: Digest) -> str:
    return f"/v2/{REPO}/blobs/{digest}"


async def test_whole_and_ranged_bodies_are_exact_on_one_connection(
    store: Blob, sendfiles: list[int]
) -> None:
    tiny, digest, payload = store
    cases: list[tuple[str | None, int, slice]] = [
        (None, 200, slice(None)),
        ("bytes=0-0", 206, slice(0, 1)),
        ("bytes=5-1048580", 206, slice(5, 1048581)),
        (f"bytes={SIZE - 1}-", 206, slice(SIZE - 1, None)),  # the last byte
        (f"bytes={SIZE - 100}-{SIZE + 5000}", 206, slice(SIZE - 100, None)),  # clipped at the end
        ("bytes=-4097", 206, slice(SIZE - 4097, None)),  # a suffix
        (f"bytes=-{SIZE * 2}", 206, slice(None)),  # a suffix longer than the blob
        (f"bytes={SIZE // 2}-", 206, slice(SIZE // 2, None)),
        ("bytes=0-1,5-9", 200, slice(None)),  # several ranges: ignored, the whole blob
    ]
    async with connected(tiny) as client:
        for spec, status, want in cases:
            headers = {} if spec is None else {"range": spec}
            got_status, got_headers, body = await client.get(blob_path(digest), **headers)
            assert got_status == status, spec
            expected = payload[want]
            assert int(got_headers["content-length"]) == len(expected), spec
            assert body == expected, spec
            if status == 206:
                first = want.start or 0
                assert got_headers["content-range"] == (
                    f"bytes {first}-{first + len(expected) - 1}/{SIZE}"
                )
        # The connection is still in step: a HEAD and a manifest after the bodies.
        status, headers, body = await client.get(blob_path(digest), method="HEAD")
        assert (status, headers["content-length"], body) == (200, str(SIZE), b"")
        status, _, body = await client.get(f"/v2/{REPO}/manifests/latest")
        assert status == 200 and b'"schemaVersion":2' in body
    whole = sum(len(payload[w]) for _, _, w in cases)
    assert sum(sendfiles) == whole  # every body byte went out through sendfile
    assert len(sendfiles) > len(cases)  # the 24 MiB bodies took several calls: poll ran


async def test_refusals_are_unchanged(store: Blob, sendfiles: list[int]) -> None:
    tiny, digest, _ = store
    fifo = Digest("3" * 64)
    os.mkfifo(tiny.layout.blob(fifo))
    async with connected(tiny) as client:
        for spec in (f"bytes={SIZE}-", f"bytes={SIZE + 10}-{SIZE + 20}", "bytes=-0", "bytes=9-3"):
            status, headers, body = await client.get(blob_path(digest), range=spec)
            assert status == 416, spec
            assert headers["content-range"] == f"bytes */{SIZE}"
            assert b"RANGE_INVALID" in body
        with trio.fail_after(5):  # a FIFO is answered at once, never opened for reading
            status, _, body = await client.get(blob_path(fifo))
        assert status == 404 and b"BLOB_UNKNOWN" in body
        status, _, _ = await client.get(blob_path(Digest("4" * 64)))
        assert status == 404
    assert sendfiles == []


async def test_a_slow_reader_gets_every_byte(store: Blob, sendfiles: list[int]) -> None:
    """Small reads with pauses keep the socket full: the sender waits in poll, then goes on."""
    tiny, digest, payload = store
    async with connected(tiny) as client:
        await client.send(blob_path(digest), {"range": "bytes=-8000000"}, "GET")
        await trio.sleep(0.3)  # the server fills the socket and waits
        status, _, body = await client.answer(chunk=256 << 10)
        assert status == 206 and body == payload[-8000000:]
    assert sum(sendfiles) == 8000000


async def test_a_client_that_hangs_up_mid_body_leaves_the_server_serving(
    store: Blob, sendfiles: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Quietly, as hypercorn takes a hang-up during its own writes: no error, no traceback."""
    tiny, digest, payload = store
    async with connected(tiny) as client:
        # A second connection asks for the blob, reads a little and closes.
        host, port = client.stream.socket.getpeername()[:2]
        quitter = Client(await trio.open_tcp_stream(host, port))
        await quitter.send(blob_path(digest), {}, "GET")
        await quitter.stream.receive_some(65536)
        await quitter.stream.aclose()
        with trio.fail_after(10):
            status, _, body = await client.get(blob_path(digest), range="bytes=100-199")
        assert status == 206 and body == payload[100:200]
    assert 0 < sum(sendfiles) < SIZE + 100
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_blob_cut_short_under_the_server_cuts_the_connection(
    store: Blob, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Truncated after it was opened and its size checked: the client sees a short body,
    never a complete-looking one, and the next connection is served."""
    tiny, digest, payload = store

    def open_then_truncate(layout: Layout, view: View, at: Digest, *, read_small: bool) -> OpenBlob:
        blob = open_blob(layout, view, at, read_small=read_small)
        os.truncate(tiny.layout.blob(digest), SIZE // 2)
        return blob

    # The app opens blobs by the name it imported.
    monkeypatch.setattr("modelfs.sync.registry.server.open_blob", open_then_truncate)
    async with connected(tiny) as client:
        with trio.fail_after(10), pytest.raises(h11.RemoteProtocolError):
            await client.get(blob_path(digest))
    monkeypatch.undo()
    tiny.layout.blob(digest).write_bytes(payload)
    async with connected(tiny) as again:
        status, _, body = await again.get(blob_path(digest), range="bytes=0-9")
        assert status == 206 and body == payload[:10]
