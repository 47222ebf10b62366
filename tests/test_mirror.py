"""`modelfs serve --mirror URL`: a pull-through cache of one registry for a fleet (sync.mirror).

Every server is a process or a socket relay on loopback: Debian's docker-registry
(tests/registry.py) as the upstream, holding models pushed with `modelfs push`;
tests/tokenregistry.py where the upstream signs clients in with the token flow; between the
mirror and its upstream a relay (tests/throttle.py) that notes every request and can slow the
answers, send a wrong byte, or cut a blob short. The clients are `modelfs pull` processes, an
Ollama client transcribed from Ollama's pull (tests/ollama.py), and plain HTTP GETs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from modelfs.store.digest import Digest
from modelfs.store.layout import Layout
from modelfs.store.leases import read_leases
from modelfs.store.names import parse_name
from tests.builders import TinyStore
from tests.ollama import OllamaClient
from tests.registry import Registry, needs_registry, running_registry
from tests.test_registries import (
    BIG,
    PASSWORD,
    PRIVATE,
    PUBLIC,
    auths,
    docker_config,
    pull,
    push,
    same_model,
    source,
    token_registry,
)
from tests.test_serve_process import MODELFS, read_line, stop
from tests.throttle import Throttle

pytestmark = needs_registry
_ = source  # the module's fixture: the models of tests/test_registries.py

MODEL = PUBLIC  # someuser/open:1, a 12 MiB model layer: the large-blob receiver carries it
NO_PROXY = {k: "" for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}


@pytest.fixture
def upstream(source: TinyStore, tmp_path: Path) -> Iterator[Registry]:
    with running_registry(tmp_path / "registry") as reg:
        push(source, reg.url, MODEL, {})
        yield reg


class Relay(Throttle):
    """The relay of tests/throttle.py that can also lie: `flip` sends one wrong byte, `cut`
    closes the connection, each once, a MiB into an answer (deep in a blob's body: manifests
    and headers are far smaller)."""

    def __init__(self, upstream: tuple[str, int], rate: float) -> None:
        super().__init__(upstream, rate)
        self.mode: str | None = None

    def _answers(self, src: socket.socket, dst: socket.socket) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while chunk := src.recv(64 << 10):
                if self.mode is not None and seen + len(chunk) > 1 << 20:
                    mode, self.mode = self.mode, None
                    if mode == "cut":
                        break
                    at = (1 << 20) - seen if seen < 1 << 20 else 0
                    chunk = chunk[:at] + bytes([chunk[at] ^ 0xFF]) + chunk[at + 1 :]
                dst.sendall(chunk)
                seen += len(chunk)
                self.relayed += len(chunk)
                time.sleep(len(chunk) / self.rate)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def relay_to(url: str, rate: float = 1e12) -> Relay:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return Relay((host, int(port)), rate)


@contextlib.contextmanager
def mirror(
    store: Path, upstream: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    store.mkdir(parents=True, exist_ok=True)
    full = {**os.environ, **NO_PROXY, **(env or {})}
    command = [MODELFS, "serve", "--store", str(store), "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [*command, "--mirror", upstream, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=full,
    )
    try:
        line = read_line(proc, 30)
        assert line.startswith("listening on "), line
        yield line.removeprefix("listening on ").strip(), proc
    finally:
        stop(proc)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def blob_gets(seen: list[tuple[str, str]]) -> Counter[str]:
    """How many times each blob was asked for (GET), by digest."""
    return Counter(p.rsplit("/", 1)[1] for m, p in seen if m == "GET" and "/blobs/sha256:" in p)


def layers(source: TinyStore, name: str) -> list[dict[str, object]]:
    doc = json.loads(source.layout.legacy_manifest(parse_name(name)).read_bytes())
    return [doc["config"], *doc["layers"]]


def kept(store: Path, source: TinyStore, name: str, timeout: float = 20) -> None:
    """The mirror's store has the model, byte for byte (its manifest is written last)."""
    path = Layout(store).legacy_manifest(parse_name(name))
    want = source.layout.legacy_manifest(parse_name(name)).read_bytes()
    deadline = time.monotonic() + timeout
    while not path.exists() or path.read_bytes() != want:
        assert time.monotonic() < deadline, f"{name} was not kept in {store}"
        time.sleep(0.1)
    same_model(source, store, name)


