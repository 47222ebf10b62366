"""Every ```console block of README.md and docs/*.md, run as written (docs/architecture.md, "The
docs are tested"), and the README's length.

A block is a list of `$ ` commands, each followed by what it prints. The HTML comment right above
a block says what it needs (`<!-- console: store=demo mount=/mnt/models peer=URL port=N -->`;
`artifacts=docker-model|modelpack` puts tests/artifacts.py's example in the first registry);
the runner makes it real (a copy of the demo store in a home of the block's own, a FUSE mount, a
`modelfs serve` or `docker-registry` on loopback, a free port) and stands its paths and addresses
in for the ones the block names, both ways. `MODELFS_DOCS_UPDATE=1` writes what the commands
print back into the pages, keeping every `…` that still matches.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from modelfs.store.index import indexfile
from tests.artifacts import seed
from tests.mounting import force_unmount, fuse
from tests.processes import stop
from tests.registry import DOCKER_REGISTRY, free_port, running_registry

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
MODELFS = str(BIN / "modelfs")
UPDATE = os.environ.get("MODELFS_DOCS_UPDATE") == "1"
ELLIPSIS = "…"
MARK = "\x1edocs-command "
NOT_READY = 97  # the exit status of a block whose background command never became ready

README_MAX_LINES = 250
LINE_MAX = 200


# -- parsing --------------------------------------------------------------------------------------
@dataclass
class Command:
    text: str  # what bash runs, continuation lines included
    source: list[str]  # the page's lines for it
    expected: list[str]


@dataclass
class Block:
    page: Path
    index: int  # among the page's console blocks
    start: int  # index of the first line inside the fence
    options: dict[str, list[str]]
    commands: list[Command]
    files: dict[str, str] = field(default_factory=dict)  # earlier `file:` blocks of the page

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.start}"


_DIRECTIVE = re.compile(r"^<!-- (console|file):(.*)-->\s*$")


def parse_commands(body: list[str]) -> list[Command]:
    commands: list[Command] = []
    i = 0
    while i < len(body):
        line = body[i]
        if not line.startswith("$ "):
            raise AssertionError(f"a console block must start with `$ `: {line!r}")
        text, source = line[2:], [line]
        i += 1
        # `\` at the end of a line, or `> ` lines (bash's PS2) right after it, continue it.
        while i < len(body) and (text.endswith("\\") or body[i].startswith("> ")):
            nxt = body[i][2:] if body[i].startswith("> ") else body[i]
            text = f"{text}\n{nxt}"
            source.append(body[i])
            i += 1
        expected = []
        while i < len(body) and not body[i].startswith("$ "):
            expected.append(body[i])
            i += 1
        commands.append(Command(text, source, expected))
    return commands


def parse(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    blocks: list[Block] = []
    files: dict[str, str] = {}
    i = 0
    while i < len(lines):
        fence = lines[i]
        if not fence.startswith("```"):
            i += 1
            continue
        end = lines.index("```", i + 1)
        body = lines[i + 1 : end]
        above = _DIRECTIVE.match(lines[i - 1]) if i else None
        if above and above.group(1) == "file":
            files[above.group(2).strip()] = "\n".join(body) + "\n"
        elif fence == "```console":
            options: dict[str, list[str]] = {}
            if above and above.group(1) == "console":
                for word in above.group(2).split():
                    key, _, value = word.partition("=")
                    options.setdefault(key, []).append(value)
            commands = parse_commands(body)
            blocks.append(Block(page, len(blocks), i + 1, options, commands, dict(files)))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in parse(page)]


# -- comparing ------------------------------------------------------------------------------------
_VOLATILE = [
    # relative times and durations: "2 hours ago", "12s ago", "up 12s", "in 2.1 s", "1.2 MB/s"
    (re.compile(r"\b(?:just now|never|less than a second ago)\b", re.I), "<ago>"),
    (re.compile(r"\b(?:an?|\d+) (?:second|minute|hour|day|week|month|year)s? ago\b"), "<ago>"),
    (re.compile(r"\b[A-Z][a-z]{2} +\d{1,2} +(?:\d\d:\d\d|\d{4})\b"), "<date>"),  # ls -l
    (re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?"), "<time>"),
    (re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|µs|s|m|h|d)\b"), "<dur>"),
    (re.compile(r"\b\d+(?:\.\d+)? ?[kKMG]?B/s\b"), "<rate>"),
    (re.compile(r"/tmp/[^\s'\",:)]+"), "<tmp>"),
]


def normal(line: str) -> str:
    for pattern, token in _VOLATILE:
        line = pattern.sub(token, line)
    return re.sub(r" +", " ", line.rstrip())


def line_pattern(expected: str) -> re.Pattern[str]:
    parts = [re.escape(normal(p)) for p in expected.split(ELLIPSIS)]
    return re.compile(".*".join(parts), re.S)


def align(expected: list[str], actual: list[str], strict: bool) -> list[list[int]] | None:
    """For each expected line, the actual lines it stands for; None if nothing fits.

    A line `…` takes any number of lines, any other exactly one. Strict: that line must match.
    Otherwise (update mode) the alignment with the fewest mismatched lines wins."""
    normalized = [normal(a) for a in actual]
    patterns = [None if e.strip() == ELLIPSIS else line_pattern(e) for e in expected]
    memo: dict[tuple[int, int], tuple[int, list[list[int]]] | None] = {}

    def best(i: int, j: int) -> tuple[int, list[list[int]]] | None:
        if (i, j) in memo:
            return memo[(i, j)]
        result: tuple[int, list[list[int]]] | None = None
        if i == len(expected):
            result = (0, []) if j == len(actual) else None
        elif patterns[i] is None:
            for k in range(j, len(actual) + 1):
                rest = best(i + 1, k)
                if rest is not None and (result is None or rest[0] < result[0]):
                    result = (rest[0], [list(range(j, k)), *rest[1]])
                    if rest[0] == 0:
                        break
        elif j < len(actual):
            pattern = patterns[i]
            assert pattern is not None
            miss = 0 if pattern.fullmatch(normalized[j]) else 1
            if not (miss and strict):
                rest = best(i + 1, j + 1)
                if rest is not None:
                    result = (rest[0] + miss, [[j], *rest[1]])
        memo[(i, j)] = result
        return result

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * (len(expected) + len(actual)) + 1000))
    found = best(0, 0)
    return None if found is None else found[1]


def refreshed(expected: list[str], actual: list[str]) -> list[str]:
    """The expected lines rewritten from `actual`, keeping each line that still fits (a `…`,
    another relative time), so that a refresh changes only what did change."""
    spans = align(expected, actual, strict=False)
    if spans is None:
        return actual
    out: list[str] = []
    for line, span in zip(expected, spans, strict=True):
        kept = (
            line.strip() == ELLIPSIS
            or line_pattern(line).fullmatch(normal(actual[span[0]])) is not None
        )
        out.append(line if kept else actual[span[0]])
    return out


# -- running --------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo store, built once: it is deterministic, so every block starts from a copy."""
    root = tmp_path_factory.mktemp("docs-demo") / "models"
    subprocess.run([MODELFS, "demo-store", str(root)], check=True, capture_output=True, timeout=300)
    return root


