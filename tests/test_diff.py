"""`modelfs diff`: a pair of versions built in the test for each kind of change, the default
other side from the tag history, digest prefixes, `--json`, and the errors.

GGUF blobs are real files from the reference writer (tests/builders.py gguf_bytes) with chosen
tensors' data overwritten; safetensors blobs come from the safetensors package.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from modelfs.cli.app import run
from modelfs.store.digest import Digest
from modelfs.store.formats.gguf import read_gguf_header
from modelfs.store.history import TagHistory
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from tests.builders import TinyStore, gguf_bytes
from tests.test_cli import assert_one_error, modelfs

T0 = 1_700_000_000.0

TENSORS = [
    ("token_embd.weight", (4, 256), "Q4_K"),
    ("blk.0.attn_q.weight", (2, 256), "Q4_K"),
    ("blk.0.attn_k.weight", (2, 256), "Q6_K"),
    ("blk.0.ffn_down.weight", (64, 512), "F32"),  # 128 KiB: compared by windows
    ("output_norm.weight", (64,), "F32"),
]
Q8 = [(name, shape, "Q8_0" if t != "F32" else t) for name, shape, t in TENSORS]


@pytest.fixture
def tiny(tmp_path: Path) -> TinyStore:
    return TinyStore(tmp_path / "models")


@pytest.fixture
def work(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


def overwrite(gguf: bytes, names: list[str], fill: int = 1) -> bytes:
    """The GGUF with every byte of the named tensors' data set to `fill`."""
    header = read_gguf_header(io.BytesIO(gguf), "test", len(gguf))
    data = bytearray(gguf)
    for t in header.tensors:
        if t.name in names:
            data[t.offset : t.offset + t.nbytes] = bytes([fill]) * t.nbytes
    return bytes(data)


def gguf_manifest(
    tiny: TinyStore,
    weights: bytes,
    *,
    template: bytes = b"{{ .Prompt }}",
    license_: bytes = b"MIT",
    file_type: str = "Q4_K_M",
    extra: list[dict[str, Any]] | None = None,
) -> bytes:
    return tiny.manifest(
        [
            tiny.layer("model", weights),
            tiny.layer("template", template),
            tiny.layer("license", license_),
            *(extra or []),
        ],
        {
            "model_format": "gguf",
            "model_family": "llama",
            "model_type": "1B",
            "file_type": file_type,
        },
    )


def tensor_blob(value: float, quant: str | None = None, shape: tuple[int, ...] = (4, 8)) -> bytes:
    arr = np.full(shape, value, dtype=np.float16)
    meta = {"quant_type": quant, "group_size": "32"} if quant else None
    return safetensors.numpy.save({"w": arr}, metadata=meta)


def mlx_manifest(tiny: TinyStore, blobs: list[bytes], names: list[str] | None = None) -> bytes:
    names = names or [f"model.layers.{i}.weight" for i in range(len(blobs))]
    return tiny.manifest(
        [tiny.layer("tensor", b, name=n) for b, n in zip(blobs, names, strict=True)]
        + [tiny.layer("json", b'{"architectures":["Gemma"]}', name="config.json")],
        {"model_format": "safetensors", "model_family": "gemma4", "file_type": "int4"},
    )


def diff_json(capsys: pytest.CaptureFixture[str], tiny: TinyStore, *refs: str) -> dict[str, Any]:
    code = run(["diff", "--json", "--store", str(tiny.root), *refs])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def pair(tiny: TinyStore, a: bytes, b: bytes) -> tuple[str, str]:
    tiny.legacy("model:a", a)
    tiny.legacy("model:b", b)
    return "model:a", "model:b"


