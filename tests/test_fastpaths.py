"""The fast paths of the scan and the GC plan take and refuse exactly what the full checks do.

- the manifest parser checks a manifest's layers in one loop (`_plain_digest_texts`) and its
  canonical digests in one match (`digest_hexes`); anything else goes to `_checked_layer`,
  the check that says what is wrong. Both `parse_manifest` and its digests-only mode for GC
  (`parse_manifest_refs`) must agree with `_checked_layer` on every layer, good or bad;
- GC's reach takes the digests of a manifest Go's encoder wrote straight from its bytes
  (`_go_manifest_refs`) and must give what decoding and checking it does
  (`_json_manifest_refs`), taking and refusing alike;
- `Name.check` matches the four parts of a name in one regex, the per-part ones naming the
  bad part;
- `store.fileio.read_fd` reads a file fstat sized in one read, and on when it was wrong;
- GC keeps the blob a digest in any accepted spelling names, and refuses over a manifest
  with a digest no spelling accepts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from modelfs.store import names
from modelfs.store.collect.gc import GcPolicy, plan_gc
from modelfs.store.digest import Digest, digest_hex, digest_hexes
from modelfs.store.disk import fileio
from modelfs.store.errors import InvalidDigestError, InvalidNameError, ManifestError
from modelfs.store.manifest import (
    MEDIA_LIST,
    MEDIA_MANIFEST,
    Manifest,
    ManifestRefs,
    _checked_layer,
    _go_manifest_refs,
    _json_manifest_refs,
    parse_manifest,
    parse_manifest_refs,
)
from modelfs.store.names import Name
from tests.builders import LAYER, TinyStore, compact

HEXES = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)

# Digest strings: every spelling Ollama accepts, and the near misses.
DIGESTS = st.one_of(
    HEXES.map(lambda h: f"sha256:{h}"),
    HEXES.map(lambda h: f"sha256:{h.upper()}"),
    HEXES.map(lambda h: f"sha256-{h}"),
    HEXES.map(lambda h: f"sha256:{h}0"),  # one hex digit too many
    HEXES.map(lambda h: f"sha256:{h[1:]}"),  # one too few
    HEXES.map(lambda h: f"sha256:{h[:30]}g{h[31:]}"),  # not hex
    HEXES.map(lambda h: f"sha256:{h}\n"),
    HEXES.map(lambda h: f"sha256:{h[:35]}\nsha256:{h[:35]}"),  # a line break inside
    HEXES.map(lambda h: f"sha512:{h}"),
    HEXES.map(lambda h: f" sha256:{h}"),
    HEXES.map(lambda h: f"sha256:{h[:32]}\u0663{h[33:]}"),  # a non-ASCII digit
    st.text(max_size=80),
)

MISSING = object()  # a key left out


def _value(*options: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.just(MISSING), *options)


def _layer(
    media: st.SearchStrategy[Any],
    digest: st.SearchStrategy[Any],
    size: st.SearchStrategy[Any],
    name: st.SearchStrategy[Any],
    origin: st.SearchStrategy[Any],
) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "mediaType": media,
            "digest": digest,
            "size": size,
            "name": name,
            "from": origin,
            "extra": _value(st.just({"any": "thing"})),
        }
    ).map(lambda d: {k: v for k, v in d.items() if v is not MISSING})


GOOD_LAYERS = _layer(
    st.sampled_from([LAYER + "model", LAYER + "tensor", "tensor", "x"]),
    st.one_of(
        HEXES.map(lambda h: f"sha256:{h}"),
        HEXES.map(lambda h: f"sha256-{h.upper()}"),
    ),
    st.integers(min_value=0, max_value=1 << 40),
    _value(st.none(), st.just("model.w"), st.just("caf\u00e9"), st.just("\ud800")),
    _value(st.none(), st.just("base")),
)
ANY_LAYERS = st.one_of(
    _layer(
        st.one_of(
            st.sampled_from([LAYER + "model", "x"]),
            _value(st.none(), st.integers(), st.just("application/\u00e9"), st.just([])),
            st.just("application/\ud800"),  # a lone surrogate, which the full check replaces
        ),
        st.one_of(DIGESTS, _value(st.none(), st.integers())),
        st.one_of(
            st.integers(min_value=0),
            _value(
                st.integers(max_value=-1),
                st.booleans(),
                st.floats(allow_nan=False),
                st.just("3"),
                st.none(),
            ),
        ),
        _value(st.none(), st.just("model.w"), st.just("\ud800"), st.just(1)),
        _value(st.none(), st.just("base"), st.just(["base"])),
    ),
    st.sampled_from([None, 3, "layer", [], ["a"], True]),
)
# Mostly well-formed layers, so that a manifest is often taken, with odd ones among them.
LAYERS = st.one_of(GOOD_LAYERS, GOOD_LAYERS, GOOD_LAYERS, GOOD_LAYERS, ANY_LAYERS)


@st.composite
def manifests(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.lists(LAYERS, max_size=5))
    config = draw(st.one_of(LAYERS, st.sampled_from([MISSING, None, {}, 0, []])))
    obj: dict[str, Any] = {"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "layers": layers}
    if config is not MISSING:
        obj["config"] = config
    return obj


def _outcome(parse: Callable[[bytes, str], Any], raw: bytes) -> Any:
    """What `parse` makes of `raw`, or the error it gives."""
    try:
        return parse(raw, "m")
    except ManifestError as exc:
        return str(exc)


def _reference(checked: list[Any]) -> list[Digest] | str:
    """What the full check alone makes of the config and layers: their digests, or the
    first error."""
    try:
        return [_checked_layer(obj, "m").digest for obj in checked]
    except ManifestError as exc:
        return str(exc)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifests())
def test_both_parsers_take_and_refuse_what_the_full_check_does(obj: dict[str, Any]) -> None:
    raw = json.dumps(obj).encode()
    loaded = json.loads(raw)
    # The config (when there is one: a falsy value is none) and the layers, in check order.
    checked = ([loaded["config"]] if loaded.get("config") else []) + loaded["layers"]
    want = _reference(checked)
    full, refs = _outcome(parse_manifest, raw), _outcome(parse_manifest_refs, raw)
    event("refused" if isinstance(want, str) else "taken")
    if isinstance(want, str):
        assert full == want and refs == want
        return
    assert isinstance(full, Manifest) and isinstance(refs, ManifestRefs)
    layers = ([full.config] if full.config is not None else []) + list(full.layers)
    assert layers == [_checked_layer(o, "m") for o in checked]
    assert [layer.digest for layer in layers] == want
    assert refs.blob_names == [d.blob_name for d in want]
    assert refs.digest == full.digest == Digest.of_bytes(raw)


_GO_LAYER_ORDER = ("mediaType", "digest", "size", "from", "name")
_GO_TOP_ORDER = ("schemaVersion", "mediaType", "config", "layers", "runner", "format")


def _in_order(obj: Any, order: tuple[str, ...]) -> Any:
    """A dict with `order`'s keys first, in that order, as a Go struct marshals."""
    if not isinstance(obj, dict):
        return obj
    return {k: obj[k] for k in order if k in obj} | {k: v for k, v in obj.items() if k not in order}