def _env(home: Path, host: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_MODELS", "MODELFS_STORE")}
    env.update(
        HOME=str(home),
        PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        LC_ALL="C.UTF-8",
        PYTHONUNBUFFERED="1",
        COLUMNS="200",
        # hosts are named as the page names them, not after this machine
        MODELFS_HOST_ID=host,
    )
    env.pop("DOCKER_CONFIG", None)
    return env


@contextmanager
def _process(args: list[str], env: dict[str, str], log: Path, ready: str) -> Iterator[None]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while ready not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield
    finally:
        stop(proc)


@functools.cache
def _can_name_hosts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0


def _as_host(host: str, args: list[str]) -> list[str]:
    """`args` run on a host of that name: a UTS namespace with its own hostname, where the
    tests run as root, so that what modelfs prints of its host (a GC report, a server's
    `service`, a peer's host id) is what the page shows; MODELFS_HOST_ID covers the rest."""
    if not _can_name_hosts():
        return args
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *args]


def _netloc(url: str) -> str:
    return urlsplit(url).netloc or url


# What a background command waits for before the next command runs: a mount to be mounted, a
# server to listen, a sync daemon to be in step with its peers and to have collected once.
_WAITER = r"""
import json, os, shlex, subprocess, sys, time
kind, log, pid, command = sys.argv[1:5]
args = shlex.split(command)
deadline = time.monotonic() + 40
def done():
    if kind == "mount":
        return os.path.ismount(args[-1])
    if kind != "sync":
        return "listening on" in open(log, errors="replace").read()
    # a daemon (whose log the block may send elsewhere): its status, once it answers
    config = args[args.index("--config") + 1]
    r = subprocess.run(["modelfs", "status", "--json", "--config", config],
                       capture_output=True, text=True)
    if r.returncode:
        return False
    d = json.loads(r.stdout).get("daemon") or {}
    return (d.get("rounds", 0) >= 2 and not d.get("transfers") and not d.get("behind")
            and (d.get("gc") or {}).get("last") is not None)
def gone():
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True
while not done():
    if gone() or time.monotonic() > deadline:
        sys.exit(f"docs runner: {command!r} not ready: " + open(log, errors="replace").read())
    time.sleep(0.1)
"""


