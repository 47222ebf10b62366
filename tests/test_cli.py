"""`modelfs ls`, `modelfs show` and store discovery, end to end.

Stores are built in each test with tests/builders.py. The CLI runs in-process
(`modelfs.cli.run`) for most checks, and as a real process (the `modelfs` console script) where
exit codes, stderr, the environment and the time zone matter.

Expected sizes, durations and timestamps below were printed by Ollama's own Go code
(format.HumanBytes and humanDuration of ollama/ollama fb30760, and Go's
`time.Format(time.RFC3339Nano)` under each TZ) and are written out as literals.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from modelfs.cli.app import run
from modelfs.cli.human import human_time, rfc3339_nano
from modelfs.store.digest import Digest
from modelfs.store.layout import SYSTEM_STORE
from modelfs.store.manifest import MEDIA_CONFIG, MEDIA_MANIFEST
from modelfs.store.units import human_bytes
from tests.builders import LAYER, TinyStore, compact, gguf_bytes

REPO = Path(__file__).resolve().parent.parent
MODELFS = shutil.which("modelfs", path=str(Path(sys.executable).parent))

T0 = 1_700_000_000  # 2023-11-14T22:13:20Z
S = 1_000_000_000

TAGS_KEYS = ["name", "model", "modified_at", "size", "digest", "details"]
DETAILS_KEYS = [
    "parent_model",
    "format",
    "family",
    "families",
    "parameter_size",
    "quantization_level",
]


# -- harness ---------------------------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path: Path) -> TinyStore:
    return TinyStore(tmp_path / "models")


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No store from the machine leaks in: an empty HOME, no $OLLAMA_MODELS; the root
    logger is given back as it was (run() installs its stderr handler there)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def tz(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Switch this process's local time zone; the original one is restored afterwards."""

    def switch(name: str) -> None:
        if not Path("/usr/share/zoneinfo", name).exists() and name != "UTC":
            pytest.skip(f"no tzdata for {name}")
        monkeypatch.setenv("TZ", name)
        time.tzset()

    yield switch
    monkeypatch.undo()
    time.tzset()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def modelfs(
    *argv: str, env: dict[str, str] | None = None, home: Path | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """The installed console script as a child process, in a clean environment."""
    drop = ("OLLAMA_MODELS", "TZ", "PYTHONUNBUFFERED")  # a buffered stdout, as in a shell
    base = {k: v for k, v in os.environ.items() if k not in drop}
    if home is not None:
        base["HOME"] = str(home)
    base.update(env or {})
    cmd = [MODELFS] if MODELFS else [sys.executable, "-c", "from modelfs.cli import main; main()"]
    if "stdout" not in kw and "stderr" not in kw:
        kw["capture_output"] = True
    return subprocess.run(
        [*cmd, *argv], env=base, cwd=REPO, text=True, timeout=60, check=False, **kw
    )


def assert_one_error(err: str, *needles: str) -> str:
    """stderr is exactly one line, `modelfs: error: …`, naming each needle; no traceback."""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("modelfs: error: "), err
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_size(raw: bytes) -> int:
    obj = json.loads(raw)
    return sum(layer["size"] for layer in obj["layers"]) + obj["config"]["size"]


# -- a store with one of everything ----------------------------------------------------------


def build_zoo(tiny: TinyStore) -> dict[str, Any]:
    """Four models on both layouts, three namespaces and two hosts; mtimes with ns fractions.

    Returns the raw manifest bytes by role, to compare digests and sizes against.
    """
    template = tiny.layer("template", b"{{ .Prompt }}")
    license_ = tiny.layer("license", b"MIT License\n")
    llama = tiny.manifest(
        [tiny.layer("model", b"llama weights " * 20), template, license_],
        {
            "model_format": "gguf",
            "model_family": "llama",
            "model_type": "3.2B",
            "file_type": "Q4_K_M",
        },
    )
    tiny.legacy("llama3.2:3b", llama, mtime_ns=(T0 + 300) * S + 123_456_789)

    user = tiny.manifest(
        [tiny.layer("model", b"user weights"), tiny.layer("projector", b"clip"), license_],
        {
            "model_format": "gguf",
            "model_family": "llama",
            "model_families": ["llama", "clip"],
            "model_type": "8B",
            "file_type": "Q8_0",
        },
    )
    tiny.legacy("someuser/tiny:q8", user, mtime_ns=(T0 + 200) * S + 100)

    hf = tiny.manifest([tiny.layer("model", b"hf weights"), template], {"model_format": "gguf"})
    tiny.legacy("hf.co/bartowski/SmolLM2:Q4_K_M", hf, mtime_ns=(T0 + 100) * S)

    gguf_child = tiny.manifest(
        [tiny.layer("model", b"gemma gguf weights"), template, license_],
        {
            "model_format": "gguf",
            "model_family": "gemma4",
            "model_type": "25.8B",
            "file_type": "Q4_K_M",
        },
        runner="llamacpp",
        format="gguf",
    )
    mlx_child = tiny.manifest(
        [
            tiny.layer("tensor", b"t0" * 50, name="model.embed.weight"),
            tiny.layer("tensor", b"t1" * 70, name="model.norm.weight"),
            tiny.layer("json", b"{}", name="config.json"),
            license_,
        ],
        {
            "model_format": "safetensors",
            "model_family": "gemma4",
            "model_families": ["gemma4"],
            "model_type": "25.8B",
            "file_type": "int4",
        },
    )
    lst = tiny.manifest_list([(gguf_child, "llamacpp", "gguf"), (mlx_child, "mlx", "safetensors")])
    tiny.v2("gemma4:26b", lst, mtime_ns=(T0 + 400) * S + 120_000_000)
    return {
        "llama": llama,
        "user": user,
        "hf": hf,
        "gguf": gguf_child,
        "mlx": mlx_child,
        "list": lst,
    }


EXPECTED_UTC = {
    "gemma4:26b": "2023-11-14T22:20:00.12Z",
    "llama3.2:3b": "2023-11-14T22:18:20.123456789Z",
    "someuser/tiny:q8": "2023-11-14T22:16:40.0000001Z",
    "hf.co/bartowski/SmolLM2:Q4_K_M": "2023-11-14T22:15:00Z",
}
EXPECTED_LA = {
    "gemma4:26b": "2023-11-14T14:20:00.12-08:00",
    "llama3.2:3b": "2023-11-14T14:18:20.123456789-08:00",
    "someuser/tiny:q8": "2023-11-14T14:16:40.0000001-08:00",
    "hf.co/bartowski/SmolLM2:Q4_K_M": "2023-11-14T14:15:00-08:00",
}


# -- ls --json -------------------------------------------------------------------------------


def test_ls_json_is_ollamas_api_tags(
    tiny: TinyStore, capsys: pytest.CaptureFixture[str], tz: Any
) -> None:
    raws = build_zoo(tiny)
    tz("UTC")
    code, out, err = cli(capsys, "ls", "--json", "--store", str(tiny.root))
    assert code == 0
    assert f"modelfs: store: {tiny.root} (--store)" in err.splitlines()
    doc = json.loads(out)
    # Go's json.Marshal: compact, one document, and our newline.
    assert out == json.dumps(doc, separators=(",", ":"), ensure_ascii=False) + "\n"
    assert list(doc) == ["models"]
    models = doc["models"]
    for m in models:
        # `capabilities` is omitempty; the projector of someuser/tiny makes it "vision".
        assert list(m) == TAGS_KEYS + (["capabilities"] if m["name"] == "someuser/tiny:q8" else [])
        assert list(m["details"]) == DETAILS_KEYS
        assert isinstance(m["size"], int) and not isinstance(m["size"], bool)
        for key in ("name", "model", "modified_at", "digest"):
            assert isinstance(m[key], str)
        for key in DETAILS_KEYS:
            if key != "families":
                assert isinstance(m["details"][key], str)
        assert m["name"] == m["model"]
        assert len(m["digest"]) == 64 and int(m["digest"], 16) >= 0
    by_name = {m["name"]: m for m in models}
    # Newest first.
    assert [m["name"] for m in models] == list(EXPECTED_UTC)
    assert {n: m["modified_at"] for n, m in by_name.items()} == EXPECTED_UTC

    # digest = sha256 of the manifest bytes; for a list, of the preferred child's bytes.
    for name, role in (
        ("llama3.2:3b", "llama"),
        ("someuser/tiny:q8", "user"),
        ("hf.co/bartowski/SmolLM2:Q4_K_M", "hf"),
        ("gemma4:26b", "gguf"),
    ):
        assert by_name[name]["digest"] == sha256_hex(raws[role])
        assert by_name[name]["size"] == manifest_size(raws[role])
    assert by_name["gemma4:26b"]["digest"] != sha256_hex(raws["list"])

    assert by_name["llama3.2:3b"]["details"] == {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": None,
        "parameter_size": "3.2B",
        "quantization_level": "Q4_K_M",
    }
    assert by_name["someuser/tiny:q8"]["details"]["families"] == ["llama", "clip"]
    assert by_name["hf.co/bartowski/SmolLM2:Q4_K_M"]["details"] == {
        "parent_model": "",
        "format": "gguf",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }
    assert by_name["gemma4:26b"]["details"]["format"] == "gguf"


def test_ls_json_prefer_picks_the_list_child(
    tiny: TinyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    raws = build_zoo(tiny)
    code, out, _ = cli(
        capsys, "ls", "--json", "--store", str(tiny.root), "--prefer", "mlx,llamacpp"
    )
    assert code == 0
    gemma = next(m for m in json.loads(out)["models"] if m["name"] == "gemma4:26b")
    assert gemma["digest"] == sha256_hex(raws["mlx"])
    assert gemma["size"] == manifest_size(raws["mlx"])
    assert gemma["details"]["format"] == "safetensors"
    assert gemma["details"]["quantization_level"] == "int4"
    assert gemma["details"]["families"] == ["gemma4"]
    # A runner that no child has falls back to a present one, in list order.
    code, out, _ = cli(capsys, "ls", "--json", "--store", str(tiny.root), "--prefer", "ggml")
    gemma = next(m for m in json.loads(out)["models"] if m["name"] == "gemma4:26b")
    assert gemma["digest"] == sha256_hex(raws["gguf"])


def test_ls_json_modified_at_in_local_time(
    tiny: TinyStore, capsys: pytest.CaptureFixture[str], tz: Any
) -> None:
    build_zoo(tiny)
    tz("America/Los_Angeles")
    code, out, _ = cli(capsys, "ls", "--json", "--store", str(tiny.root))
    assert code == 0
    assert {m["name"]: m["modified_at"] for m in json.loads(out)["models"]} == EXPECTED_LA


@pytest.mark.parametrize(
    ("zone", "expected"), [("UTC", EXPECTED_UTC), ("America/Los_Angeles", EXPECTED_LA)]
)
def test_ls_json_subprocess_time_zones(
    tiny: TinyStore, zone: str, expected: dict[str, str]
) -> None:
    if zone != "UTC" and not Path("/usr/share/zoneinfo", zone).exists():
        pytest.skip(f"no tzdata for {zone}")
    build_zoo(tiny)
    proc = modelfs("ls", "--json", "--store", str(tiny.root), env={"TZ": zone})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"modelfs: store: {tiny.root} (--store)\n"
    models = json.loads(proc.stdout)["models"]
    assert [(m["name"], m["modified_at"]) for m in models] == list(expected.items())


# Printed by Go 1.19: time.Unix(sec, nsec).Format(time.RFC3339Nano) under each TZ.
RFC3339_CASES = [
    ((T0, 0), "2023-11-14T22:13:20Z", "2023-11-14T14:13:20-08:00", "2023-11-15T03:43:20+05:30"),
    (
        (T0, 120_000_000),
        "2023-11-14T22:13:20.12Z",
        "2023-11-14T14:13:20.12-08:00",
        "2023-11-15T03:43:20.12+05:30",
    ),
    (
        (T0, 123_456_789),
        "2023-11-14T22:13:20.123456789Z",
        "2023-11-14T14:13:20.123456789-08:00",
        "2023-11-15T03:43:20.123456789+05:30",
    ),
    (
        (T0, 100),
        "2023-11-14T22:13:20.0000001Z",
        "2023-11-14T14:13:20.0000001-08:00",
        "2023-11-15T03:43:20.0000001+05:30",
    ),
    (  # an hour after the spring-forward in Los Angeles
        (1_710_064_800, 500),
        "2024-03-10T10:00:00.0000005Z",
        "2024-03-10T03:00:00.0000005-07:00",
        "2024-03-10T15:30:00.0000005+05:30",
    ),
    (  # local mean time: Go cuts an offset with seconds (-7:52:58) to minutes
        (-3_000_000_000, 0),
        "1874-12-07T18:40:00Z",
        "1874-12-07T10:47:02-07:52",
        "1874-12-08T00:01:10+05:21",
    ),
    (
        (-1, 999_999_999),
        "1969-12-31T23:59:59.999999999Z",
        "1969-12-31T15:59:59.999999999-08:00",
        "1970-01-01T05:29:59.999999999+05:30",
    ),
]


@pytest.mark.parametrize("zone", ["UTC", "America/Los_Angeles", "Asia/Kolkata"])
def test_rfc3339_nano_matches_go(zone: str, tz: Any) -> None:
    tz(zone)
    column = {"UTC": 1, "America/Los_Angeles": 2, "Asia/Kolkata": 3}[zone]
    for case in RFC3339_CASES:
        (sec, nsec) = case[0]
        assert rfc3339_nano(sec * S + nsec) == case[column], case


def test_rfc3339_nano_zero_offset_is_z_even_outside_utc(tz: Any) -> None:
    # Go prints Z for any zero offset, e.g. London in winter; +01:00 in British Standard Time.
    tz("Europe/London")
    assert rfc3339_nano(T0 * S) == "2023-11-14T22:13:20Z"
    assert rfc3339_nano(-1) == "1970-01-01T00:59:59.999999999+01:00"


# -- the table -------------------------------------------------------------------------------

# format.HumanBytes, as printed by Ollama's Go code.
HUMAN_BYTES = [
    (-5, "-5 B"),
    (0, "0 B"),
    (999, "999 B"),
    (1000, "1 KB"),
    (1049, "1.0 KB"),
    (1050, "1.1 KB"),
    (1950, "1.9 KB"),
    (1951, "2.0 KB"),
    (9950, "9.9 KB"),
    (9951, "10.0 KB"),
    (9999, "10.0 KB"),
    (10000, "10 KB"),
    (99999, "99 KB"),
    (2_050_000, "2.0 MB"),
    (2_150_000, "2.1 MB"),
    (2_250_000, "2.2 MB"),
    (2_450_000, "2.5 MB"),
    (2_550_000, "2.5 MB"),
    (4_920_000_000, "4.9 GB"),
    (9_960_000_000, "10.0 GB"),
    (17_000_000_000, "17 GB"),
    (1_000_000_000_000_000, "1000 TB"),
    (9_223_372_036_854_775_807, "9223372 TB"),
]

# format.HumanTime's duration part (nanoseconds since the mtime), as printed by Ollama's Go code.
HUMAN_TIME = [
    (0, "Less than a second ago"),
    (999_999_999, "Less than a second ago"),
    (1 * S, "1 second ago"),
    (59_999_999_999, "59 seconds ago"),
    (60 * S, "About a minute ago"),
    (119_999_999_999, "About a minute ago"),
    (120 * S, "2 minutes ago"),
    (3_599_999_999_999, "59 minutes ago"),
    (3600 * S, "About an hour ago"),
    (5_399_999_999_999, "About an hour ago"),
    (5400 * S, "2 hours ago"),
    (9000 * S, "3 hours ago"),  # 2.5 h: Go's math.Round goes away from zero
    (12600 * S, "4 hours ago"),
    (171_000 * S, "2 days ago"),
    (1_209_600 * S, "2 weeks ago"),
    (5_184_000 * S, "2 months ago"),
    (63_072_000 * S, "2 years ago"),
    (94_608_000 * S, "3 years ago"),
    (-7200 * S, "2 hours from now"),
    (-661_500_000 * S, "20 years from now"),
    (-662_256_000 * S, "Forever"),
]


@pytest.mark.parametrize(("n", "text"), HUMAN_BYTES)
def test_human_bytes_matches_ollama(n: int, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize(("ns", "text"), HUMAN_TIME)
def test_human_time_matches_ollama(ns: int, text: str) -> None:
    # Near the epoch, so a float holds the nanoseconds.
    assert human_time(-ns / S, 0.0) == text


def claimed_model(tiny: TinyStore, name: str, total: int, cfg: dict[str, str], mtime: float) -> str:
    """A legacy tag whose manifest claims `total` bytes (its model blob is not here)."""
    cfg_bytes = json.dumps(cfg).encode()
    config = {
        "mediaType": MEDIA_CONFIG,
        "digest": str(tiny.blob(cfg_bytes)),
        "size": len(cfg_bytes),
    }
    layer = {
        "mediaType": LAYER + "model",
        "digest": str(Digest.of_bytes(name.encode())),
        "size": total - len(cfg_bytes),
    }
    raw = compact(
        {"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "config": config, "layers": [layer]}
    )
    ns = int(mtime * S)
    tiny.legacy(name, raw, mtime_ns=ns)
    return sha256_hex(raw)[:12]


def test_ls_table(tiny: TinyStore) -> None:
    now = time.time()
    q4 = {"model_format": "gguf", "file_type": "Q4_K_M"}
    ids = {
        "gemma4:26b": claimed_model(tiny, "gemma4:26b", 17_000_000_000, q4, now - 3 * 3600 - 300),
        "someuser/tiny:q8": claimed_model(
            tiny, "someuser/tiny:q8", 4_920_000_000, {"model_format": "gguf"}, now - 20 * 86400
        ),
        "hf.co/bartowski/SmolLM2:Q4_K_M": claimed_model(
            tiny, "hf.co/bartowski/SmolLM2:Q4_K_M", 2_450_000, {}, now - 90
        ),
        "qwen3:30b": claimed_model(tiny, "qwen3:30b", 999, q4, now + 50 * 3600),
    }
    proc = modelfs("ls", "--store", str(tiny.root))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    i = ids
    expected = [
        "NAME                              ID              SIZE      MODIFIED              FORMAT    QUANT",  # noqa: E501
        f"qwen3:30b                         {i['qwen3:30b']}    999 B     2 days from now       gguf      Q4_K_M",  # noqa: E501
        f"hf.co/bartowski/SmolLM2:Q4_K_M    {i['hf.co/bartowski/SmolLM2:Q4_K_M']}    2.5 MB    About a minute ago    -         -",  # noqa: E501
        f"gemma4:26b                        {i['gemma4:26b']}    17 GB     3 hours ago           gguf      Q4_K_M",  # noqa: E501
        f"someuser/tiny:q8                  {i['someuser/tiny:q8']}    4.9 GB    2 weeks ago           gguf      -",  # noqa: E501
    ]  # fmt: skip
    assert proc.stdout.splitlines() == expected
    # The models' blobs are absent: reported, never fatal.
    assert "problems in the store; `modelfs verify` names them" in proc.stderr


def test_ls_table_in_process(tiny: TinyStore, capsys: pytest.CaptureFixture[str]) -> None:
    build_zoo(tiny)
    code, out, err = cli(capsys, "ls", "--store", str(tiny.root))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED", "FORMAT", "QUANT"]
    names = [line.split()[0] for line in lines[1:]]
    assert names == list(EXPECTED_UTC)
    for line in lines[1:]:
        ident = line.split()[1]
        assert len(ident) == 12 and all(c in "0123456789abcdef" for c in ident)
    assert err.splitlines() == [f"modelfs: store: {tiny.root} (--store)"]


def test_ls_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "empty"
    store.mkdir()
    code, out, _ = cli(capsys, "ls", "--json", "--store", str(store))
    assert (code, out) == (0, '{"models":[]}\n')
    code, out, _ = cli(capsys, "ls", "--store", str(store))
    assert (code, out) == (0, "NAME    ID    SIZE    MODIFIED    FORMAT    QUANT\n")


# -- store discovery -------------------------------------------------------------------------


def test_discovery_order(
    tiny: TinyStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiny.gguf_model("from-env:1")
    home_store = TinyStore(tmp_path / "home" / ".ollama" / "models")
    home_store.gguf_model("from-home:1")
    other = TinyStore(tmp_path / "other")
    other.gguf_model("from-flag:1")

    def names(out: str) -> list[str]:
        return [m["name"] for m in json.loads(out)["models"]]

    code, out, err = cli(capsys, "ls", "--json")
    assert code == 0 and names(out) == ["from-home:1"]
    assert f"modelfs: store: {home_store.root} (home default)" in err.splitlines()

    # Ollama trims spaces, then quotes, from $OLLAMA_MODELS.
    monkeypatch.setenv("OLLAMA_MODELS", f'  "{tiny.root}" ')
    code, out, err = cli(capsys, "ls", "--json")
    assert code == 0 and names(out) == ["from-env:1"]
    assert f"modelfs: store: {tiny.root} ($OLLAMA_MODELS)" in err.splitlines()

    code, out, err = cli(capsys, "ls", "--json", "--store", str(other.root))
    assert code == 0 and names(out) == ["from-flag:1"]
    assert f"modelfs: store: {other.root} (--store)" in err.splitlines()

    # Only quotes and blanks: as good as unset.
    monkeypatch.setenv("OLLAMA_MODELS", " '' ")
    code, out, _ = cli(capsys, "ls", "--json")
    assert code == 0 and names(out) == ["from-home:1"]


def test_discovery_subprocess(tiny: TinyStore, tmp_path: Path) -> None:
    tiny.gguf_model("m:1")
    home = tmp_path / "home2"
    (home / ".ollama").mkdir(parents=True)
    (home / ".ollama" / "models").symlink_to(tiny.root)
    proc = modelfs("ls", "--json", home=home)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"modelfs: store: {home}/.ollama/models (home default)\n"
    assert [m["name"] for m in json.loads(proc.stdout)["models"]] == ["m:1"]

    proc = modelfs("ls", "--json", home=home, env={"OLLAMA_MODELS": f"'{tiny.root}'"})
    assert proc.returncode == 0
    assert proc.stderr == f"modelfs: store: {tiny.root} ($OLLAMA_MODELS)\n"

    # `~` in --store is the user's home, as a shell would have it.
    proc = modelfs("ls", "--store", "~/.ollama/models", home=home)
    assert proc.returncode == 0
    assert proc.stderr == f"modelfs: store: {home}/.ollama/models (--store)\n"


@pytest.mark.parametrize("how", ["--store", "OLLAMA_MODELS", "file"])
def test_missing_store(tmp_path: Path, how: str) -> None:
    missing = tmp_path / "no" / "such store"
    env: dict[str, str] = {}
    argv = ["ls"]
    if how == "--store":
        argv += ["--store", str(missing)]
    elif how == "OLLAMA_MODELS":
        env["OLLAMA_MODELS"] = str(missing)
    else:
        missing = tmp_path / "a-file"
        missing.write_text("not a dir")
        argv += ["--store", str(missing)]
    proc = modelfs(*argv, env=env, home=tmp_path / "home")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert_one_error(proc.stderr, str(missing))


def test_missing_home_store(tmp_path: Path) -> None:
    if SYSTEM_STORE.is_dir():
        pytest.skip(f"{SYSTEM_STORE} exists on this machine")
    proc = modelfs("ls", home=tmp_path / "home")
    assert proc.returncode == 1
    assert_one_error(proc.stderr, f"{tmp_path}/home/.ollama/models")


def test_unusable_store_paths_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ENAMETOOLONG from stat() is an OSError, not a StoreError.
    code, out, err = cli(capsys, "ls", "--store", str(tmp_path / ("x" * 5000)))
    assert (code, out) == (1, "")
    assert_one_error(err, "File name too long")
    # A path with a newline still gives one line.
    code, _, err = cli(capsys, "ls", "--store", str(tmp_path / "two\nlines"))
    assert code == 1
    assert_one_error(err, "two\\nlines")


# -- errors ----------------------------------------------------------------------------------


def test_unknown_model(tiny: TinyStore, capsys: pytest.CaptureFixture[str]) -> None:
    tiny.gguf_model("m:1")
    code, out, err = cli(capsys, "show", "-q", "--store", str(tiny.root), "nope")
    assert (code, out) == (1, "")
    assert assert_one_error(err) == "modelfs: error: model 'nope' not found"
    # Not quiet: the store line, then the error, and nothing else.
    code, _, err = cli(capsys, "show", "--store", str(tiny.root), "m:2")
    assert code == 1
    assert err.splitlines() == [
        f"modelfs: store: {tiny.root} (--store)",
        "modelfs: error: model 'm:2' not found",
    ]


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "../../etc/passwd",
        "a/../b",
        "x/y/z/w",
        "model:",
        ":tag",
        " ",
        "m@sha256:" + "0" * 64,
        "-x",
        ".hidden",
        "a\\b",
        "a" * 81,
        "nul\0byte",
    ],
)
def test_invalid_names(tiny: TinyStore, capsys: pytest.CaptureFixture[str], name: str) -> None:
    tiny.gguf_model("m:1")
    code, out, err = cli(capsys, "show", "-q", "--store", str(tiny.root), "--", name)
    assert (code, out) == (1, "")
    assert_one_error(err, "invalid")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["ls", "--bogus"],
        ["show"],
        ["ls", "--prefer", ""],
        ["ls", "--prefer", " , "],
        ["show", "a", "b"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(argv)
    assert exc.value.code == 2
    _, err = capsys.readouterr()
    assert "Traceback" not in err and "error:" in err


def test_usage_and_user_errors_subprocess(tiny: TinyStore) -> None:
    tiny.gguf_model("m:1")
    proc = modelfs("ls", "--bogus", "--store", str(tiny.root))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("usage: modelfs")
    assert proc.stderr.splitlines()[-1] == "modelfs: error: unrecognized arguments: --bogus"

    proc = modelfs("show", "../x", "-q", "--store", str(tiny.root))
    assert proc.returncode == 1
    assert assert_one_error(proc.stderr) == "modelfs: error: invalid model name '../x'"

    proc = modelfs("show", "nope:1", "-q", "--store", str(tiny.root))
    assert proc.returncode == 1
    assert assert_one_error(proc.stderr) == "modelfs: error: model 'nope:1' not found"


def build_damage(tiny: TinyStore) -> dict[str, str]:
    """Good models amid every kind of damage a store picks up; returns name -> digest."""
    good = {
        "good:1": sha256_hex(tiny.gguf_model("good:1")),
        "someuser/also-good:2": sha256_hex(tiny.gguf_model("someuser/also-good:2", payload=b"2")),
    }
    # A tag whose model blob is gone is still listed (Ollama lists it too).
    gone = tiny.gguf_model("gone-blob:1", payload=b"deleted weights")
    tiny.layout.blob(Digest.parse(json.loads(gone)["layers"][0]["digest"])).unlink()
    good["gone-blob:1"] = sha256_hex(gone)
    # A config that is not JSON, and one with a lone surrogate escape.
    bad_cfg = tiny.manifest([tiny.layer("model", b"w")], {"model_format": "gguf", "only": "here"})
    tiny.layout.blob(Digest.parse(json.loads(bad_cfg)["config"]["digest"])).write_bytes(b"{")
    tiny.legacy("bad-config:1", bad_cfg)  # Ollama's /api/tags leaves it out
    surrogate = tiny.gguf_model("surrogate:1", payload=b"s", file_type="\ud800")
    good["surrogate:1"] = sha256_hex(surrogate)

    m = tiny.layout.manifests / "registry.ollama.ai" / "library"
    (m / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (m / "good" / ".DS_Store").write_bytes(b"junk")
    (tiny.layout.manifests / ".DS_Store").write_bytes(b"junk")
    (m / "empty").mkdir()
    (m / "empty" / "latest").write_bytes(b"")
    (m / "trunc").mkdir()
    (m / "trunc" / "latest").write_bytes(b'{"schemaVersion":2,"layers":[{"mediaT')
    (m / "notjson").mkdir()
    (m / "notjson" / "latest").write_bytes(b"\xff\xfe\0garbage")
    hexd = "ab" * 32
    (tiny.layout.blobs / f"sha256:{hexd}").write_bytes(b"cross-OS copy")
    (tiny.layout.blobs / f"sha256-{'cd' * 32}-partial").write_bytes(b"x")
    (tiny.layout.blobs / ".DS_Store").write_bytes(b"junk")
    # A v2 tag whose manifest blob is gone (a dangling link), and a list with no child here.
    v2 = tiny.layout.manifests_v2 / "ollama.com" / "library" / "dangling"
    v2.mkdir(parents=True)
    (v2 / "latest").symlink_to(f"../../../../blobs/sha256-{'ef' * 32}")
    ghost_child = tiny.manifest([tiny.layer("model", b"never pulled")])
    ghost = tiny.manifest_list([(ghost_child, "llamacpp", "gguf")])
    tiny.layout.blob(Digest.of_bytes(ghost_child)).unlink()
    tiny.v2("ghost:1", ghost)
    return good


def test_damaged_store_still_lists_the_good(
    tiny: TinyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    good = build_damage(tiny)
    code, out, err = cli(capsys, "ls", "--json", "--store", str(tiny.root))
    assert code == 0
    assert "Traceback" not in err
    models = json.loads(out)["models"]
    assert {m["name"]: m["digest"] for m in models} == good
    surrogate = next(m for m in models if m["name"] == "surrogate:1")
    assert surrogate["details"]["quantization_level"] == "\ufffd"  # as Go decodes "\ud800"
    assert "bad-config:1" not in {m["name"] for m in models}
    assert any("in the store; `modelfs verify` names them" in line for line in err.splitlines())

    code, out, err = cli(capsys, "ls", "--store", str(tiny.root))
    assert code == 0
    assert sorted(line.split()[0] for line in out.splitlines()[1:]) == sorted(good)

    # The ghost list is not listed, but show explains it.
    code, out, _ = cli(capsys, "show", "--json", "--store", str(tiny.root), "ghost:1")
    assert code == 0
    record = json.loads(out)
    assert record["variants"] == []
    assert [a["runner"] for a in record["absent_variants"]] == ["llamacpp"]


def test_damaged_store_subprocess(tiny: TinyStore) -> None:
    good = build_damage(tiny)
    for argv in (["ls"], ["ls", "--json"], ["show", "surrogate:1"], ["show", "gone-blob:1"]):
        proc = modelfs(*argv, "--store", str(tiny.root))
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.startswith(f"modelfs: store: {tiny.root} (--store)\n")
    proc = modelfs("ls", "--json", "--store", str(tiny.root), "-v")
    assert proc.returncode == 0
    assert {m["name"] for m in json.loads(proc.stdout)["models"]} == set(good)
    debug = proc.stderr
    for path in (
        "manifests/registry.ollama.ai/library/.DS_Store",
        "manifests/registry.ollama.ai/library/empty/latest: empty file",
        "manifests/registry.ollama.ai/library/trunc/latest",
        f"blobs/sha256:{'ab' * 32}",
        "manifests-v2/ollama.com/library/dangling/latest",
    ):
        assert path in debug
    # Nothing was deleted or renamed.
    assert (tiny.layout.blobs / f"sha256:{'ab' * 32}").exists()
    assert (tiny.layout.manifests / "registry.ollama.ai" / "library" / "empty" / "latest").exists()


@pytest.mark.parametrize("n_models", [1, 100])
def test_closed_stdout_is_not_an_error(tiny: TinyStore, n_models: int) -> None:
    # `modelfs ls | head -0`: the reader is gone before we write. One model fits in stdout's
    # buffer, so the failure comes at the final flush; a hundred fail while writing.
    for i in range(n_models):
        tiny.gguf_model(f"m{i}:latest", payload=f"w{i}".encode())
    r, w = os.pipe()
    os.close(r)
    try:
        proc = modelfs("ls", "--json", "--store", str(tiny.root), stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


# -- show ------------------------------------------------------------------------------------

GGUF_TENSORS = [
    ("token_embd.weight", (4, 256), "Q4_K"),
    ("blk.0.attn_q.weight", (2, 256), "Q6_K"),
    ("blk.0.attn_k.weight", (2, 256), "Q4_K"),
    ("output_norm.weight", (64,), "F32"),
]
# Q4_K: 144 bytes per 256 values; Q6_K: 210; F32: 4 per value.
GGUF_QUANT = [
    {"type": "Q4_K", "count": 2, "bytes": 6 * 144},
    {"type": "Q6_K", "count": 1, "bytes": 2 * 210},
    {"type": "F32", "count": 1, "bytes": 64 * 4},
]


def build_show_store(tiny: TinyStore, tmp_path: Path) -> dict[str, Any]:
    work = tmp_path / "gguf-work"
    work.mkdir()
    weights = gguf_bytes(GGUF_TENSORS, workdir=work)
    layers = [
        tiny.layer("model", weights),
        tiny.layer("template", b"{{ .Prompt }}"),
        tiny.layer("system", b"You are terse."),
        tiny.layer("params", b'{"stop":["<|eot|>"]}'),
        tiny.layer("license", b"LICENSE ONE"),
        tiny.layer("license", b"LICENSE TWO"),
        tiny.layer("application/x-unknown", b"?"),
    ]
    cfg = {
        "model_format": "gguf",
        "model_family": "llama",
        "model_type": "1B",
        "file_type": "Q4_K_M",
    }
    legacy = tiny.manifest(layers, cfg)
    tiny.legacy("llama3.2:1b", legacy, mtime_ns=T0 * S + 5)

    w = np.arange(16, dtype=np.uint32).reshape(2, 8)
    scale = np.ones((2, 1), dtype=np.float16)
    norm = np.ones((8,), dtype=np.float16)
    quantized = safetensors.numpy.save(
        {"model.layers.0.mlp.weight": w, "model.layers.0.mlp.weight.scale": scale},
        metadata={"quant_type": "INT4 ", "group_size": "64"},
    )
    plain = safetensors.numpy.save({"model.norm.weight": norm})
    mlx = tiny.manifest(
        [
            tiny.layer("tensor", quantized, name="model.layers.0.mlp.weight"),
            tiny.layer("tensor", plain, name="model.norm.weight"),
            tiny.layer("json", b'{"architectures":["Gemma"]}', name="config.json"),
        ],
        {"model_format": "safetensors", "model_family": "gemma4", "file_type": "int4"},
    )
    gguf_child = tiny.manifest(
        [tiny.layer("model", gguf_bytes(GGUF_TENSORS[:1], workdir=work))],
        {"model_format": "gguf", "model_family": "gemma4", "file_type": "Q4_K_M"},
    )
    absent = tiny.manifest([tiny.layer("model", b"ggml weights, not pulled")])
    lst = tiny.manifest_list(
        [(gguf_child, "llamacpp", "gguf"), (mlx, "mlx", "safetensors"), (absent, "ggml", "gguf")]
    )
    tiny.layout.blob(Digest.of_bytes(absent)).unlink()
    tiny.v2("gemma4:e2b", lst)
    return {
        "legacy": legacy,
        "weights": weights,
        "mlx": mlx,
        "gguf_child": gguf_child,
        "absent": absent,
        "list": lst,
        "quant_bytes": w.nbytes + scale.nbytes,
        "norm_bytes": norm.nbytes,
    }


def test_show_json_legacy_gguf(
    tiny: TinyStore, tmp_path: Path, capsys: pytest.CaptureFixture[str], tz: Any
) -> None:
    built = build_show_store(tiny, tmp_path)
    tz("UTC")
    code, out, _ = cli(capsys, "show", "--json", "--store", str(tiny.root), "LLAMA3.2:1B")
    assert code == 0
    record = json.loads(out)
    assert record["name"] == "llama3.2:1b"  # the on-disk spelling
    assert record["full_name"] == "registry.ollama.ai/library/llama3.2:1b"
    assert record["source"] == "manifests/registry.ollama.ai/library/llama3.2/1b"
    assert record["digest"] == f"sha256:{sha256_hex(built['legacy'])}"
    assert record["list"] is False
    assert record["modified_at"] == "2023-11-14T22:13:20.000000005Z"
    assert record["absent_variants"] == [] and record["problems"] == []
    (variant,) = record["variants"]
    assert variant["runner"] == "ggml" and variant["format"] == "gguf"
    assert variant["preferred"] is True
    assert variant["digest"] == record["digest"]
    assert variant["size"] == manifest_size(built["legacy"])
    assert variant["config"]["model_family"] == "llama"
    assert variant["config"]["file_type"] == "Q4_K_M"
    assert variant["config"]["present"] is True
    manifest_layers = json.loads(built["legacy"])["layers"]
    assert [
        (layer["media_type"], layer["digest"], layer["size"], layer["present"])
        for layer in variant["layers"]
    ] == [(m["mediaType"], m["digest"], m["size"], True) for m in manifest_layers]
    assert [layer["file"] for layer in variant["layers"]] == [
        "model.gguf",
        "template.txt",
        "system.txt",
        "params.json",
        "LICENSE",
        "LICENSE-2",
        ".ollama/layers/6-application_x-unknown",
    ]
    assert variant["layers"][0]["size"] == len(built["weights"])
    assert variant["quantization"] == GGUF_QUANT


def test_show_json_manifest_list(
    tiny: TinyStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = build_show_store(tiny, tmp_path)
    code, out, _ = cli(capsys, "show", "--json", "--store", str(tiny.root), "gemma4:e2b")
    assert code == 0
    record = json.loads(out)
    assert record["source"] == "manifests-v2/ollama.com/library/gemma4/e2b"
    assert record["list"] is True
    assert record["digest"] == f"sha256:{sha256_hex(built['list'])}"
    assert [(v["runner"], v["format"], v["preferred"]) for v in record["variants"]] == [
        ("llamacpp", "gguf", True),
        ("mlx", "safetensors", False),
    ]
    gguf_v, mlx_v = record["variants"]
    assert gguf_v["digest"] == f"sha256:{sha256_hex(built['gguf_child'])}"
    assert mlx_v["digest"] == f"sha256:{sha256_hex(built['mlx'])}"
    assert gguf_v["quantization"] == [{"type": "Q4_K", "count": 1, "bytes": 4 * 144}]
    assert [(layer["file"], layer.get("name")) for layer in mlx_v["layers"]] == [
        ("tensors/model.layers.0.mlp.weight.safetensors", "model.layers.0.mlp.weight"),
        ("tensors/model.norm.weight.safetensors", "model.norm.weight"),
        ("config.json", "config.json"),
    ]
    assert mlx_v["quantization"] == [
        {"type": "int4", "count": 1, "bytes": built["quant_bytes"]},
        {"type": "F16", "count": 1, "bytes": built["norm_bytes"]},
    ]
    assert record["absent_variants"] == [
        {"runner": "ggml", "format": "gguf", "digest": f"sha256:{sha256_hex(built['absent'])}"}
    ]
    assert record["problems"] == []

    code, out, _ = cli(
        capsys, "show", "--json", "--prefer", "mlx", "--store", str(tiny.root), "gemma4:e2b"
    )
    assert [v["preferred"] for v in json.loads(out)["variants"]] == [False, True]


def test_show_missing_blob_and_text(
    tiny: TinyStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = build_show_store(tiny, tmp_path)
    second_license = json.loads(built["legacy"])["layers"][5]["digest"]
    tiny.layout.blob(Digest.parse(second_license)).unlink()
    code, out, _ = cli(capsys, "show", "--json", "--store", str(tiny.root), "llama3.2:1b")
    assert code == 0
    record = json.loads(out)
    presence = {layer["file"]: layer["present"] for layer in record["variants"][0]["layers"]}
    assert presence["LICENSE-2"] is False and presence["LICENSE"] is True
    assert record["problems"] == [
        f"manifests/registry.ollama.ai/library/llama3.2/1b: blob {second_license} missing"
    ]

    proc = modelfs("show", "--store", str(tiny.root), "llama3.2:1b")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    legacy_id = sha256_hex(built["legacy"])[:12]
    assert text.startswith(
        "Model    llama3.2:1b  (registry.ollama.ai/library/llama3.2:1b)\n"
        f"ID       {legacy_id}  (manifests/registry.ollama.ai/library/llama3.2/1b)\n"
    )
    lines = text.splitlines()
    assert any(line.split() == ["FILE", "MEDIA", "TYPE", "SIZE", "DIGEST"] for line in lines)
    assert any(line.strip().startswith("LICENSE-2  (missing)") for line in lines)
    assert any(line.split()[:3] == ["QUANT", "TENSORS", "BYTES"] for line in lines)
    assert any(line.split() == ["Q4_K", "2", "864", "B"] for line in lines)
    assert lines[-1] == f"problem: {record['problems'][0]}"

    proc = modelfs("show", "--store", str(tiny.root), "gemma4:e2b")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert ["ggml", "gguf", "-", sha256_hex(built["absent"])[:12], "not", "local"] in rows
    assert any(r[:2] == ["llamacpp", "gguf"] and r[-1] == "preferred" for r in rows)


def test_logs_to_the_journal_carry_priorities_and_no_prefix(tmp_path: Path) -> None:
    """Under systemd ($JOURNAL_STREAM names stderr), lines start with `<N>`, the priority the
    journal stores; elsewhere they start with `modelfs: `."""
    err = tmp_path / "stderr"
    err.touch()
    st = err.stat()
    with open(err, "ab") as f:
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "from modelfs.cli import main; main()",
                "gc",
                "--store",
                str(tmp_path / "absent"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env={**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"},
            timeout=60,
        )
    assert r.returncode == 1
    lines = err.read_text().splitlines()
    assert lines == [f"<3>modelfs: error: no model store at {tmp_path / 'absent'} (--store)"]
    store = tmp_path / "store"
    (store / "blobs").mkdir(parents=True)
    with open(err, "wb") as f:
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from modelfs.cli import main; main()",
                "gc",
                "--store",
                str(store),
                "--dry-run",
            ],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env={**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{err.stat().st_ino}"},
            timeout=60,
            check=True,
        )
    assert err.read_text().splitlines()[0] == f"<6>store: {store} (--store)"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["status", "--url", "http://[::1"], "--url 'http://[::1'"),
        (["status", "--url", "ftp://x"], "no sync daemon answers at ftp://x"),
        (
            ["pull", "--store", "/etc/passwd", "--from", "http://127.0.0.1:1", "m"],
            "store /etc/passwd is not a directory",
        ),
    ],
    ids=["bad-url", "not-http", "store-is-a-file"],
)
def test_bad_targets_are_one_line(argv: list[str], needle: str) -> None:
    r = modelfs(*argv)
    assert r.returncode == 1
    assert_one_error(r.stderr, needle)
