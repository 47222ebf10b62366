"""Other tools' folder layouts of the store: an LM Studio models folder and a Hugging Face hub
cache. Pure functions from the scanned store to a list of files (path, and the blob or the few
bytes each holds); the mount serves them (`.lmstudio/`, `.huggingface/hub/`) and `modelfs link`
writes them as symlinks into `blobs/`, so both show the same names.

LM Studio (lmstudio-ai/docs c6854fb 0_app/5_advanced/import-model.md): a models folder holds
`publisher/model/model-file.gguf`, exactly two folder levels, one model per folder; a
projector named `mmproj-*.gguf` in a model's folder is paired with it.

Hugging Face hub cache (huggingface/huggingface_hub ee0a451): a repo is the folder
`models--<org>--<name>` (file_download.py:720 repo_folder_name, constants.py:108
REPO_ID_SEPARATOR); offline, `hf_hub_download` and `snapshot_download` read the commit a
branch names from `refs/<branch>` (its whole content, no newline: file_download.py:1121,
_snapshot_download.py:309) and serve `snapshots/<commit>/<file>` (file_download.py:2052),
where a commit is 40 lowercase hex digits (file_download.py:72 REGEX_COMMIT_HASH). Nothing
else is read offline: without `trees/<commit>.json` a snapshot is taken as complete
(_snapshot_download.py _raise_if_incomplete_snapshot).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from modelfs.store.digest import Digest
from modelfs.store.errors import StoreError
from modelfs.store.formats.safetensors import read_safetensors_header_path
from modelfs.store.manifest import Manifest
from modelfs.store.names import DEFAULT_NAMESPACE, DEFAULT_TAG, Name
from modelfs.store.scan import DEFAULT_PREFER, Entry, StoreIndex
from modelfs.store.tools.files import ModelFile, model_files

LAYOUTS = ("lmstudio", "hf")
# The layer kinds whose blobs a layout may show (`ToolVariant.of` in the layouts below).
SHOWN_KINDS = frozenset({"model", "projector", "json", "tensor"})

# Library models (registry.ollama.ai/library/x) have no publisher of their own.
LIBRARY_PUBLISHER = "ollama"
HF_HOSTS = frozenset({"hf.co", "huggingface.co"})
# A branch every tag's name can be (Ollama's tags are [A-Za-z0-9_][A-Za-z0-9_.-]*); `main`
# is the branch a loader reads when given no revision.
HF_MAIN = "main"

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_GGUF_SUFFIX = re.compile(r"[-_.]gguf$", re.IGNORECASE)
# A name huggingface_hub's validate_repo_id accepts (huggingface/huggingface_hub ee0a451
# utils/_validators.py:28 REPO_ID_REGEX, and no `--`, `..` or trailing `.git`).
_HF_REPO_PART = re.compile(r"(?!.*--)(?!.*\.\.)(?!.*\.git$)\w(?:[\w.-]{0,94}\w)?", re.ASCII)


@dataclass(frozen=True, slots=True)
class ToolFile:
    """A file of a tool's layout. `source` is the blob-backed file it shows (a symlink into
    `blobs/` for `modelfs link`); else it holds `data` (a ref, an index)."""

    path: str  # relative to the layout's root, '/'-separated
    name: Name  # the model it belongs to
    source: ModelFile | None = None
    data: bytes = b""
    # An index whose shards' headers were not read (`Deferred`): `data` is empty, and
    # `safetensors_index(shards, ...)` makes it when it is asked for.
    shards: tuple[tuple[str, ModelFile], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolVariant:
    """A runnable manifest of a tag: its files whose blobs are present, by layer kind."""

    manifest: Manifest
    by_kind: dict[str, tuple[ModelFile, ...]]
    quant: str  # the config's file type, safe in a file name ("" when unknown)

    def of(self, kind: str) -> tuple[ModelFile, ...]:
        return self.by_kind.get(kind, ())


@dataclass(frozen=True, slots=True)
class ToolModel:
    """A tag as the layouts see it, the preferred variant first."""

    name: Name
    digest: Digest  # what the tag names (a list's own digest for a list)
    mtime_ns: int
    variants: tuple[ToolVariant, ...]


def tool_models(
    index: StoreIndex,
    prefer: Iterable[str] = DEFAULT_PREFER,
    files_of: Callable[[Manifest], Sequence[ModelFile]] = model_files,
    entries: Iterable[Entry] | None = None,
) -> list[ToolModel]:
    """Every tag of the store (or of `entries`, some of its tags), sorted by full name (the
    order that settles collisions). `files_of` is `model_files`, or a cache of it (the mount's
    plans)."""
    prefer = tuple(prefer)
    variants: dict[Digest, ToolVariant] = {}  # manifests recur (a list child and its anchor)
    out = []
    for entry in index if entries is None else entries:
        first = entry.preferred(prefer)
        shown = []
        for v in sorted(entry.variants, key=lambda v: v is not first):
            tv = variants.get(v.manifest.digest)
            if tv is None:
                by_kind: dict[str, list[ModelFile]] = {}
                for f in files_of(v.manifest):
                    info = index.blob_info(f.layer.digest)
                    if info is not None and info.size == f.layer.size:
                        by_kind.setdefault(f.layer.kind, []).append(f)
                config = index.config(v.manifest)
                quant = _safe(config.file_type) if config is not None else ""
                tv = ToolVariant(v.manifest, {k: tuple(fs) for k, fs in by_kind.items()}, quant)
                variants[v.manifest.digest] = tv
            shown.append(tv)
        out.append(ToolModel(entry.name, entry.digest, entry.modified_ns, tuple(shown)))
    out.sort(key=lambda m: (m.name.full.casefold(), m.name.full))
    return out


def _safe(text: str) -> str:
    return _UNSAFE.sub("_", text).strip("_.")[:80]


def publisher_and_repo(name: Name) -> tuple[str, str]:
    """`hf.co/<org>/<repo>` → (org, repo); a library model → (`ollama`, model); another
    namespace of Ollama's registry → (namespace, model); another host → (`host_namespace`,
    model)."""
    if name.host.lower() in HF_HOSTS:
        return name.namespace, name.model
    if name.is_default_host:
        if name.namespace.lower() == DEFAULT_NAMESPACE:
            return LIBRARY_PUBLISHER, name.model
        return name.namespace, name.model
    return f"{_safe(name.host)}_{name.namespace}", name.model


def _unique(wanted: str, taken: set[str]) -> str:
    """`wanted`, or with `-2`, `-3`, … (before a file's extension): the first not in `taken`
    (compared casefolded, as macOS and Windows compare names); adds it to `taken`."""
    stem, ext = (wanted[:-5], wanted[-5:]) if wanted.endswith(".gguf") else (wanted, "")
    n = 1
    while True:
        candidate = wanted if n == 1 else f"{stem}-{n}{ext}"
        if candidate.casefold() not in taken:
            taken.add(candidate.casefold())
            return candidate
        n += 1


def repo_key(name: Name) -> tuple[str, ...]:
    """The repository a tag belongs to in every layout. A layout's files of one repository
    depend on that repository's tags alone (other repositories only change names), so the
    layout of a few whole repositories shows each of their blobs as often as the store's."""
    return (name.host.casefold(), name.namespace.casefold(), name.model.casefold())


def weight_stem(name: Name, quant: str) -> str:
    """The stem of a GGUF's file name, carrying the model and its quantization as Hugging Face
    GGUF repositories name them: `SmolLM2-135M-Instruct-Q4_K_M` for
    hf.co/…/SmolLM2-135M-Instruct-GGUF:Q4_K_M, `gemma4-26b-Q4_K_M` for gemma4:26b."""
    model = _GGUF_SUFFIX.sub("", name.model) or name.model
    parts = [model]
    if name.tag.lower() != DEFAULT_TAG:
        parts.append(name.tag)
    if quant and quant.lower() not in name.tag.lower():
        parts.append(quant)
    return "-".join(parts)


def _gguf_names(stem: str, files: Sequence[ModelFile]) -> list[tuple[str, ModelFile]]:
    """A model's GGUF weights by file name; several (a split model) named as llama.cpp's
    gguf-split names its parts."""
    n = len(files)
    if n == 1:
        return [(f"{stem}.gguf", files[0])]
    return [(f"{stem}-{i:05d}-of-{n:05d}.gguf", f) for i, f in enumerate(files, 1)]


def lmstudio_layout(models: Sequence[ToolModel]) -> list[ToolFile]:
    """The LM Studio models folder: `<publisher>/<model>/<stem>.gguf` per GGUF tag.

    The tags of one Ollama model share its folder (as one Hugging Face repository holds its
    quantizations), a blob two tags share shown once. LM Studio pairs any `mmproj-*.gguf` of a
    folder with its models, so a folder holds tags with one projector (or none): tags of the
    same model with another projector go to `<model>-<tag>/`. Folder names that collide (case
    aside) get `-2`, `-3`, in the order of the models' full names; so do file names.
    """
    # (the model's repository, projector digest) -> the tags of that folder, in name order
    groups: dict[tuple[tuple[str, ...], Digest | None], list[tuple[ToolModel, ToolVariant]]] = {}
    for m in models:
        for v in m.variants:
            if v.of("model"):
                projectors = v.of("projector")
                key = (repo_key(m.name), projectors[0].layer.digest if projectors else None)
                groups.setdefault(key, []).append((m, v))
                break
    publishers: dict[str, str] = {}  # casefolded publisher -> its first spelling
    folders: dict[str, set[str]] = {}  # publisher -> folder names taken
    repos_seen: set[tuple[str, ...]] = set()
    out: list[ToolFile] = []
    for (folder_repo, _projector), tags in groups.items():
        pub, repo = publisher_and_repo(tags[0][0].name)
        pub = publishers.setdefault(pub.casefold(), pub)
        wanted = repo if folder_repo not in repos_seen else f"{repo}-{tags[0][0].name.tag}"
        repos_seen.add(folder_repo)
        folder = _unique(wanted, folders.setdefault(pub.casefold(), set()))
        base = f"{pub}/{folder}"
        names: set[str] = set()
        shown: set[Digest] = set()
        for m, v in tags:
            stem = weight_stem(m.name, v.quant)
            for fname, f in _gguf_names(stem, v.of("model")):
                if f.layer.digest in shown:
                    continue
                shown.add(f.layer.digest)
                out.append(ToolFile(f"{base}/{_unique(fname, names)}", m.name, f))
            for f in v.of("projector")[:1]:
                if f.layer.digest not in shown:
                    shown.add(f.layer.digest)
                    model = _GGUF_SUFFIX.sub("", m.name.model) or m.name.model
                    fname = _unique(f"mmproj-{model}.gguf", names)
                    out.append(ToolFile(f"{base}/{fname}", m.name, f))
    return out


def hf_revision(digest: Digest) -> str:
    """The commit a tag's snapshot is under: the first 40 hex digits of what the tag names, so
    it is the same for the same manifest on every host and changes when the tag does."""
    return digest.hex[:40]


# tensor blob -> (the tensor names it holds, its data size), or None when unreadable
TensorNames = Callable[[ModelFile], tuple[list[str], int] | None]


class Deferred(Exception):
    """Raised by a TensorNames that will not read a header now (a mount start, a header of
    100 MB): the index of those shards is made later by `safetensors_index`."""


# (path, the blob-backed file it shows, or its bytes, or the shards of an index to make later)
_Snapshot = tuple[str, ModelFile | None, bytes, tuple[tuple[str, ModelFile], ...]]


def hf_layout(models: Sequence[ToolModel], tensor_names: TensorNames) -> list[ToolFile]:
    """The Hugging Face hub cache: `models--<org>--<repo>/` (the names of
    `publisher_and_repo`) for every tag pulled from hf.co and every safetensors model.

    Each tag is a branch, `refs/<tag>`, naming its own snapshot (`hf_revision`); `refs/main`
    follows the tag `latest`, else the newest tag, unless a tag is called `main`. A snapshot
    holds the GGUF weights and projector named as in `lmstudio_layout`, and for a safetensors
    variant its JSON files (`config.json`, tokenizer files) by their names, its tensor blobs
    as `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` (one blob:
    `model.safetensors`). Repos that collide (case aside) get `-2`, `-3` on the repo name.
    """
    repos: dict[tuple[str, ...], list[ToolModel]] = {}
    for m in models:
        hf_host = m.name.host.lower() in HF_HOSTS
        has_tensors = any(v.of("tensor") for v in m.variants)
        if hf_host or has_tensors:
            repos.setdefault(repo_key(m.name), []).append(m)
    taken: set[str] = set()
    out: list[ToolFile] = []
    for tags in repos.values():
        org, repo = publisher_and_repo(tags[0].name)
        if not (_HF_REPO_PART.fullmatch(org) and _HF_REPO_PART.fullmatch(repo)):
            continue  # a repo id huggingface_hub refuses: it could never be asked for
        folder = _unique(f"models--{org}--{repo}", taken)
        refs: dict[str, str] = {}
        for m in tags:
            rev = hf_revision(m.digest)
            refs[m.name.tag] = rev
            base = f"{folder}/snapshots/{rev}"
            for path, source, data, shards in _snapshot_files(m, tensor_names):
                out.append(ToolFile(f"{base}/{path}", m.name, source, data, shards))
        main = next((t for t in tags if t.name.tag == HF_MAIN), None)
        main = main or next((t for t in tags if t.name.tag.lower() == DEFAULT_TAG), None)
        main = main or max(tags, key=lambda t: (t.mtime_ns, t.name.tag))
        refs[HF_MAIN] = hf_revision(main.digest)
        owner = {t.name.tag: t.name for t in tags}
        for ref, rev in sorted(refs.items()):
            out.append(
                ToolFile(f"{folder}/refs/{ref}", owner.get(ref, main.name), data=rev.encode())
            )
    return out


def _snapshot_files(m: ToolModel, tensor_names: TensorNames) -> list[_Snapshot]:
    files_out: list[_Snapshot] = []
    names: set[str] = set()

    def add(
        path: str,
        source: ModelFile | None,
        data: bytes = b"",
        shards: tuple[tuple[str, ModelFile], ...] = (),
    ) -> None:
        if path.casefold() not in names:
            names.add(path.casefold())
            files_out.append((path, source, data, shards))

    gguf_done = tensors_done = False
    for v in m.variants:
        models = v.of("model")
        if models and not gguf_done:
            gguf_done = True
            for fname, f in _gguf_names(weight_stem(m.name, v.quant), models):
                add(fname, f)
            for f in v.of("projector")[:1]:
                add(f"mmproj-{_GGUF_SUFFIX.sub('', m.name.model) or m.name.model}.gguf", f)
        tensors = v.of("tensor")
        if tensors and not tensors_done:
            tensors_done = True
            for f in v.of("json"):
                add(f.path, f)
            for path, source, data, shards in _safetensors_files(tensors, tensor_names):
                add(path, source, data, shards)
    return files_out


def _safetensors_files(tensors: Sequence[ModelFile], tensor_names: TensorNames) -> list[_Snapshot]:
    """Tensor blobs as transformers' sharded checkpoint (modeling_utils reads
    `model.safetensors.index.json`'s `weight_map`, tensor name → shard file)."""
    if len(tensors) == 1:
        return [("model.safetensors", tensors[0], b"", ())]
    n = len(tensors)
    shards = tuple((f"model-{i:05d}-of-{n:05d}.safetensors", f) for i, f in enumerate(tensors, 1))
    index = "model.safetensors.index.json"
    try:
        data = safetensors_index(shards, tensor_names)
    except Deferred:
        return [*((shard, f, b"", ()) for shard, f in shards), (index, None, b"", shards)]
    if data is None:
        return []  # an index naming a shard it cannot describe would fail the load
    return [*((shard, f, b"", ()) for shard, f in shards), (index, None, data, ())]


def safetensors_index(
    shards: Sequence[tuple[str, ModelFile]], tensor_names: TensorNames
) -> bytes | None:
    """`model.safetensors.index.json` of these shards (file name, tensor blob); None when a
    shard's header cannot be read. `Deferred` from `tensor_names` goes through."""
    weight_map: dict[str, str] = {}
    total = 0
    for shard, f in shards:
        read = tensor_names(f)
        if read is None:
            return None
        names, size = read
        total += size
        for t in names:
            weight_map.setdefault(t, shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2).encode() + b"\n"


def layout_files(
    layout: str, models: Sequence[ToolModel], tensor_names: TensorNames
) -> list[ToolFile]:
    """The files of `layout` (one of LAYOUTS)."""
    if layout == "lmstudio":
        return lmstudio_layout(models)
    if layout == "hf":
        return hf_layout(models, tensor_names)
    raise ValueError(f"unknown layout {layout!r}")


def blob_tensor_names(
    index: StoreIndex, known: dict[Digest, tuple[list[str], int] | None] | None = None
) -> TensorNames:
    """A TensorNames reading each tensor blob's header once (blobs never change); `known`
    keeps what it read for later calls (a mount's rebuilds)."""
    known = {} if known is None else known

    def read(f: ModelFile) -> tuple[list[str], int] | None:
        digest = f.layer.digest
        if digest not in known:
            try:
                header = read_safetensors_header_path(index.layout.blob(digest))
                known[digest] = ([t.name for t in header.tensors], header.data_size)
            except (OSError, StoreError):
                known[digest] = None
        return known[digest]

    return read