# Byte edits a copied or hand-edited manifest may carry, each of which must make the bytes
# either still mean the same thing or be refused, by both paths alike.
_EDITS: list[tuple[bytes, bytes]] = [
    *[(b"", b"")] * 8,
    (b'"schemaVersion":2', b'"schemaVersion":02'),
    (b'"schemaVersion":2', b'"schemaVersion":2.0'),
    (b'"size":', b'"size":0'),
    (b'"size":', b'"size":-'),
    (b'"size":', b'"size": '),
    (b'"digest":"sha256:', b'"digest":"sha256:\\u0030'),
    (b'"digest":"sha256:', b'"digest":"sha256:0'),
    (b'"mediaType":"', b'"mediaType":"\\u0041'),
    (b'"mediaType":"', b'"mediaType":"<\\"'),
    (b"}", b"} "),
    (b"}", b"},"),
    (b"]", b",]"),
    (b'"layers":', b'"layers":null,"layers":'),
    (b'"config":', b'"config":{},"config":'),
    (b'"mediaType":"' + MEDIA_MANIFEST.encode(), b'"mediaType":"' + MEDIA_LIST.encode()),
    (b"{", b"\xef\xbb\xbf{"),
]


_ASCII = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
GO_LAYERS = _layer(
    st.one_of(st.sampled_from([LAYER + "model", LAYER + "template", ""]), _ASCII),
    HEXES.map(lambda h: f"sha256:{h}"),
    st.one_of(st.integers(min_value=0, max_value=1 << 40), st.integers(min_value=0)),
    _value(_ASCII),
    _value(_ASCII),
).map(lambda d: {k: v for k, v in d.items() if k != "extra"})


