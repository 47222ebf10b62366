"""What LM Studio and huggingface_hub need of a folder, checked on a real directory (a mount's
`.lmstudio/`, `.huggingface/hub/`, or what `modelfs link` wrote)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def check_lmstudio_folder(root: Path) -> dict[str, list[str]]:
    """LM Studio's documented models folder (lmstudio-ai/docs c6854fb
    0_app/5_advanced/import-model.md): `publisher/model/model-file.gguf`, two folder levels
    exactly, one model per folder; a projector `mmproj-*.gguf` sits beside the model it
    pairs with (LM Studio pairs any in the folder). Returns {"pub/folder": [files]}."""
    folders: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        depth = len(rel.parts)
        visible = [f for f in filenames if not f.startswith(".")]
        if depth < 2:
            assert not visible, f"{rel}: files above the model folders: {visible}"
        if depth == 2:
            assert not dirnames, f"{rel}: a folder below a model folder: {dirnames}"
            assert visible, f"{rel}: an empty model folder"
            assert all(f.endswith(".gguf") for f in visible), visible
            weights = [f for f in visible if not f.startswith("mmproj-")]
            projectors = [f for f in visible if f.startswith("mmproj-")]
            assert weights, f"{rel}: a projector without a model"
            assert len(projectors) <= 1, f"{rel}: projectors LM Studio cannot tell apart"
            folders[rel.as_posix()] = sorted(visible)
        assert depth <= 2, f"{rel}: deeper than LM Studio scans"
    return folders


HF_SCRIPT = r"""
import json, os, sys
from huggingface_hub import hf_hub_download, snapshot_download, try_to_load_from_cache
cache, repo, files = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rev = sys.argv[4] if len(sys.argv) > 4 else None
snap = snapshot_download(repo, cache_dir=cache, local_files_only=True, revision=rev)
out = {"snapshot": snap, "files": {}}
for name in files:
    path = hf_hub_download(repo, name, cache_dir=cache, local_files_only=True, revision=rev)
    assert try_to_load_from_cache(repo, name, cache_dir=cache, revision=rev) == path
    out["files"][name] = path
print(json.dumps(out))
"""


def hf_resolve(
    cache: Path, repo: str, files: list[str], revision: str | None = None
) -> dict[str, Any]:
    """huggingface_hub itself, offline, in a process of its own (it reads HF_HUB_OFFLINE at
    import): the snapshot folder and each file's path, as a loader would get them."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_TOKEN", None)
    args = [sys.executable, "-c", HF_SCRIPT, str(cache), repo, json.dumps(files)]
    proc = subprocess.run(
        args + ([revision] if revision else []),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