def lets_go(store: Path, source: TinyStore, name: str, timeout: float = 20) -> None:
    """Once a model is kept, the mirror's lease holds none of its blobs (its manifest keeps
    them now); a hold the mirror does not let go would keep them from GC while it runs."""
    wanted = {Digest.parse(str(x["digest"])) for x in layers(source, name)}
    deadline = time.monotonic() + timeout
    while True:
        held = set().union(*(x.digests for x in read_leases(Layout(store)).live))
        if not held & wanted:
            return
        assert time.monotonic() < deadline, f"the mirror still holds {held & wanted}"
        time.sleep(0.1)


def no_temp_files(store: Path) -> None:
    tmp = store / ".modelfs" / "tmp"
    assert not list(tmp.glob("pull-*.partial")) if tmp.exists() else True


# -- a fleet through one mirror ---------------------------------------------------------------
def test_three_clients_at_once_fetch_each_blob_once(
    source: TinyStore, upstream: Registry, tmp_path: Path
) -> None:
    """A `modelfs pull`, a second modelfs host pulling from the mirror as its peer, and an
    Ollama client (tests/ollama.py: ollama/ollama fb30760 server/images.go:1272-1294 asks for the
    manifest with the docker v2 Accept only; server/download.go:130-185, 218-365 HEADs the blob,
    GETs it, then GETs the Location in `Range` parts; `--insecure` plain http) pull one model
    through one mirror at the same time, while the upstream answers slowly: upstream is asked
    for each blob once, every client gets the right bytes, and the mirror keeps the model. A
    fourth pull later asks upstream for no blob at all."""
    with (
        relay_to(upstream.url, rate=8 << 20) as relay,
        mirror(tmp_path / "m", relay.url) as (
            url,
            _,
        ),
    ):
        host = url.removeprefix("http://")
        ollama = OllamaClient(tmp_path / "ollama-home")
        stores = [tmp_path / "a", tmp_path / "b"]
        for s in stores:
            s.mkdir()
        pulls = [
            subprocess.Popen(
                [MODELFS, "pull", "--store", str(s), MODEL, "--from", url],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **NO_PROXY},
            )
            for s in stores
        ]
        try:
            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(ollama.pull, f"{host}/{MODEL}", insecure=True)
                results = [p.communicate(timeout=120) for p in pulls]
                done.result(timeout=120)
        finally:
            for p in pulls:
                p.kill()
            ollama.close()
        for p, (_, err) in zip(pulls, results, strict=True):
            assert p.returncode == 0, err.decode()
        for s in stores:
            same_model(source, s, MODEL)
        for layer in layers(source, MODEL):
            digest = str(layer["digest"])
            got = ollama.blob_path(digest).read_bytes()
            assert hashlib.sha256(got).hexdigest() == digest.split(":")[1]
        assert any("Range" in entry.headers for entry in ollama.log), "Ollama sent no Range"
        kept(tmp_path / "m", source, MODEL)
        lets_go(tmp_path / "m", source, MODEL)
        seen = [(r.method, r.path) for r in relay.requests]
        counts = blob_gets(seen)
        assert set(counts) == {str(x["digest"]) for x in layers(source, MODEL)}, seen
        assert set(counts.values()) == {1}, counts
        no_temp_files(tmp_path / "m")

        before = len(relay.requests)
        r = pull(tmp_path / "c", url, MODEL, env=NO_PROXY)
        assert r.returncode == 0, r.stderr
        same_model(source, tmp_path / "c", MODEL)
        assert not blob_gets([(x.method, x.path) for x in relay.requests[before:]])


# -- an upstream that lies or dies ------------------------------------------------------------
@pytest.mark.parametrize("mode", ["flip", "cut"])
def test_bad_or_cut_blob_is_not_kept_and_a_retry_succeeds(
    source: TinyStore, upstream: Registry, tmp_path: Path, mode: str
) -> None:
    """A blob whose bytes arrive wrong (one flipped byte) or cut short: the client's answer is
    not completed (the connection is cut before the last byte), nothing is kept, no temp file is
    left; the next request fetches it again and gets, and keeps, the right bytes."""
    big = next(x for x in layers(source, MODEL) if int(str(x["size"])) == BIG)
    digest = str(big["digest"])
    path = f"/v2/someuser/open/blobs/{digest}"
    with (
        relay_to(upstream.url, rate=2 << 20) as relay,
        mirror(tmp_path / "m", relay.url) as (
            url,
            _,
        ),
    ):
        relay.mode = mode

        def client() -> tuple[int, str]:
            got = 0
            try:
                with httpx.stream("GET", url + path, timeout=30) as r:
                    assert r.status_code == 200
                    assert r.headers["content-length"] == str(BIG)
                    for chunk in r.iter_raw():
                        got += len(chunk)
            except httpx.HTTPError as exc:
                return got, type(exc).__name__
            return got, "completed"

        # Two clients on one fetch: both answers are cut, neither is completed.
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: client(), range(2)))
        assert all(how != "completed" and got < BIG for got, how in answers), answers
        assert blob_gets([(x.method, x.path) for x in relay.requests])[digest] == 1
        blob = Layout(tmp_path / "m").blob(Digest.parse(digest))
        time.sleep(0.5)
        assert not blob.exists()
        no_temp_files(tmp_path / "m")

        relay.rate = 1e12
        r2 = httpx.get(url + path, timeout=30)
        assert r2.status_code == 200
        assert hashlib.sha256(r2.content).hexdigest() == digest.split(":")[1]
        assert blob.exists()
        assert blob_gets([(x.method, x.path) for x in relay.requests])[digest] == 2


