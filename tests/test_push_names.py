"""Ollama names <-> OCI repositories (sync/wire/registry_names.py) and the manifest-list carrier
(modelfs/sync/wire/ocirepr.py), without a network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from modelfs.demo import GEMMA, DemoStore, build_demo_store
from modelfs.store.digest import Digest
from modelfs.store.errors import ManifestError
from modelfs.store.manifest import (
    MEDIA_LIST,
    MEDIA_MANIFEST,
    MEDIA_OCI_MANIFEST,
    Layer,
    ManifestList,
    parse_manifest,
)
from modelfs.store.names import DEFAULT_HOST, Name, parse_name
from modelfs.sync.wire.ocirepr import (
    MEDIA_CARRIER,
    child_manifests,
    decode_carrier,
    decode_list,
    encode_list,
    parse_carrier,
)
from modelfs.sync.wire.registry_names import (
    COMPONENT,
    MAX_REPOSITORY,
    RegistryNameError,
    name_for,
    reference_for,
    repository_for,
)
from tests.builders import TinyStore, compact

# The whole repository name, as the OCI distribution spec writes it.
OCI_REPOSITORY = re.compile(
    r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*"
)
OCI_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "repository", "tag"),
    [
        ("gemma4:26b", "library/gemma4", "26b"),
        ("llama3.2", "library/llama3.2", "latest"),
        ("ollama.com/library/qwen3:0.6b", "ollama.com/library/qwen3", "0.6b"),
        ("someuser/tiny:q8", "someuser/tiny", "q8"),
        (
            "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M",
            "hf.co/bartowski/smollm2-135m-instruct-gguf",
            "Q4_K_M",
        ),
        ("localhost:5000/me/m:1", "localhost__5000/me/m", "1"),
        ("127.0.0.1:11434/me/m:1", "127.0.0.1__11434/me/m", "1"),
        (
            "Registry.Example.COM/Team/Model_X:Tag-1.0",
            "registry.example.com/team/model_x",
            "Tag-1.0",
        ),
        ("ns/a__b--c.d:_t", "ns/a__b--c.d", "_t"),
    ],
)
def test_repository_examples(name: str, repository: str, tag: str) -> None:
    n = parse_name(name)
    assert reference_for(n) == (repository, tag)
    back = name_for(repository, tag)
    assert back.key == n.key


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("_private:1", "model '_private'"),
        ("_ns/m:1", "namespace '_ns'"),
        ("m-:1", "model 'm-'"),
        ("m.:1", "model 'm.'"),
        ("a..b:1", "model 'a..b'"),
        ("a._b:1", "model 'a._b'"),
        ("a___b:1", "model 'a___b'"),
        ("a-_b:1", "model 'a-_b'"),
        ("my__host/ns/m:1", "host 'my__host'"),
        ("host:/ns/m:1", "host 'host:'"),
        ("-host/ns/m:1", None),  # not even an Ollama name
    ],
)
def test_unpushable_names_are_refused_in_one_line(name: str, part: str | None) -> None:
    try:
        n = parse_name(name)
    except ValueError:
        assert part is None
        return
    with pytest.raises(RegistryNameError) as info:
        repository_for(n)
    message = str(info.value)
    assert "\n" not in message
    assert part is not None and part in message
    assert message.startswith(f"cannot push {n.shortest!r}")


def test_too_long_repository_is_refused() -> None:
    n = Name.from_parts("h" * 200 + ".example", "ns", "m" * 60, "t")
    with pytest.raises(RegistryNameError, match=f"more than the {MAX_REPOSITORY}"):
        repository_for(n)


@pytest.mark.parametrize(
    ("repository", "tag"),
    [
        ("gemma4", "26b"),  # one component
        ("a/b/c/d", "t"),  # four
        ("Library/gemma4", "t"),  # uppercase is no repository
        ("library/gemma4", "t/x"),
        ("library.x/gemma4", "t"),  # '.' in a namespace: not an Ollama name
        ("library/gemma4", ".t"),
    ],
)
def test_repositories_that_are_no_model(repository: str, tag: str) -> None:
    with pytest.raises(RegistryNameError):
        name_for(repository, tag)


def test_default_host_spelled_out_reads_as_default() -> None:
    assert name_for("registry.ollama.ai/library/gemma4", "26b").host == DEFAULT_HOST
    # `ollama.com` is a host of its own, as in Ollama's names.
    assert name_for("ollama.com/library/gemma4", "26b") == parse_name(
        "ollama.com/library/gemma4:26b"
    )


_host = st.one_of(
    st.sampled_from(["registry.ollama.ai", "ollama.com", "OLLAMA.com", "hf.co", "localhost:5000"]),
    st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,30}", fullmatch=True),
)
_namespace = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,20}", fullmatch=True)
_model = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
_names = st.builds(Name.from_parts, _host, _namespace, _model, _model)


@settings(max_examples=500)
@given(_names)
def test_every_name_maps_back_to_itself_or_is_refused(n: Name) -> None:
    try:
        repository, tag = reference_for(n)
    except RegistryNameError as exc:
        assert "\n" not in str(exc)
        parts = [n.namespace, n.model]
        host = n.host.lower()
        bad = any(COMPONENT.fullmatch(p.lower()) is None for p in parts)
        if not n.is_default_host:
            bad = bad or "__" in host or COMPONENT.fullmatch(host.replace(":", "__")) is None
        assert bad
        return
    assert OCI_REPOSITORY.fullmatch(repository)
    assert len(repository) <= MAX_REPOSITORY
    assert OCI_TAG.fullmatch(tag)
    back = name_for(repository, tag)
    assert back.key == n.key  # Ollama's identity: case-insensitive per part
    assert back.tag == n.tag  # tags keep their case
    if n.host == n.host.lower() and not n.is_default_host:
        assert (back.host, back.namespace.lower(), back.model.lower()) == (
            n.host,
            n.namespace.lower(),
            n.model.lower(),
        )


@settings(max_examples=300)
@given(_names, _names)
@example(
    Name.from_parts("0", "0", "00C00000", "0000C000000"),
    Name.from_parts("0", "0", "00C00000", "0000c000000"),
)
def test_different_models_get_different_references(a: Name, b: Name) -> None:
    """Two models Ollama tells apart never share a reference. One model named in two cases
    shares its repository (lower case, as OCI requires); its tag keeps the case it was
    given, since OCI tags are case-sensitive and a registry's tag is what the user typed."""
    try:
        (repo_a, tag_a), (repo_b, tag_b) = reference_for(a), reference_for(b)
    except RegistryNameError:
        return
    if a.key != b.key:
        assert (repo_a, tag_a) != (repo_b, tag_b)
    else:
        assert repo_a == repo_b
        assert tag_a.lower() == tag_b.lower()