def script(block: Block, subs: list[tuple[str, str]], workdir: Path) -> str:
    lines = [
        "cd ~",
        "__bg=()",
        "trap 'for p in \"${__bg[@]}\"; do kill -TERM $p 2>/dev/null; done; wait' EXIT",
    ]
    for n, command in enumerate(block.commands):
        text = forward(command.text, subs)
        lines.append(f"printf '{MARK}{n}\\n'")
        stripped = text.rstrip()
        if stripped.endswith("&") and not stripped.endswith("&&"):
            body = stripped[:-1].rstrip()
            log = workdir / f"background-{n}.log"
            kind = (
                "mount"
                if re.match(r"modelfs( .*)? mount ", body + " ")
                else "sync"
                if re.match(r"modelfs( .*)? sync ", body + " ")
                else "listen"
            )
            # exec, so that the EXIT trap's SIGTERM reaches modelfs itself
            simple = not re.search(r"[|;&]", body)
            lines.append(f"{{ {'exec ' if simple else ''}{body}\n}} >{log} 2>&1 &")
            lines.append("__bg+=($!)")
            lines.append(
                f"{sys.executable} {workdir / 'waiter.py'} {kind} {log} $! {shlex.quote(body)} >&2"
                f" || exit {NOT_READY}"
            )
        else:
            lines.append(text)
    return "\n".join(lines) + "\n"


def forward(text: str, subs: list[tuple[str, str]]) -> str:
    for doc, real in sorted(subs, key=lambda s: -len(s[0])):
        text = text.replace(doc, real)
    return text


def backward(text: str, subs: list[tuple[str, str]]) -> str:
    for doc, real in sorted(subs, key=lambda s: -len(s[1])):
        text = text.replace(real, doc)
    return text


def run_block(block: Block, tmp: Path, demo: Path) -> list[list[str]]:
    """Run the block; what each command printed, in the page's words."""
    home = tmp / "home"
    home.mkdir()
    store = home / ".ollama" / "models"
    option = block.options
    env = _env(home, (option.get("host") or ["laptop"])[0])
    kind = (option.get("store") or ["demo"])[0]
    if kind == "demo":
        shutil.copytree(demo, store, symlinks=True)
        if any("verify --quick" in c.text for c in block.commands):
            # A blob changed within 2 s of its check gets no verify cache entry (the racy
            # margin, indexfile.RACY_NS): a block that builds on the cache waits out the copy,
            # as a store does that was not made a moment ago.
            time.sleep(indexfile.RACY_NS / 1e9)
    elif kind == "empty":
        store.mkdir(parents=True)
    else:
        assert kind == "none", f"store={kind}"
    subs: list[tuple[str, str]] = [(doc, str(store)) for doc in option.get("storepath", [])]
    with ExitStack() as stack:
        for port in option.get("port", []):
            real = str(free_port())
            subs += [(f"{host}:{port}", f"{host}:{real}") for host in ("127.0.0.1", "0.0.0.0")]
            subs.append((f"localhost:{port}", f"localhost:{real}"))
        token_args: list[str] = []
        for doc in option.get("token", []):
            path = home / doc.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(secrets.token_urlsafe(24) + "\n")
            subs.append((doc, str(path)))
            token_args = ["--token-file", str(path)]
        for n, url in enumerate(option.get("peer", [])):
            peer_store = tmp / f"peer-{n}"
            shutil.copytree(demo, peer_store, symlinks=True)
            address = f"127.0.0.1:{free_port()}"
            stack.enter_context(
                _process(
                    _as_host(
                        urlsplit(url).hostname or "peer",
                        [
                            MODELFS,
                            "serve",
                            "--store",
                            str(peer_store),
                            "--listen",
                            address,
                            *token_args,
                        ],
                    ),
                    _env(tmp, urlsplit(url).hostname or "peer"),
                    tmp / f"peer-{n}.log",
                    "listening on",
                )
            )
            subs.append((_netloc(url), address))
        for n, url in enumerate(option.get("registry", [])):
            if not os.access(DOCKER_REGISTRY, os.X_OK):
                pytest.skip(f"needs {DOCKER_REGISTRY}")
            registry = stack.enter_context(running_registry(tmp / f"registry-{n}"))
            subs.append((_netloc(url), registry.address))
            for kind in option.get("artifacts", []) if n == 0 else []:
                seed(registry, tmp, kind, demo)  # what another tool pushed there
        subs += [(n, str(home / n.lstrip("/"))) for n in block.files if n.startswith("/")]
        for name, text in block.files.items():
            path = home / name.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(forward(text, subs))
        mounts = option.get("mount", [])
        for n, doc in enumerate(mounts):
            mnt = tmp / f"mnt{n}"
            mnt.mkdir()
            subs.append((doc, str(mnt)))
            stack.callback(force_unmount, mnt)
            if not any("modelfs mount" in c.text for c in block.commands):
                stack.enter_context(_mounted(store, mnt, env, tmp / f"mount-{n}.log"))
        (tmp / "waiter.py").write_text(_WAITER)
        done = subprocess.run(
            _as_host(env["MODELFS_HOST_ID"], ["bash", "-c", script(block, subs, tmp)]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            timeout=120,
        )
    output = done.stdout.decode(errors="replace").replace("\r\n", "\n")  # HTTP headers
    if done.returncode == NOT_READY:
        pytest.fail(f"{block.id}: a background command never became ready:\n{output}")
    parts = re.split(re.escape(MARK) + r"(\d+)\n", output)
    assert not parts[0].strip(), f"before the first command: {parts[0]}"
    printed: list[list[str]] = [[] for _ in block.commands]
    for number, text in zip(parts[1::2], parts[2::2], strict=True):
        text = backward(text, subs)
        text = text.replace(str(home), "~")
        printed[int(number)] = text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")
        if printed[int(number)] == [""]:
            printed[int(number)] = []
    return printed


@contextmanager
def _mounted(store: Path, mnt: Path, env: dict[str, str], log: Path) -> Iterator[None]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [MODELFS, "mount", "--store", str(store), str(mnt)], stdout=out, stderr=out, env=env
        )
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield
    finally:
        stop(proc)


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    mounts = "mount" in block.options or any("modelfs mount" in c.text for c in block.commands)
    return [fuse] if mounts else []


