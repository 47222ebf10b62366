"""A model's spelling survives replication, and two spellings of one model are one model.

OCI repositories are lowercase, so a modelfs server lists
`hf.co/bartowski/SmolLM2-135M-Instruct-GGUF` as `hf.co/bartowski/smollm2-135m-instruct-gguf`;
Ollama folds case per name part (`getExistingName`, ollama/ollama fb30760
server/images.go), so both spellings are one model. Two real `modelfs sync` daemons, each the
other's peer, replicate everything.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.builders import TinyStore
from tests.test_daemon import complete, daemon, wait_until

SMOL = "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"


@pytest.mark.slow
def test_a_replica_keeps_the_spelling_and_neither_host_pulls_it_again(tmp_path: Path) -> None:
    a = TinyStore(tmp_path / "a")
    a.gguf_model(SMOL, b"smol weights")
    b = tmp_path / "b"
    with (
        daemon(tmp_path, "a", store=str(a.root), replicate=["*"], interval="1s") as da,
        daemon(tmp_path, "b", store=str(b), peers=[da.url], replicate=["*"], interval="1s") as db,
    ):
        da.reload(peers=[db.url])
        wait_until(lambda: complete(b, SMOL), what="the model on b")
        on_disk = [p.relative_to(b) for p in (b / "manifests").rglob("*") if p.is_file()]
        assert on_disk == [Path("manifests/hf.co/bartowski/SmolLM2-135M-Instruct-GGUF/Q4_K_M")]
        time.sleep(5)  # five rounds each, every peer listed again
        assert db.text().count("replicated ") == 1, db.text()
        assert "replicated " not in da.text(), da.text()
        for d in (da, db):
            models = d.status()["daemon"]["models"]
            peer_models = d.status()["peers"][0]["models"]
            assert list(models) == [SMOL] and list(peer_models) == [SMOL], d.status()
            assert peer_models[SMOL] == models[SMOL]
    found = sorted(p.name for p in (a.root / "manifests").rglob("*") if p.is_file())
    assert found == ["Q4_K_M"], found


@pytest.mark.slow
def test_two_spellings_of_one_model_on_two_hosts_are_one_model(tmp_path: Path) -> None:
    """b holds the lowercase spelling (a replica made before names kept their case): neither
    host pulls it from the other round after round, and status shows one row."""
    a = TinyStore(tmp_path / "a")
    a.gguf_model(SMOL, b"smol weights")
    b = TinyStore(tmp_path / "b")
    b.gguf_model(SMOL.lower().replace(":q4_k_m", ":Q4_K_M"), b"smol weights")
    with (
        daemon(tmp_path, "a", store=str(a.root), replicate=["*"], interval="1s") as da,
        daemon(
            tmp_path, "b", store=str(b.root), peers=[da.url], replicate=["*"], interval="1s"
        ) as db,
    ):
        da.reload(peers=[db.url])
        wait_until(
            lambda: all(d.status()["peers"][0]["models"] for d in (da, db)),
            what="both listed",
        )
        time.sleep(5)
        for d in (da, db):
            assert "replicated " not in d.text(), d.text()
            status = d.status()
            assert list(status["peers"][0]["models"]) == list(status["daemon"]["models"])