_component = st.from_regex(r"[a-z0-9]{1,6}(?:(?:\.|_|__|-+)[a-z0-9]{1,6}){0,3}", fullmatch=True)


@settings(max_examples=500)
@given(st.lists(_component, min_size=2, max_size=3), st.from_regex(OCI_TAG, fullmatch=True))
def test_every_repository_that_is_a_model_maps_back_exactly(parts: list[str], tag: str) -> None:
    repository = "/".join(parts)
    assume(len(parts) == 2 or parts[0] not in ("ollama.com", "registry.ollama.ai"))
    try:
        n = name_for(repository, tag)
    except RegistryNameError:
        return  # e.g. a '.' in the namespace, or a tag longer than Ollama's 80
    assert reference_for(n) == (repository, tag)


# -- the carrier ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoStore:
    return build_demo_store(tmp_path_factory.mktemp("demo") / "models")


def test_carrier_of_the_demo_list(demo: DemoStore) -> None:
    the_list = demo.lists[GEMMA]
    children = [demo.manifest(f"{GEMMA}@{runner}").raw for runner, _, _ in the_list.children]
    raw = encode_list(the_list.raw, children)
    assert encode_list(the_list.raw, reversed(children)) == raw  # deterministic, list order

    obj = json.loads(raw)
    assert obj["mediaType"] == MEDIA_OCI_MANIFEST == MEDIA_CARRIER
    assert obj["config"] == {
        "mediaType": MEDIA_LIST,
        "digest": str(the_list.digest),
        "size": len(the_list.raw),
    }
    digests = [layer["digest"] for layer in obj["layers"]]
    assert len(digests) == len(set(digests))
    # The children first, in list order, as Docker v2 manifests; then every blob they use.
    assert digests[:2] == [str(d) for _, _, d in the_list.children]
    assert {layer["mediaType"] for layer in obj["layers"][:2]} == {MEDIA_MANIFEST}
    wanted = set()
    for runner, _, _ in the_list.children:
        m = demo.manifest(f"{GEMMA}@{runner}")
        wanted |= {str(m.config.digest)} | {str(layer.digest) for layer in m.layers}
    assert set(digests[2:]) == wanted

    carrier = parse_carrier(raw)
    assert carrier is not None
    assert carrier.list_ref == Layer(MEDIA_LIST, the_list.digest, len(the_list.raw))
    decoded = decode_list(carrier, the_list.raw)
    assert isinstance(decoded, ManifestList)
    assert decoded.raw == the_list.raw and decoded.digest == the_list.digest
    assert [c.digest for c in carrier.children_present(decoded)] == [
        d for _, _, d in the_list.children
    ]
    assert [layer.digest for layer in child_manifests(carrier, decoded)] == [
        d for _, _, d in the_list.children
    ]


def test_carrier_with_one_child(demo: DemoStore) -> None:
    the_list = demo.lists[GEMMA]
    mlx = demo.manifest(f"{GEMMA}@mlx")
    carrier = parse_carrier(encode_list(the_list.raw, [mlx.raw]))
    assert carrier is not None
    decoded = decode_list(carrier, the_list.raw)
    assert [c.runner for c in carrier.children_present(decoded)] == ["mlx"]
    digests = {layer.digest for layer in carrier.layers}
    assert demo.manifest(f"{GEMMA}@llamacpp").digest not in digests
    assert demo.manifest(f"{GEMMA}@llamacpp").layer("model.gguf").digest not in digests