# -- tags: a second look after the TTL; upstream down ------------------------------------------
def test_tag_is_looked_up_again_after_the_ttl_and_served_when_upstream_is_down(
    source: TinyStore, upstream: Registry, tmp_path: Path
) -> None:
    """Within `--mirror-ttl` a tag's manifest is served without asking upstream; after it,
    upstream is asked again and a moved tag is followed; with upstream gone the stored copy is
    served. A manifest by digest is never asked for twice."""
    manifest_path = "/v2/someuser/open/manifests/1"
    with (
        relay_to(upstream.url) as relay,
        mirror(tmp_path / "m", relay.url, "--mirror-ttl", "2s") as (url, _),
    ):

        def asked() -> int:
            return sum(1 for x in relay.requests if x.path == manifest_path)

        first = httpx.get(url + manifest_path, timeout=30)
        assert first.status_code == 200
        kept(tmp_path / "m", source, MODEL)
        assert asked() == 1
        assert httpx.get(url + manifest_path, timeout=30).content == first.content
        assert asked() == 1
        time.sleep(2.2)
        assert httpx.get(url + manifest_path, timeout=30).content == first.content
        assert asked() == 2

        # The tag moves upstream: followed after the TTL.
        moved = TinyStore(tmp_path / "moved")
        moved.gguf_model(MODEL, payload=b"a new version")
        push(moved, upstream.url, MODEL, {})
        time.sleep(2.2)
        new = httpx.get(url + manifest_path, timeout=30)
        assert new.status_code == 200 and new.content != first.content
        kept(tmp_path / "m", moved, MODEL)

        digest = new.headers["docker-content-digest"]
        by_digest = f"/v2/someuser/open/manifests/{digest}"
        for _ in range(2):
            assert httpx.get(url + by_digest, timeout=30).content == new.content
        assert not any(x.path == by_digest for x in relay.requests)

        upstream.process.terminate()  # upstream is gone
        upstream.process.wait(timeout=10)
        time.sleep(2.2)
        down = httpx.get(url + manifest_path, timeout=30)
        assert down.status_code == 200 and down.content == new.content
        missing = httpx.get(url + "/v2/someuser/other/manifests/1", timeout=30)
        assert missing.status_code == 502, missing.text


def test_token_upstream_through_the_mirror(source: TinyStore, tmp_path: Path) -> None:
    """An upstream with the token flow and a CDN: the mirror signs in with docker's
    credentials (its DOCKER_CONFIG), its clients need none of them."""
    with token_registry(tmp_path, "--cdn") as reg:
        creds = docker_config(tmp_path / "docker", auths(reg.url))
        push(source, reg.url, PRIVATE, creds)
        with mirror(tmp_path / "m", reg.url, env=creds) as (url, _):
            r = pull(tmp_path / "a", url, PRIVATE, env=NO_PROXY)
            assert r.returncode == 0, r.stderr
            same_model(source, tmp_path / "a", PRIVATE)
            kept(tmp_path / "m", source, PRIVATE)
        assert any(t["user"] == "alice" for t in reg.stats()["tokens"])
        assert reg.stats()["cdn"]


def test_a_mirror_without_the_upstream_credentials_says_so(
    source: TinyStore, tmp_path: Path
) -> None:
    with token_registry(tmp_path) as reg:
        creds = docker_config(tmp_path / "docker", auths(reg.url))
        push(source, reg.url, PRIVATE, creds)
        nobody = docker_config(tmp_path / "empty", {})
        with mirror(tmp_path / "m", reg.url, env=nobody) as (url, _):
            r = httpx.get(f"{url}/v2/private/secret/manifests/1", timeout=30)
            assert r.status_code == 502
            message = r.json()["errors"][0]["message"]
            assert "refused repository:private/secret:pull without credentials" in message
            assert PASSWORD not in r.text