# -- each kind of change ---------------------------------------------------------------------
def test_identical(tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = gguf_manifest(tiny, gguf_bytes(TENSORS, workdir=work))
    record = diff_json(capsys, tiny, *pair(tiny, raw, raw))
    assert record["kind"] == "identical"
    assert record["blobs"]["only_a"] == record["blobs"]["only_b"] == []
    assert len(record["blobs"]["shared"]) == 4  # config, model, template, license


def test_only_accessories(tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = gguf_bytes(TENSORS, workdir=work)
    a = gguf_manifest(tiny, weights, template=b"{{ .System }} {{ .Prompt }}", license_=b"Apache")
    b = gguf_manifest(tiny, weights)
    record = diff_json(capsys, tiny, *pair(tiny, a, b))
    assert record["kind"] == "only accessories", record["reason"]
    assert sorted(r["kind"] for r in record["blobs"]["only_a"]) == ["license", "template"]
    assert [r["kind"] for r in record["blobs"]["shared"]] == ["config", "model"]
    assert record["bytes"]["only_a"] == len(b"{{ .System }} {{ .Prompt }}") + len(b"Apache")


def test_new_packaging_list(
    tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = gguf_manifest(tiny, gguf_bytes(TENSORS, workdir=work))
    tiny.legacy("model:b", plain)
    mlx = mlx_manifest(tiny, [tensor_blob(1.0)])
    tiny.v2(
        "model:a", tiny.manifest_list([(plain, "llamacpp", "gguf"), (mlx, "mlx", "safetensors")])
    )
    record = diff_json(capsys, tiny, "model:a", "model:b")
    assert record["kind"] == "new packaging"
    assert "list" in record["reason"]
    assert record["a"]["list"] is True and record["b"]["list"] is False
    assert record["a"]["runner"] == "llamacpp"
    # --prefer mlx compares the other child: other weights altogether
    code = run(
        ["diff", "--json", "--prefer", "mlx", "--store", str(tiny.root), "model:a", "model:b"]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    assert json.loads(out)["kind"] == "new weights"


def test_new_packaging_renamed_tensor(tiny: TinyStore, capsys: pytest.CaptureFixture[str]) -> None:
    blobs = [tensor_blob(1.0), tensor_blob(2.0)]
    a = mlx_manifest(tiny, blobs, ["model.embed.weight", "model.norm.weight"])
    b = mlx_manifest(tiny, blobs, ["model.embed_tokens.weight", "model.norm.weight"])
    record = diff_json(capsys, tiny, *pair(tiny, a, b))
    assert record["kind"] == "new packaging"
    assert "named" in record["reason"]


def test_new_packaging_config(
    tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = gguf_bytes(TENSORS, workdir=work)
    a = gguf_manifest(tiny, weights, file_type="Q4_K_S")
    b = gguf_manifest(tiny, weights)
    record = diff_json(capsys, tiny, *pair(tiny, a, b))
    assert record["kind"] == "new packaging"
    assert "file_type" in record["reason"]


def test_different_quantization_gguf(
    tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = gguf_manifest(tiny, gguf_bytes(Q8, file_type=7, workdir=work), file_type="Q8_0")
    b = gguf_manifest(tiny, gguf_bytes(TENSORS, workdir=work))
    record = diff_json(capsys, tiny, *pair(tiny, a, b))
    assert record["kind"] == "different quantization", record["reason"]
    assert {q["type"]: q["count"] for q in record["a"]["quantization"]} == {"Q8_0": 3, "F32": 2}
    assert {q["type"]: q["count"] for q in record["b"]["quantization"]} == {
        "Q4_K": 2,
        "Q6_K": 1,
        "F32": 2,
    }
    assert (record["a"]["file_type"], record["b"]["file_type"]) == ("Q8_0", "Q4_K_M")
    assert [r["kind"] for r in record["blobs"]["only_a"]] == ["config", "model"]


def test_different_quantization_safetensors(
    tiny: TinyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    a = mlx_manifest(tiny, [tensor_blob(1.0, "int8"), tensor_blob(2.0, "int8")])
    b = mlx_manifest(tiny, [tensor_blob(1.0, "int4"), tensor_blob(2.0, "int4")])
    record = diff_json(capsys, tiny, *pair(tiny, a, b))
    assert record["kind"] == "different quantization"
    assert [q["type"] for q in record["a"]["quantization"]] == ["int8"]


def test_fixed_conversion_gguf(
    tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = gguf_bytes(TENSORS, workdir=work)
    fixed = overwrite(base, ["blk.0.attn_q.weight", "blk.0.attn_k.weight"])
    record = diff_json(
        capsys, tiny, *pair(tiny, gguf_manifest(tiny, fixed), gguf_manifest(tiny, base))
    )
    assert record["kind"] == "fixed conversion", record["reason"]
    assert record["tensors"] == {"total": 5, "changed": 2}


def test_new_weights_same_layout(
    tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fine-tune of the same architecture: every tensor's data differs, the big tensor
    only far from its start (found by a window, not by its first bytes)."""
    base = gguf_bytes(TENSORS, workdir=work)
    header = read_gguf_header(io.BytesIO(base), "t", len(base))
    retrained = bytearray(
        overwrite(base, [n for n, _, _ in TENSORS if n != "blk.0.ffn_down.weight"])
    )
    big = next(t for t in header.tensors if t.name == "blk.0.ffn_down.weight")
    end = big.offset + big.nbytes
    retrained[end - 4096 : end] = b"\x07" * 4096
    a, b = gguf_manifest(tiny, bytes(retrained)), gguf_manifest(tiny, base)
    record = diff_json(capsys, tiny, *pair(tiny, a, b))
    assert record["kind"] == "new weights", record["reason"]
    assert record["tensors"] == {"total": 5, "changed": 5}


def test_fixed_conversion_safetensors(tiny: TinyStore, capsys: pytest.CaptureFixture[str]) -> None:
    blobs = [tensor_blob(float(i)) for i in range(4)]
    fixed = [*blobs[:3], tensor_blob(9.0)]
    record = diff_json(
        capsys, tiny, *pair(tiny, mlx_manifest(tiny, fixed), mlx_manifest(tiny, blobs))
    )
    assert record["kind"] == "fixed conversion", record["reason"]
    assert record["tensors"] == {"total": 4, "changed": 1}
    assert len([r for r in record["blobs"]["shared"] if r["kind"] == "tensor"]) == 3


def test_new_weights_safetensors_majority(
    tiny: TinyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    blobs = [tensor_blob(float(i)) for i in range(4)]
    newer = [tensor_blob(float(i) + 10) for i in range(3)] + blobs[3:]
    record = diff_json(
        capsys, tiny, *pair(tiny, mlx_manifest(tiny, newer), mlx_manifest(tiny, blobs))
    )
    assert record["kind"] == "new weights"
    assert record["tensors"] == {"total": 4, "changed": 3}


def test_new_weights_other_tensors(
    tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = gguf_bytes([*TENSORS, ("blk.1.attn_q.weight", (2, 256), "Q4_K")], workdir=work)
    a, b = gguf_manifest(tiny, other), gguf_manifest(tiny, gguf_bytes(TENSORS, workdir=work))
    record = diff_json(capsys, tiny, *pair(tiny, a, b))
    assert record["kind"] == "new weights"


# -- the other side from history, digests, output, errors -------------------------------------
def observe(tiny: TinyStore, now: float) -> None:
    TagHistory(tiny.layout).observe(scan_store(tiny.layout), now)


def test_default_b_from_history_as_a_process(tiny: TinyStore, work: Path) -> None:
    v1 = gguf_manifest(tiny, gguf_bytes(TENSORS, workdir=work))
    tiny.legacy("llama3.2:1b", v1)
    observe(tiny, T0)
    v2 = gguf_manifest(tiny, gguf_bytes(Q8, file_type=7, workdir=work), file_type="Q8_0")
    tiny.legacy("llama3.2:1b", v2)
    observe(tiny, T0 + 60)

    r = modelfs("diff", "-q", "--store", str(tiny.root), "llama3.2:1b")
    assert r.returncode == 0, r.stderr
    assert "Change: different quantization" in r.stdout
    assert Digest.of_bytes(v1).hex[:12] in r.stdout and "(history)" in r.stdout
    assert "Q8_0" in r.stdout and "Q4_K" in r.stdout

    # Ollama's re-pull pruned v1's blobs: still a diff, decided from the saved manifest and config
    for layer in json.loads(v1)["layers"]:
        if layer["mediaType"].endswith(".model"):
            tiny.layout.blob(Digest.parse(layer["digest"])).unlink()
    tiny.layout.blob(Digest.parse(json.loads(v1)["config"]["digest"])).unlink()
    r = modelfs("diff", "--json", "--store", str(tiny.root), "llama3.2:1b")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["kind"] == "different quantization"
    assert record["b"]["quantization"] is None and record["b"]["file_type"] == "Q4_K_M"
    assert any("not all present" in n for n in record["notes"])
    assert [b["present"] for b in record["blobs"]["only_b"] if b["kind"] == "model"] == [False]


def test_default_b_when_tag_moved_unobserved(
    tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = gguf_bytes(TENSORS, workdir=work)
    tiny.legacy("llama3.2:1b", gguf_manifest(tiny, weights))
    observe(tiny, T0)
    tiny.legacy("llama3.2:1b", gguf_manifest(tiny, weights, template=b"new template"))
    record = diff_json(capsys, tiny, "llama3.2:1b")
    assert record["kind"] == "only accessories"
    assert record["b"]["source"] == "history"


def test_digest_prefixes(tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = gguf_bytes(TENSORS, workdir=work)
    v1 = gguf_manifest(tiny, weights)
    tiny.legacy("llama3.2:1b", v1)
    observe(tiny, T0)
    v2 = gguf_manifest(tiny, overwrite(weights, ["output_norm.weight"]))
    tiny.v2("llama3.2:1b", v2)  # v2 hides legacy; v1 survives only in the history
    os.unlink(tiny.layout.legacy_manifest(parse_name("llama3.2:1b")))
    observe(tiny, T0 + 1)
    d1, d2 = Digest.of_bytes(v1), Digest.of_bytes(v2)
    assert not tiny.layout.blob(d1).exists()

    record = diff_json(capsys, tiny, d2.hex[:12], d1.hex[:12].upper())
    assert (record["a"]["source"], record["b"]["source"]) == ("tag", "history")
    assert record["a"]["name"] == "llama3.2:1b"
    assert record["kind"] == "fixed conversion"
    record = diff_json(capsys, tiny, str(d2), "sha256-" + d1.hex)
    assert record["b"]["digest"] == str(d1)
    # a digest with no name: B from the history record that replaced it
    record = diff_json(capsys, tiny, "sha256:" + d2.hex[:20])
    assert record["b"]["digest"] == str(d1)
    # a manifest blob no tag names any more, against the tag that replaced it
    v3 = gguf_manifest(tiny, weights, license_=b"new license")
    tiny.v2("llama3.2:1b", v3)
    record = diff_json(capsys, tiny, d2.hex[:16], "llama3.2:1b")
    assert record["a"]["digest"] == str(d2) and record["a"]["name"] is None
    assert record["kind"] == "fixed conversion"
    # no such digest, and a prefix that is no digest nor name
    code = run(["diff", "-q", "--store", str(tiny.root), "0123456789ab"])
    assert code == 1
    assert "no model or manifest '0123456789ab'" in capsys.readouterr().err


def test_json_shape(tiny: TinyStore, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = gguf_bytes(TENSORS, workdir=work)
    record = diff_json(
        capsys,
        tiny,
        *pair(tiny, gguf_manifest(tiny, weights, license_=b"X"), gguf_manifest(tiny, weights)),
    )
    assert list(record) == ["kind", "reason", "a", "b", "blobs", "bytes", "tensors", "notes"]
    assert list(record["a"]) == [
        "ref",
        "name",
        "source",
        "digest",
        "list",
        "manifest",
        "runner",
        "format",
        "size",
        "file_type",
        "quantization",
    ]
    assert list(record["blobs"]) == ["shared", "only_a", "only_b"]
    row = record["blobs"]["only_a"][0]
    assert list(row) == ["digest", "kind", "media_type", "size", "present"]
    assert row["media_type"] == "application/vnd.ollama.image.license"
    assert record["bytes"] == {"shared": record["bytes"]["shared"], "only_a": 1, "only_b": 3}
    assert record["a"]["ref"] == "model:a" and record["a"]["name"] == "model:a"


def test_errors_are_one_line(tiny: TinyStore, work: Path) -> None:
    tiny.legacy("llama3.2:1b", gguf_manifest(tiny, gguf_bytes(TENSORS, workdir=work)))
    r = modelfs("diff", "-q", "--store", str(tiny.root), "nosuch:model")
    assert r.returncode == 1
    assert_one_error(r.stderr, "nosuch:model", "not found")

    r = modelfs("diff", "-q", "--store", str(tiny.root), "llama3.2:1b")
    assert r.returncode == 1
    assert_one_error(r.stderr, "no previous version of llama3.2:1b")

    r = modelfs("diff", "-q", "--store", str(tiny.root), "sha256:" + "ab" * 32)
    assert r.returncode == 1
    assert_one_error(r.stderr, "no manifest sha256:" + "ab" * 32)

    r = modelfs("diff", "-q", "--store", str(tiny.root), "llama3.2:1b", "sha256:abc")
    assert r.returncode == 1
    assert_one_error(r.stderr, "invalid digest")
