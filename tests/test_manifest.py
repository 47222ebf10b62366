from __future__ import annotations

import json

import pytest

from modelfs.store.digest import Digest, is_blob_name
from modelfs.store.errors import InvalidDigestError, ManifestError
from modelfs.store.manifest import (
    MAX_MANIFEST_BYTES,
    MEDIA_LIST,
    MEDIA_MANIFEST,
    Manifest,
    ManifestList,
    go_marshal,
    infer_runner,
    parse_config,
    parse_manifest,
    parse_manifest_refs,
)

HEX = "ab" * 32


def test_digest_spellings() -> None:
    assert Digest.parse(f"sha256:{HEX}") == Digest.parse(f"sha256-{HEX.upper()}")
    assert Digest.parse(f"sha256:{HEX}").blob_name == f"sha256-{HEX}"
    assert str(Digest(HEX)) == f"sha256:{HEX}"
    assert is_blob_name(f"sha256-{HEX}")
    assert not is_blob_name(f"sha256-{HEX.upper()}")
    assert not is_blob_name(f"sha256:{HEX}")
    for bad in ("", "sha256:", f"sha512:{HEX}", f"sha256:{HEX}\n", f"sha256::{HEX}", HEX, "x" * 71):
        with pytest.raises(InvalidDigestError):
            Digest.parse(bad)


def _layer(kind: str = "model", size: int = 3, **kw: str) -> dict[str, object]:
    return {
        "mediaType": f"application/vnd.ollama.image.{kind}",
        "digest": f"sha256:{HEX}",
        "size": size,
        **kw,
    }


def test_manifest_bytes_are_kept_and_hashed() -> None:
    raw = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": _layer("x", 5),
            "layers": [_layer(), _layer("tensor", 7, name="a.w", **{"from": "m"})],
        },
        indent=3,
    ).encode()
    m = parse_manifest(raw, "m")
    assert isinstance(m, Manifest)
    assert m.raw == raw and m.digest == Digest.of_bytes(raw)
    assert m.size == 15
    assert m.layers[1].name == "a.w" and m.layers[1].from_ == "m" and m.layers[1].kind == "tensor"
    assert m.blob_digests() == [Digest(HEX)]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "empty file"),
        (b'{"schemaVersion":2,"layers":[', "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[]", "not a JSON object"),
        (b"{}", "'layers' is missing"),
        (b'{"layers":[{"mediaType":"x","digest":"sha256:zz","size":1}]}', "bad layer digest"),
        (
            b'{"layers":[{"mediaType":"x","digest":"sha256:' + HEX.encode() + b'","size":-1}]}',
            "bad size",
        ),
        (
            b'{"layers":[{"mediaType":"x","digest":"sha256:' + HEX.encode() + b'","size":true}]}',
            "bad size",
        ),
        (b'{"layers":[{"digest":"sha256:' + HEX.encode() + b'","size":1}]}', "missing 'mediaType'"),
        (b'{"layers":[], "config": 5}', "not an object"),
        (b"[" * 100000 + b"]" * 100000, ""),
        (
            json.dumps(
                {
                    "mediaType": MEDIA_LIST,
                    "manifests": [{"mediaType": MEDIA_LIST, "digest": f"sha256:{HEX}"}],
                }
            ).encode(),
            "nested",
        ),
        (json.dumps({"mediaType": MEDIA_LIST}).encode(), "no 'manifests'"),
    ],
)
def test_bad_manifests_name_the_file(raw: bytes, message: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(raw, "manifests/h/ns/m/t")
    assert str(info.value).startswith("manifests/h/ns/m/t: ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_oversized_manifest_refused() -> None:
    with pytest.raises(ManifestError, match="more than a manifest"):
        parse_manifest(b" " * (MAX_MANIFEST_BYTES + 1), "big")


def test_list_references_and_inline_children() -> None:
    inline = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": _layer("c", 1),
        "layers": [_layer()],
        "runner": "mlx",
        "format": "safetensors",
    }
    raw = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_LIST,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": f"sha256:{HEX}",
                    "runner": "llamacpp",
                    "format": "gguf",
                },
                inline,
            ],
        }
    ).encode()
    lst = parse_manifest(raw, "l")
    assert isinstance(lst, ManifestList)
    ref, inl = lst.children
    assert ref.digest == Digest(HEX) and ref.runner == "llamacpp" and ref.inline is None
    assert inl.inline is not None and inl.runner == "mlx"
    # Ollama names an inline child by the hash of Go's json.Marshal of it.
    assert inl.digest == Digest.of_bytes(go_marshal(inline))


def test_go_marshal_escapes_like_go() -> None:
    assert go_marshal({"t": "<a&b>"}) == b'{"t":"\\u003ca\\u0026b\\u003e"}'


def test_a_lone_surrogate_is_written_as_go_reads_it() -> None:
    """Go's decoder reads an unpaired `\\ud800` as U+FFFD (encoding/json decode.go,
    unquoteBytes) and its encoder writes that; a paired one is one character."""
    assert go_marshal({"t": "a\ud800b\udc00"}) == '{"t":"a\ufffdb\ufffd"}'.encode()
    assert go_marshal(json.loads('{"t":"\\ud83d\\ude00"}')) == '{"t":"\U0001f600"}'.encode()


def test_an_inline_child_with_a_lone_surrogate_parses() -> None:
    """A list whose inline child names a layer `"\\ud800"` is a list like any other (it
    raised UnicodeEncodeError, which no caller of the parser expects: GC stopped there)."""
    child = f'{{"mediaType":"{MEDIA_MANIFEST}",'
    child += f'"config":{{"mediaType":"c","digest":"sha256:{HEX}","size":1}},'
    child += f'"layers":[{{"mediaType":"m","digest":"sha256:{HEX}","size":1,"name":"\\ud800"}}]}}'
    raw = f'{{"mediaType":"{MEDIA_LIST}","manifests":[{child}]}}'.encode()
    for parsed in (parse_manifest(raw, "l"), parse_manifest_refs(raw, "l")):
        assert isinstance(parsed, ManifestList)
        (inl,) = parsed.children
        assert inl.inline is not None and inl.inline.layers[0].digest == Digest(HEX)
        go = f'{{"schemaVersion":0,{child[1:]}'.replace("\\ud800", "\ufffd").encode()
        assert inl.digest == Digest.of_bytes(go)


def test_config_and_runner_inference() -> None:
    cfg = parse_config(
        json.dumps(
            {"model_format": "safetensors", "model_families": ["a", 1], "context_length": True}
        ).encode(),
        "c",
    )
    assert cfg.model_families == ("a",) and cfg.context_length is None
    m = parse_manifest(json.dumps({"layers": [_layer("tensor", 1, name="w")]}).encode(), "m")
    assert isinstance(m, Manifest)
    assert infer_runner(m, None) == "mlx"
    g = parse_manifest(json.dumps({"layers": [_layer("model")]}).encode(), "m")
    assert isinstance(g, Manifest)
    assert infer_runner(g, None) == "ggml"
    with pytest.raises(ManifestError):
        parse_config(b"[1]", "c")