def test_sync_daemon_mirrors_with_the_docker_config_it_names(
    source: TinyStore, tmp_path: Path
) -> None:
    """`mirror = URL` and `docker_config = PATH` in the daemon's config: the daemon is a
    pull-through cache that signs in upstream with the credentials of that file (none in its
    environment), and another host's `modelfs pull` through it gets the private model."""
    from tests.test_daemon import daemon

    with token_registry(tmp_path) as reg:
        creds = docker_config(tmp_path / "docker", auths(reg.url))
        push(source, reg.url, PRIVATE, creds)
        nobody = docker_config(tmp_path / "empty", {})
        with daemon(
            tmp_path,
            "m",
            env=nobody,
            store=str(tmp_path / "m"),
            mirror=reg.url,
            mirror_ttl="1m",
            docker_config=str(tmp_path / "docker" / "config.json"),
        ) as d:
            r = pull(tmp_path / "a", d.url, PRIVATE, env=NO_PROXY)
            assert r.returncode == 0, r.stderr + d.text()
            same_model(source, tmp_path / "a", PRIVATE)
            kept(tmp_path / "m", source, PRIVATE)
            assert PASSWORD not in d.text()


def test_mirror_config_keys_are_checked(tmp_path: Path) -> None:
    from modelfs.sync.daemon.config import ConfigError, load_config
    from tests.test_daemon import write_config

    good = load_config(
        write_config(tmp_path / "a.toml", mirror="http://up:5000/", mirror_ttl="90s")
    )
    assert (good.mirror, good.mirror_ttl, good.docker_config) == ("http://up:5000", 90.0, None)
    assert load_config(write_config(tmp_path / "b.toml")).mirror is None
    with pytest.raises(ConfigError, match="mirror"):
        load_config(write_config(tmp_path / "c.toml", mirror="up:5000"))
    with pytest.raises(ConfigError, match="mirror_ttl"):
        load_config(write_config(tmp_path / "d.toml", mirror_ttl="soon"))


def test_a_chunked_upstream_goes_through_httpx(tmp_path: Path) -> None:
    """An upstream whose blob answers the raw receiver does not take (chunked, from a static
    web server that ignores Range: tests/rangeless_peer.py): the mirror fetches them with httpx
    instead, streams and keeps them the same way."""
    import sys

    from tests.rangeless_peer import lay_out
    from tests.test_pull_hosts import server

    tiny = TinyStore(tmp_path / "src")
    tiny.gguf_model("big:1", payload=os.urandom(BIG))
    www = lay_out(tiny.root, tmp_path / "www", "big:1")
    argv = [sys.executable, "-m", "tests.rangeless_peer", "--directory", str(www), "--chunked"]
    with server(argv) as up, mirror(tmp_path / "m", up) as (url, _):
        r = pull(tmp_path / "a", url, "big:1", env=NO_PROXY)
        assert r.returncode == 0, r.stderr
        same_model(tiny, tmp_path / "a", "big:1")
        kept(tmp_path / "m", tiny, "big:1")
        status = httpx.get(f"{url}/modelfs/v1/status", timeout=10).json()["mirror"]
        assert status["upstream"] == up and status["pending"] == [] and status["fetching"] == 0


def test_a_blob_renamed_into_the_store_before_its_fetch_is_marked_landed_is_served(
    tmp_path: Path,
) -> None:
    """The window between the rename of a finished fetch into blobs/ and `BlobFetch.land`:
    the temp file is gone and the fetch does not say landed yet. A request that opens the blob
    then gets the stored blob (it was answered 404 there, which failed a pull under load)."""
    from modelfs.store.errors import MissingBlobError
    from modelfs.sync.mirror.mirror import BlobFetch
    from modelfs.sync.registry.blobs import OpenBlob, open_growing

    data = b"weights"
    digest = Digest.parse("sha256:" + hashlib.sha256(data).hexdigest())
    fetch = BlobFetch(digest, len(data), path=tmp_path / "renamed-away")
    stored = tmp_path / "blob"

    def open_stored() -> OpenBlob:
        try:
            return OpenBlob(os.open(stored, os.O_RDONLY), len(data))
        except FileNotFoundError:
            raise MissingBlobError(f"blob {digest} not found") from None

    with pytest.raises(MissingBlobError):  # a failed fetch discarded its file: missing
        open_growing(fetch, open_stored)
    stored.write_bytes(data)
    blob = open_growing(fetch, open_stored)
    try:
        assert blob.growing is None and os.pread(blob.fd, 100, 0) == data
    finally:
        os.close(blob.fd)