@st.composite
def go_manifests(draw: st.DrawFn) -> dict[str, Any]:
    """Manifests whose every field Ollama's encoder could have written."""
    return {
        "schemaVersion": draw(st.sampled_from([2, 0, 10**9])),
        "mediaType": draw(st.one_of(st.just(MEDIA_MANIFEST), _ASCII)),
        "config": draw(GO_LAYERS),
        "layers": draw(st.lists(GO_LAYERS, max_size=5)),
    }


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(manifests(), go_manifests(), go_manifests()),
    st.sampled_from([None, "ollama", "mlx"]),
    st.sampled_from(_EDITS),
    st.integers(min_value=1, max_value=3),
    st.booleans(),
)
def test_a_go_encoded_manifest_read_from_its_bytes_is_what_decoding_it_gives(
    obj: dict[str, Any],
    runner: str | None,
    edit: tuple[bytes, bytes],
    nth: int,
    newline: bool,
) -> None:
    """Bytes laid out as Ollama's encoder writes them (struct field order, compact, a
    newline), sometimes edited: the pattern's reading is the JSON path's, or it stands
    aside. Often enough it is taken (`event` counts), so the comparison is not empty."""
    if runner is not None:
        obj["runner"] = runner
    obj = _in_order(obj, _GO_TOP_ORDER)
    for key in ("config",):
        if key in obj:
            obj[key] = _in_order(obj[key], _GO_LAYER_ORDER)
    obj["layers"] = [_in_order(layer, _GO_LAYER_ORDER) for layer in obj["layers"]]
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    raw += b"\n" if newline else b""
    old, new = edit
    if old:
        head, *rest = raw.split(old)
        if rest:  # the nth occurrence, counting round
            at = (nth - 1) % len(rest) + 1
            raw = old.join([head, *rest[: at - 1]]) + new + old.join(rest[at - 1 :])
    fast = _go_manifest_refs(raw)
    want = _outcome(_json_manifest_refs, raw)
    event("read from the bytes" if fast is not None else "decoded")
    if fast is not None:
        assert fast == want
    assert _outcome(parse_manifest_refs, raw) == want


def test_a_manifest_ollama_writes_is_read_from_its_bytes(tmp_path: Path) -> None:
    """The pattern is not dead: the bytes of a store's manifests as Ollama writes them (the
    demo store's writer follows Go's encoder) take it, and give the JSON path's digests."""
    from modelfs.demo import build_demo_store

    build_demo_store(tmp_path)
    files = [p for p in (tmp_path / "manifests").rglob("*") if p.is_file()]
    assert files
    for path in files:
        raw = path.read_bytes()
        fast = _go_manifest_refs(raw)
        assert fast is not None, path
        assert fast == _json_manifest_refs(raw, "m")


@settings(max_examples=600, deadline=None)
@given(st.lists(DIGESTS, max_size=6))
def test_one_match_over_many_digests_agrees_with_one_each(texts: list[str]) -> None:
    each = [digest_hex(t) for t in texts]
    assert digest_hexes(texts) == (None if None in each else each)
    for text, hex_ in zip(texts, each, strict=True):
        if hex_ is None:
            with pytest.raises(InvalidDigestError):
                Digest.parse(text)
        else:
            assert Digest.parse(text).hex == hex_


def test_a_line_break_cannot_join_or_split_digests() -> None:
    a, b = "a" * 64, "b" * 64
    for texts in (
        [f"sha256:{a}\nsha256:{b}"],  # two digests in one string
        [f"sha256:{a}\nsha256:{b}", ""],
        [f"sha256:{a}\n", f"sha256:{b}"[:-1]],  # the lengths add up, the split does not
        [f"sha256:{a}"[:-1], f"{a[-1]}\nsha256:{b}"],
    ):
        assert digest_hexes(texts) is None, texts
    assert digest_hexes([f"sha256:{a}", f"sha256-{b.upper()}"]) == [a, b]
    assert digest_hexes([]) == []