def test_plain_manifests_are_not_carriers(demo: DemoStore) -> None:
    for m in [*demo.manifests.values(), *demo.anchors.values()]:
        assert parse_carrier(m.raw) is None, m.key
    for raw in (b"", b"null", b"[]", b"{", b"\xff\xfe", b'{"config":"x"}'):
        assert parse_carrier(raw) is None


def test_carrier_checks() -> None:
    list_raw = compact({"schemaVersion": 2, "mediaType": MEDIA_LIST, "manifests": []})
    carrier = parse_carrier(encode_list(list_raw, []))
    assert carrier is not None
    with pytest.raises(ManifestError, match="does not match"):
        decode_list(carrier, list_raw + b" ")
    with pytest.raises(ManifestError, match="does not match"):
        decode_list(carrier, list_raw.replace(b"2", b"3"))

    config = {"mediaType": MEDIA_LIST, "digest": str(Digest.of_bytes(b"x")), "size": 1}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json"}
    with pytest.raises(ManifestError, match="not an image manifest"):
        parse_carrier(json.dumps({**index, "config": config, "layers": []}).encode())
    with pytest.raises(ManifestError, match="layers"):
        parse_carrier(json.dumps({"mediaType": MEDIA_CARRIER, "config": config}).encode())
    with pytest.raises(ManifestError, match="bad digest"):
        parse_carrier(
            json.dumps(
                {"mediaType": MEDIA_CARRIER, "config": {**config, "digest": "md5:1"}, "layers": []}
            ).encode()
        )
    # No mediaType in the JSON: the response's Content-Type decides.
    bare = json.dumps({"schemaVersion": 2, "config": config, "layers": []}).encode()
    assert parse_carrier(bare, f"{MEDIA_CARRIER}; charset=utf-8") is not None

    # A config blob that is a plain manifest, not a list.
    plain = compact({"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "layers": []})
    fake = {
        "schemaVersion": 2,
        "mediaType": MEDIA_CARRIER,
        "config": {"mediaType": MEDIA_LIST, "digest": str(Digest.of_bytes(plain)), "size": 70},
        "layers": [],
    }
    fake["config"]["size"] = len(plain)
    c = parse_carrier(json.dumps(fake).encode())
    assert c is not None
    with pytest.raises(ManifestError, match="not a manifest list"):
        decode_list(c, plain)


def test_encode_refuses_strangers(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    a = tiny.manifest([tiny.layer("model", b"a")])
    b = tiny.manifest([tiny.layer("model", b"b")])
    list_raw = tiny.manifest_list([(a, "llamacpp", "gguf")])
    with pytest.raises(ManifestError, match="not a child"):
        encode_list(list_raw, [b])
    with pytest.raises(ManifestError, match="not an Ollama manifest list"):
        encode_list(a, [])
    with pytest.raises(ManifestError, match="itself a manifest list"):
        encode_list(list_raw, [list_raw])


def test_inline_children_ride_in_the_list(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path)
    inline = json.loads(tiny.manifest([tiny.layer("model", b"inline weights")]))
    inline.update(runner="llamacpp", format="gguf")
    ref = tiny.manifest([tiny.layer("tensor", b"t", name="w")], {"model_format": "safetensors"})
    list_raw = compact(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_LIST,
            "manifests": [
                inline,
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": str(tiny.blob(ref)),
                    "runner": "mlx",
                    "format": "safetensors",
                },
            ],
        }
    )
    carrier = parse_carrier(encode_list(list_raw, []))
    assert carrier is not None
    decoded = decode_list(carrier, list_raw)
    # The inline child's blobs are kept by the carrier; the absent referenced one is not named.
    digests = {str(layer.digest) for layer in carrier.layers}
    assert inline["layers"][0]["digest"] in digests
    assert str(Digest.of_bytes(ref)) not in digests
    present = carrier.children_present(decoded)
    assert [c.runner for c in present] == ["llamacpp"]
    parsed = parse_manifest(list_raw, "list")
    assert isinstance(parsed, ManifestList) and parsed.children[0].inline is not None


async def test_decode_carrier_fetches_the_list(demo: DemoStore) -> None:
    the_list = demo.lists[GEMMA]
    raw = encode_list(the_list.raw, [demo.manifest(f"{GEMMA}@llamacpp").raw])
    asked: list[Layer] = []

    async def fetch(ref: Layer) -> bytes:
        asked.append(ref)
        return demo.blob_path(ref.digest).read_bytes()

    decoded = await decode_carrier(raw, fetch)
    assert decoded is not None and decoded.raw == the_list.raw
    assert [r.digest for r in asked] == [the_list.digest]
    plain = demo.manifest("llama3.2:3b").raw
    assert await decode_carrier(plain, fetch) is None
    assert len(asked) == 1