def _write_back(block: Block, printed: list[list[str]]) -> None:
    lines = block.page.read_text().split("\n")
    body: list[str] = []
    for command, out in zip(block.commands, printed, strict=True):
        body += [*command.source, *refreshed(command.expected, out)]
    end = lines.index("```", block.start)
    lines[block.start : end] = body
    block.page.write_text("\n".join(lines))


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=_marks(b)) for b in BLOCKS])
def test_console_block(block: Block, tmp_path: Path, demo_store: Path) -> None:
    printed = run_block(block, tmp_path, demo_store)
    if UPDATE:
        # Re-read the page: an earlier block's update may have moved this one.
        _write_back(parse(block.page)[block.index], printed)
        return
    for command, out in zip(block.commands, printed, strict=True):
        if align(command.expected, out, strict=True) is None:
            want = "\n".join(command.expected)
            got = "\n".join(out)
            pytest.fail(
                f"{block.id}: `{command.text}` printed\n{got}\n--- where the page says\n{want}"
            )


def test_the_readme_is_short_and_no_line_is_long() -> None:
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines"
    assert readme[2:6] == [
        "```sh",
        "scripts/run     # set up, then mount the local Ollama store by name at /mnt/models "
        "(or a demo store)",
        "scripts/test    # set up, then run every test",
        "```",
    ], "the README starts with the two commands"
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert len(line) <= LINE_MAX, f"{page.relative_to(REPO)}:{n}: {len(line)} characters"


def test_every_block_has_commands_and_every_page_is_linked() -> None:
    readme = (REPO / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"the README links docs/{page.name}"
    assert BLOCKS and all(b.commands for b in BLOCKS)
    for page in PAGES:  # an indented fence would be skipped, so there is none
        assert not re.search(r"^[ \t]+```console", page.read_text(), re.M), page
    for b in BLOCKS:
        unknown = set(b.options) - {
            "store",
            "storepath",
            "mount",
            "peer",
            "registry",
            "port",
            "host",
            "token",
            "artifacts",
        }
        assert not unknown, (b.id, unknown)


def test_the_comparison_can_fail() -> None:
    """The runner's matcher: `…` elides, times may differ, anything else must be equal."""
    assert align(["a", "…", "d"], ["a", "b", "c", "d"], strict=True) is not None
    assert align(["x 2 hours ago  ok"], ["x 3 seconds ago ok"], strict=True) is not None
    assert align(["Less than a second ago"], ["1 second ago"], strict=True) is not None
    assert align(["id 3f0c…  17 GB"], ["id 3f0c8a1e  17 GB"], strict=True) is not None
    assert align(["id 3f0c8a1e 17 GB"], ["id 3f0c8a1f 17 GB"], strict=True) is None
    assert align(["a", "b"], ["a"], strict=True) is None
    assert align(["a"], ["a", "b"], strict=True) is None
    assert refreshed(["id …", "size 1"], ["id 9", "size 2"]) == ["id …", "size 2"]
    assert refreshed(["…", "last"], ["x", "y", "new"]) == ["…", "new"]
    assert refreshed(["a 2 hours ago", "b"], ["a 1 second ago", "c"]) == ["a 2 hours ago", "c"]