ODD = st.text(alphabet=st.sampled_from(list("aZ9_.:-/\\ %@\u00e9\x00")), max_size=6)
GOOD = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,6}", fullmatch=True)
# Mostly parts that may pass, some with something odd after a good start.
PART = st.one_of(GOOD, GOOD, ODD, st.tuples(GOOD, ODD).map("".join))


@settings(max_examples=800, deadline=None)
@given(PART, PART, PART, PART)
def test_one_match_over_a_name_agrees_with_one_per_part(
    host: str, namespace: str, model: str, tag: str
) -> None:
    parts = (host, namespace, model, tag)
    rules = (names._HOST, names._NAMESPACE, names._MODEL, names._TAG)
    ok = all(rule.fullmatch(part) is not None for rule, part in zip(rules, parts, strict=True))
    if ok:
        Name(*parts).check()
    else:
        with pytest.raises(InvalidNameError):
            Name(*parts).check()


def test_a_name_check_names_the_bad_part() -> None:
    with pytest.raises(InvalidNameError, match=r"invalid tag '\.\./x'"):
        Name("registry.ollama.ai", "library", "m", "../x").check()
    with pytest.raises(InvalidNameError, match="invalid host"):
        Name(None, "library", "m", "t").check()  # type: ignore[arg-type]


def test_read_fd_reads_on_when_fstat_was_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bytes(range(256)) * 40
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fileio.read_fd(fd, len(data), 1 << 20) == data
        os.lseek(fd, 0, os.SEEK_SET)
        assert fileio.read_fd(fd, 0, 1 << 20) == data  # fstat said 0 (a /proc-like file)
        os.lseek(fd, 0, os.SEEK_SET)
        assert fileio.read_fd(fd, 100, 1 << 20) == data  # it grew since
        os.lseek(fd, 0, os.SEEK_SET)
        assert fileio.read_fd(fd, len(data), 999) == data[:1000]  # the limit, and one more
        real = os.read
        os.lseek(fd, 0, os.SEEK_SET)
        with monkeypatch.context() as patch:
            patch.setattr(os, "read", lambda fd, n: real(fd, min(n, 7)))
            got = fileio.read_fd(fd, len(data), 1 << 20)
        assert got == data  # a network file's short reads
    finally:
        os.close(fd)
    assert fileio.read_file(tmp_path / "f", 10) == data[:11]
    (tmp_path / "empty").write_bytes(b"")
    assert fileio.read_file_stat(tmp_path / "empty", 10)[0] == b""


@pytest.mark.parametrize(
    ("spell", "refused"),
    [
        (lambda h: f"sha256:{h}", False),
        (lambda h: f"sha256:{h.upper()}", False),
        (lambda h: f"sha256-{h}", False),
        (lambda h: f"sha256:{h}0", True),
        (lambda h: f"sha256:{h[1:]}", True),
        (lambda h: f"sha256:{h[:20]}\n{h[20:]}", True),
        (lambda h: f"SHA256:{h}", True),
    ],
    ids=["canonical", "uppercase", "dash", "long", "short", "line-break", "upper-algo"],
)
def test_gc_keeps_what_any_spelling_names_and_refuses_over_a_bad_one(
    tmp_path: Path, spell: Any, refused: bool
) -> None:
    tiny = TinyStore(tmp_path / "s")
    tiny.gguf_model("fine:1")
    weights = tiny.blob(b"weights named oddly")
    junk = tiny.blob(b"nobody names this")
    layers = [tiny.layer("template", b"t"), tiny.layer("model", b"weights named oddly")]
    layers[1]["digest"] = spell(weights.hex)
    tiny.legacy("odd:1", compact({"schemaVersion": 2, "layers": layers}))
    old = os.path.getmtime(tiny.layout.blob(junk)) - 7200
    for d in (weights, junk):
        os.utime(tiny.layout.blob(d), (old, old))
    plan = plan_gc(tiny.layout, GcPolicy())
    assert bool(plan.refused) is refused
    if refused:
        assert [p.path for p in plan.refused] == ["manifests/registry.ollama.ai/library/odd/1"], (
            plan.refused
        )
        assert plan.pending == []
    else:
        assert [i.digest for i in plan.pending] == [junk]