# -- manifest lists ---------------------------------------------------------------------------
def _wait_for(what: str, ok: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_manifest_list_is_kept_from_the_children_clients_take(tmp_path: Path) -> None:
    """A list tag (the demo store's gemma4:26b: a llamacpp and an mlx child) through a mirror
    whose upstream is `modelfs serve`. A pull takes the llamacpp child; the mirror then writes
    the tag as a pull of that child writes it (the v2 link to the list's exact bytes, the
    legacy anchor), and a GC of the mirror's store keeps all of it. A pull that prefers mlx
    adds that child (its variant anchor `26b-mlx`). With upstream gone, both pulls work from
    the mirror's store alone. (Lists were relayed but never written: their blobs were
    orphans to GC, and a list tag was lost whenever upstream was down.)"""
    from modelfs.demo import build_demo_store
    from modelfs.store.manifest import ManifestList, parse_manifest
    from modelfs.store.scan import scan_store
    from tests.test_pull_hosts import modelfs_serve

    build_demo_store(tmp_path / "src")
    src, kept_at = Layout(tmp_path / "src"), Layout(tmp_path / "m")
    name = parse_name("gemma4:26b")
    list_raw = src.v2_manifest(name).read_bytes()
    lst = parse_manifest(list_raw, "gemma4:26b")
    assert isinstance(lst, ManifestList)
    by_runner = {c.runner: c.digest for c in lst.children}

    def child_blobs(runner: str) -> list[Path]:
        doc = json.loads(src.blob(by_runner[runner]).read_bytes())
        return [kept_at.blob(Digest.parse(x["digest"])) for x in [doc["config"], *doc["layers"]]]

    def gc() -> None:
        for _ in range(2):  # a blob goes on the second pass that finds it unneeded
            argv = [MODELFS, "gc", "--store", str(kept_at.root), "--grace", "0"]
            argv += ["--grace-below-floor", "--trash-retention", "0s"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr

    with modelfs_serve(tmp_path / "src") as up, mirror(kept_at.root, up) as (url, _):
        r = pull(tmp_path / "a", url, "gemma4:26b", env=NO_PROXY)
        assert r.returncode == 0, r.stderr
        v2 = kept_at.v2_manifest(name)
        _wait_for("the list tag is written", lambda: v2.exists())
        assert v2.read_bytes() == list_raw
        anchor = json.loads(kept_at.legacy_manifest(name).read_bytes())
        assert {x["digest"] for x in anchor["layers"]} >= {str(lst.digest)}
        gc()
        assert all(p.exists() for p in child_blobs("llamacpp"))
        entry = scan_store(kept_at.root).lookup(name)
        assert entry.digest == lst.digest and entry.source == "v2"

        r = pull(tmp_path / "b", url, "gemma4:26b", "--prefer", "mlx", env=NO_PROXY)
        assert r.returncode == 0, r.stderr
        mlx_anchor = kept_at.legacy_manifest(name.with_tag("26b-mlx"))
        _wait_for("the mlx child is written", lambda: mlx_anchor.exists())
        assert mlx_anchor.read_bytes() == src.blob(by_runner["mlx"]).read_bytes()
        gc()
        assert all(p.exists() for p in child_blobs("llamacpp") + child_blobs("mlx"))

    with mirror(kept_at.root, "http://127.0.0.1:9") as (url, _):  # upstream gone
        for store, prefer in (("c", "llamacpp"), ("d", "mlx")):
            r = pull(tmp_path / store, url, "gemma4:26b", "--prefer", prefer, env=NO_PROXY)
            assert r.returncode == 0, r.stderr
            child = src.blob(by_runner[prefer]).read_bytes()
            assert Layout(tmp_path / store).legacy_manifest(name).read_bytes() != b""
            assert Layout(tmp_path / store).blob(by_runner[prefer]).read_bytes() == child


def test_tags_that_do_not_exist_upstream_leave_nothing_behind(
    upstream: Registry, tmp_path: Path
) -> None:
    """A mirror locks each tag while it looks it up upstream. Clients choose the names, so a
    lock kept per name asked would let anyone grow the server by asking for tags that do not
    exist; each is answered 404, and once answered no lock is kept for it."""
    with mirror(tmp_path / "m", upstream.url) as (url, _):
        paths = [f"/v2/someuser/nope{i}/manifests/v{i % 7}" for i in range(120)]

        def get(path: str) -> int:
            return httpx.get(url + path, timeout=30).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(get, paths))
        assert set(codes) == {404}, Counter(codes)
        status = httpx.get(f"{url}/modelfs/v1/status", timeout=10).json()["mirror"]
        assert status["tags_looking_up"] == 0, status
        assert status["upstream_requests"] >= len(paths)
