from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelfs.store.errors import InvalidNameError
from modelfs.store.layout import Layout
from modelfs.store.names import Name, name_from_path_parts, parse_name, parse_name_bare


@pytest.mark.parametrize(
    ("text", "full"),
    [
        ("gemma4", "registry.ollama.ai/library/gemma4:latest"),
        ("gemma4:26b", "registry.ollama.ai/library/gemma4:26b"),
        ("someuser/tiny:q8", "registry.ollama.ai/someuser/tiny:q8"),
        ("hf.co/bartowski/SmolLM2:Q4_K_M", "hf.co/bartowski/SmolLM2:Q4_K_M"),
        ("localhost:5000/ns/m:t", "localhost:5000/ns/m:t"),
        ("localhost:5000/ns/m", "localhost:5000/ns/m:latest"),
        ("https://example.com/ns/m:t", "example.com/ns/m:t"),
        ("ollama.com/library/qwen3:0.6b", "ollama.com/library/qwen3:0.6b"),
    ],
)
def test_parse_fills_defaults(text: str, full: str) -> None:
    assert parse_name(text).full == full


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "m:",
        ":t",
        "/m",
        "ns/",
        "a//m",
        "../m",
        "..",
        ".hidden",
        "m@sha256:abc",
        "ns/.m:t",
        "m:.t",
        "m:t/x",
        "m\n",
        "m:t\n",
        "h/ns/m:" + "t" * 81,
        "a/b/c/d:t",
        "bad host/ns/m:t",
        "m\\x:t",
    ],
)
def test_parse_rejects(text: str) -> None:
    with pytest.raises(InvalidNameError):
        parse_name(text)


def test_bare_split_like_ollama() -> None:
    assert parse_name_bare("h:1/ns/m:t") == ("h:1", "ns", "m", "t")
    assert parse_name_bare("m") == ("", "", "m", "")
    assert parse_name_bare("ns/m") == ("", "ns", "m", "")


@pytest.mark.parametrize(
    ("text", "shortest"),
    [
        ("gemma4:26b", "gemma4:26b"),
        ("gemma4", "gemma4:latest"),
        # A host of its own, as at ollama/ollama fb30760 (types/model/name.go:231-249).
        ("ollama.com/library/gemma4:26b", "ollama.com/library/gemma4:26b"),
        ("REGISTRY.OLLAMA.AI/Library/Gemma4:26B", "Gemma4:26B"),
        ("someuser/tiny:q8", "someuser/tiny:q8"),
        ("hf.co/bartowski/SmolLM2:Q4_K_M", "hf.co/bartowski/SmolLM2:Q4_K_M"),
    ],
)
def test_display_shortest(text: str, shortest: str) -> None:
    assert parse_name(text).shortest == shortest


def test_case_insensitive_key_and_host_folders() -> None:
    a = parse_name("Gemma4:26B")
    b = parse_name("registry.ollama.ai/library/gemma4:26b")
    assert a.key == b.key
    assert a != b  # spelling is kept
    # `ollama.com` is its own host in a name and under manifests/ (as Ollama at HEAD has it);
    # under manifests-v2/ its folder is the default registry's.
    c = parse_name("ollama.com/library/gemma4:26b")
    assert c.key != a.key
    assert Layout("/s").legacy_manifest(c) == Path("/s/manifests/ollama.com/library/gemma4/26b")
    assert name_from_path_parts(("ollama.com", "library", "gemma4", "26b"), v2=True) == b
    assert name_from_path_parts(("ollama.com", "library", "gemma4", "26b"), v2=False) == c


def test_paths_for_both_layouts() -> None:
    layout = Layout("/s")
    n = parse_name("localhost:5000/ns/m:t")
    assert layout.legacy_manifest(n) == Path("/s/manifests/localhost:5000/ns/m/t")
    assert layout.v2_manifest(n) == Path("/s/manifests-v2/localhost%3A5000/ns/m/t")
    d = parse_name("gemma4:26b")
    assert layout.legacy_manifest(d) == Path("/s/manifests/registry.ollama.ai/library/gemma4/26b")
    assert layout.v2_manifest(d) == Path("/s/manifests-v2/ollama.com/library/gemma4/26b")
    assert name_from_path_parts(("localhost%3A5000", "ns", "m", "t"), v2=True) == n


@pytest.mark.parametrize(
    "parts",
    [
        ("a", "b", "c"),
        ("a", "b", "c", "d", "e"),
        ("a", "b", "..", "d"),
        ("a", "b", "c", ".DS_Store"),
    ],
)
def test_path_parts_rejected(parts: tuple[str, ...]) -> None:
    with pytest.raises(InvalidNameError):
        name_from_path_parts(parts, v2=False)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab./\\:-_@%~ \x00A0")), max_size=24))
def test_no_accepted_name_leaves_the_store(text: str) -> None:
    try:
        name = parse_name(text)
    except InvalidNameError:
        return
    root = Path("/store").resolve()
    layout = Layout(root)
    for path in (layout.legacy_manifest(name), layout.v2_manifest(name)):
        resolved = Path(*path.parts).resolve()  # lexical: the dirs need not exist
        assert resolved.is_relative_to(layout.manifests) or resolved.is_relative_to(
            layout.manifests_v2
        )
        assert len(resolved.relative_to(root).parts) == 5
    for part in (name.host, name.namespace, name.model, name.tag):
        assert part not in (".", "..") and "/" not in part and "\\" not in part


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_parse_never_crashes(text: str) -> None:
    try:
        name = parse_name(text)
    except InvalidNameError:
        return
    assert isinstance(name, Name)
    assert parse_name(name.full) == name
