"""The `modelfs` command: argument parsing, logging, and the one place errors become exits.

User errors print one line `modelfs: error: …` and exit 1; usage errors exit 2 (argparse);
nothing the user can cause prints a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from modelfs.cli.commands import (
    DEFAULT_STATUS_URL,
    GC_BUSY,
    USER_ERRORS,
    cmd_build_passthrough,
    cmd_demo_store,
    cmd_diff,
    cmd_gc,
    cmd_link,
    cmd_ls,
    cmd_mount,
    cmd_pull,
    cmd_push,
    cmd_serve,
    cmd_show,
    cmd_status,
    cmd_sync,
    cmd_umount,
    cmd_verify,
    one_line,
)
from modelfs.store.scan import DEFAULT_PREFER
from modelfs.store.units import parse_duration


def _prefer(text: str) -> tuple[str, ...]:
    runners = tuple(r.strip().lower() for r in text.split(",") if r.strip())
    if not runners:
        raise argparse.ArgumentTypeError("expected a comma-separated list of runners")
    return runners


def _add_prefer(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--prefer", type=_prefer, default=DEFAULT_PREFER, metavar="RUNNERS", help=help)


def _seconds(text: str) -> float:
    """`90s`, `10m`, `1h`, `7d`, or plain seconds; zero or more."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str) -> float:
    """A positive duration (a timeout)."""
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration: {text!r}")
    return value


# --help; the README's daemon section says the same.
STATUS_WORDS = """\
What the words mean:
  peers:
    ok          its last listing succeeded (with a token_file: and it proved it holds
                the shared token; with a pin: and its certificate matched)
    DOWN        its last listing failed (unreachable, refused, a bad answer): the reason
                follows; its versions are not used until it answers again
    UNTRUSTED   it is not the peer the config names: no proof of the shared token,
                it refuses our proof of the token (401: another token, or an older
                modelfs), or its TLS certificate does not match its `pin`; nothing it
                lists is used
    listed ...  when its last listing succeeded ("never": not yet)
  peers are named by host id (as their answers give it) with their URL
  models (one column per peer; HERE is the tag's ID here, as `ls` and `show` give it,
  `-` when absent):
    same        the peer has the digest this host has
    <ID>        the peer has another version, by its ID (12 hex digits)
    listed      the peer has the name, but `replicate` does not select it, so its
                digest was not asked for (nothing to compare)
    -           the peer does not have the name
  below:
    pulling     a transfer in flight: from which peers, since when, bytes so far
    waiting     a transfer waiting for one of the `max_transfers` slots
    behind      a selected name whose version here is not the peers' (or lacks the
                variant `prefer` ranks first), for how long, why, the last error, the
                next try
"""


VERIFY_EPILOG = """\
Exit status: 0 when every blob matches its name and every manifest is readable and has all its
blobs (after any repair); 1 when a blob is corrupt or unreadable, a manifest names a missing
blob or a blob of the wrong size, or a manifest is unreadable. Orphaned blobs, stray files and
`sha256:`-named blobs are reported but alone do not fail the run: they cost disk space, not
models (`modelfs gc` reclaims orphans, except those it keeps for now, each with the reason: tag
history, a live lease, younger than the grace; the fix for a misnamed blob is printed).

Corrupt blobs are moved to <store>/.modelfs/quarantine/ and are then no longer served by a mount
or `modelfs serve`. With --repair-from, each corrupt or missing blob is fetched again from the
peers, verified, and its quarantined copy deleted.

Cache: <store>/.modelfs/verify/cache records, for each blob that passed a full check, its
stat stamp (inode, size, mtime, ctime) and, for a blob of 1 MiB or more, the xxh3 of a sample of
16 pieces of it (at most a 16th). A full run hashes every blob with sha256, reading every byte.
--quick passes a blob whose stamp matches the cache (and whose sample still hashes the same)
and fully checks the rest. ctime cannot be set back, so any write to a blob through the
filesystem, even with its mtime restored, is caught; damage below the filesystem (a failing
disk returning other bytes) is caught by --quick only where it hits the sample: run a full
verify for that now and then.
"""


def _login_arguments(p: argparse.ArgumentParser, token_help: str) -> None:
    """`--token-file`, `--username`, `--password-stdin`: for commands that speak to registries
    (without any, docker's credentials are used for registries that ask)."""
    p.add_argument("--token-file", metavar="F", type=Path, help=token_help)
    p.add_argument(
        "--username",
        metavar="USER",
        help="sign in to the registry as USER (with --password-stdin); default: the "
        "credentials of `docker login` ($DOCKER_CONFIG/config.json, ~/.docker/config.json)",
    )
    p.add_argument(
        "--password-stdin",
        action="store_true",
        help="read the password (or an access token) for --username from stdin",
    )


def _peer_arguments(p: argparse.ArgumentParser, token_help: str) -> None:
    """`--token-file` (and the other sign-ins) and `--timeout`, for commands that fetch."""
    _login_arguments(p, token_help)
    p.add_argument(
        "--timeout",
        type=_duration,
        default=30.0,
        metavar="DURATION",
        help="give up on a peer that sends nothing for this long (default: 30s)",
    )


def _version() -> str:
    """The installed distribution's version: what pip put there, so a venv answers for itself;
    run from a git checkout (an editable install), also the commit, since the version alone
    does not say which code that is."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("modelfs")
    except PackageNotFoundError:  # run from a checkout that was never installed
        installed = "(not installed)"
    return installed + _checkout_commit()


def _checkout_commit() -> str:
    """` (git 58bcabe41f2a)` (`-dirty` with uncommitted changes) when this package's source is
    a git checkout's work tree; "" for an installed copy, or where git cannot say."""
    import subprocess

    top = Path(__file__).resolve().parents[2]
    if not (top / ".git").exists():
        return ""
    try:
        done = subprocess.run(
            ["git", "-C", str(top), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    commit = done.stdout.strip()
    return f" (git {commit})" if done.returncode == 0 and commit else ""


class _VersionAction(argparse.Action):
    """`--version`, worked out only when asked (it may run git)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help="print the version")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"modelfs {_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--store",
        metavar="DIR",
        type=Path,
        help="the Ollama model store (default: $OLLAMA_MODELS, ~/.ollama/models, "
        "/usr/share/ollama/.ollama/models)",
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log more")
    common.add_argument("-q", "--quiet", action="store_true", help="log only errors")

    parser = argparse.ArgumentParser(
        prog="modelfs",
        description="Show an Ollama model store by name, and keep it in step across hosts.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", parents=[common], help="list models, like `ollama list`")
    p.add_argument("--json", action="store_true", help="print Ollama's /api/tags response")
    _add_prefer(p, "variant order for manifest lists (default: llamacpp,ggml,mlx)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", parents=[common], help="variants, layers, files, quantization")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_prefer(p, "variant of a manifest list to show first (default: llamacpp,ggml,mlx)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "diff",
        parents=[common],
        help="what changed between two versions of a model",
        description="Compare two models: blobs shared and only on one side (kind, size), "
        "quantization types, and the kind of change (identical, only accessories, new "
        "packaging, different quantization, fixed conversion, new weights). Each side is a "
        "tag, or a manifest digest (sha256:<hex>, or 12+ hex digits) found in the store or "
        "its tag history. B defaults to the version A replaced, from the tag history that "
        "`modelfs sync` keeps.",
    )
    p.add_argument("a", metavar="NAME_OR_DIGEST")
    p.add_argument("b", metavar="NAME_OR_DIGEST", nargs="?")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_prefer(p, "variant of a manifest list to compare (default: llamacpp,ggml,mlx)")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("mount", parents=[common], help="show the store by name at MOUNTPOINT")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path)
    p.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    _add_prefer(p, "variant shown at a plain tag (default: llamacpp,ggml,mlx)")
    p.add_argument(
        "--data",
        choices=("fuse", "symlink"),
        default="fuse",
        help="serve blob-backed files (fuse) or link them to the blobs (symlink)",
    )
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser(
        "link",
        parents=[common],
        help="write an LM Studio or Hugging Face layout of the store as symlinks",
        description="Write the layout the mount shows at .lmstudio/ (lmstudio) or "
        ".huggingface/hub/ (hf) into DIR as symlinks into the store's blobs, for a machine "
        "without FUSE. Run it again to bring DIR up to date: new models are linked, removed "
        "ones unlinked, and nothing this command did not write is touched.",
    )
    p.add_argument("--layout", choices=("lmstudio", "hf"), required=True)
    p.add_argument("dir", metavar="DIR", type=Path)
    _add_prefer(p, "variant of a manifest list to link (default: llamacpp,ggml,mlx)")
    p.set_defaults(func=cmd_link)

    p = sub.add_parser(
        "build-passthrough",
        help="build FUSE passthrough (libfuse 3.17, a patched pyfuse3) into this environment",
        add_help=False,
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_build_passthrough)

    p = sub.add_parser("umount", parents=[common], help="unmount a modelfs mount")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path)
    p.set_defaults(func=cmd_umount)

    p = sub.add_parser(
        "serve", parents=[common], help="serve the store over the OCI distribution API"
    )
    p.add_argument(
        "--listen",
        metavar="ADDR:PORT",
        help="where to listen (default: 127.0.0.1:11500; 0.0.0.0:11500 with a token or keys)",
    )
    p.add_argument(
        "--token-file",
        metavar="F",
        type=Path,
        help="require `Authorization: Bearer <token>`; without it only loopback is served",
    )
    p.add_argument(
        "--authorized-keys",
        metavar="F",
        type=Path,
        help="let Ollama hosts whose key (~/.ollama/id_ed25519.pub) is a line of F sign in",
    )
    p.add_argument("--tls-cert", metavar="F", type=Path, help="serve HTTPS with this certificate")
    p.add_argument("--tls-key", metavar="F", type=Path, help="the certificate's private key")
    p.add_argument(
        "--public-url",
        metavar="URL",
        action="append",
        default=[],
        help="a URL clients reach this server by besides its hostname, listen address and "
        "certificate names (a reverse proxy, a port forward): Ollama sign-ins signed for "
        "any other count for nothing; repeat for several",
    )
    p.add_argument(
        "--print-pin",
        action="store_true",
        help="print the --tls-cert's pin (sha256:<hex of its public key>) for peers' "
        "`pin`, and exit",
    )
    p.add_argument(
        "--mirror",
        metavar="URL",
        help="a pull-through cache of this registry: what the store lacks is fetched from it "
        "(signing in with docker's credentials), verified, kept, and fetched once",
    )
    p.add_argument(
        "--mirror-ttl",
        metavar="DURATION",
        type=_seconds,
        help="how long a tag's manifest is served before the registry is asked again (default: 5m)",
    )
    _add_prefer(
        p,
        "child of a manifest list served to clients that do not take lists "
        "(default: llamacpp,ggml,mlx)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("push", parents=[common], help="push models to an OCI registry")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--to", required=True, metavar="URL", help="the registry, http(s)://HOST:PORT")
    p.add_argument("--json", action="store_true", help="progress as NDJSON lines")
    p.add_argument(
        "--format",
        choices=("ollama", "docker-model", "modelpack"),
        default="ollama",
        help="push as an Ollama model (default), a Docker Model Runner or a ModelPack artifact",
    )
    _login_arguments(p, "a bearer token, or user:password for a registry with basic auth")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", parents=[common], help="fetch models from peers, verified")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument(
        "--from",
        dest="sources",
        action="append",
        required=True,
        metavar="URL",
        help="a peer (modelfs serve, or an OCI registry); several are tried in order",
    )
    p.add_argument("--all-variants", action="store_true", help="every child of a manifest list")
    _add_prefer(p, "which child of a manifest list to fetch (default: llamacpp,ggml,mlx)")
    p.add_argument("--json", action="store_true", help="progress as NDJSON (Ollama's /api/pull)")
    _peer_arguments(p, "a bearer token, or user:password for a registry with basic auth")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser(
        "verify",
        parents=[common],
        help="check every blob against its sha256; quarantine and repair corrupt ones",
        description="Check every blob of the store against its name (sha256), on every core, "
        "and report corrupt, unreadable, missing, orphaned, stray and misnamed files.",
        epilog=VERIFY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="trust blobs whose stat stamp (and sample) match their last full check",
    )
    p.add_argument(
        "--repair-from",
        action="append",
        metavar="URL",
        help="fetch corrupt and missing blobs again from this peer (repeatable; tried in order)",
    )
    _peer_arguments(p, "a bearer token, or user:password, for the --repair-from peers")
    p.add_argument("--json", action="store_true", help="print the report as one JSON document")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "gc",
        parents=[common],
        help="delete blobs no manifest or lease needs, safely on a shared store",
        description="Delete blobs that no manifest (in any form) and no live lease of any host "
        "needs. A blob goes only after two runs at least the grace apart found it unneeded, "
        "and first into .modelfs/trash/, emptied after the trash retention; a trashed blob "
        "that a manifest, link, list or lease names again is put back first thing in a run. "
        "Nothing is deleted while any manifest or lease cannot be read. On a shared store the "
        "filesystem must give close-to-open consistency (NFS does), and the grace must outlast "
        "every client's directory and attribute cache. One GC at a time across hosts: when "
        f"another holds the lock, it says so and exits {GC_BUSY} (EX_TEMPFAIL).",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")
    p.add_argument(
        "--grace",
        type=_seconds,
        default=3600.0,
        metavar="D",
        help="keep blobs younger than D, and wait D between the two sightings (default 1h; "
        "at least 10m, which outlasts network filesystems' client caches)",
    )
    p.add_argument(
        "--grace-below-floor",
        action="store_true",
        help="allow a --grace under 10m. The risk: on a store shared over NFS or sshfs, a host "
        "whose client cache still hides a manifest another host just wrote may move that "
        "model's blobs to the trash. Only where every host sees the store uncached (one host, "
        "or sshfs -o cache=no)",
    )
    p.add_argument(
        "--partial-grace",
        type=_seconds,
        default=7 * 86400.0,
        metavar="D",
        help="keep anyone's temp and partial downloads younger than D (default 7d)",
    )
    p.add_argument(
        "--trash-retention",
        type=_seconds,
        default=86400.0,
        metavar="D",
        help="unlink trashed blobs after D (default 24h)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "sync",
        parents=[common],
        help="the daemon: serve, replicate, lease, collect (run by systemd)",
        description="Serve the store, replicate the names `replicate` selects from the peers, "
        "keep this host's lease, and run GC on schedule, until SIGTERM. SIGHUP reloads the "
        "config. Speaks systemd's notify protocol (READY, STATUS, WATCHDOG, STOPPING).",
    )
    p.add_argument("--config", required=True, type=Path, metavar="FILE", help="the TOML config")
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser(
        "status",
        parents=[common],
        help="this host's sync daemon and its peers: models, transfers, last GC",
        epilog=STATUS_WORDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the daemon's TOML config, for its address (`listen`) and token (`token_file`) "
        "(default: /etc/modelfs/config.toml, when it exists)",
    )
    p.add_argument(
        "--url",
        help=f"the daemon to ask (default: from the config, else {DEFAULT_STATUS_URL})",
    )
    p.add_argument(
        "--token-file", type=Path, metavar="F", help="its bearer token (default: the config's)"
    )
    p.add_argument("--json", action="store_true", help="print the daemon's status JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("demo-store", parents=[common], help="write a demo store into DIR")
    p.add_argument("dir", metavar="DIR", type=Path)
    p.add_argument("--size", help="size of the main model blob, e.g. 1G (default: small)")
    p.set_defaults(func=cmd_demo_store)
    return parser


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is when a record is emitted, not when it was made.

    `run()` may be called more than once in a process (tests, the demo); a handler bound to
    the stderr of the first call would write the later calls' logs to a stale stream.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def _to_journal() -> bool:
    """Is stderr the journal's stream (systemd sets $JOURNAL_STREAM to its `dev:ino`)?"""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


_SYSLOG_PRIORITY = {"CRITICAL": 2, "ERROR": 3, "WARNING": 4, "INFO": 6, "DEBUG": 7}


class _JournalFormatter(logging.Formatter):
    """`<N>` before each line: the journal stores it as the priority (errors show red in
    `journalctl`); the unit's name already says it is modelfs."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{_SYSLOG_PRIORITY.get(record.levelname, 6)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def _setup_logging(args: argparse.Namespace) -> None:
    level = logging.INFO
    if getattr(args, "verbose", False):
        level = logging.DEBUG
    elif getattr(args, "quiet", False):
        level = logging.ERROR
    # Not logging.basicConfig: it does nothing once the root logger has a handler (a second
    # run() in one process, or pytest's log capture), so the store root would go unlogged.
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    handler = _StderrHandler()
    # No timestamps of our own: a terminal does not need them and the journal adds its own.
    handler.setFormatter(
        _JournalFormatter("%(message)s")
        if _to_journal()
        else logging.Formatter("modelfs: %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(level)
    # httpx logs a line per request at INFO; that is debugging detail here.
    logging.getLogger("httpx").setLevel(
        logging.DEBUG if level == logging.DEBUG else logging.WARNING
    )


def _error(text: str) -> None:
    """The one error line; marked as an error for the journal when that is where it goes."""
    prefix = "<3>" if _to_journal() else ""
    print(f"{prefix}modelfs: error: {one_line(text)}", file=sys.stderr)


def _os_error(exc: OSError) -> str:
    if exc.strerror and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    return exc.strerror or str(exc)


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build-passthrough"]:  # its own options, --help included
        args = argparse.Namespace(func=cmd_build_passthrough, rest=argv[1:], verbose=0, quiet=0)
        return cmd_build_passthrough(args)
    args = parser.parse_args(argv)
    _setup_logging(args)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        status = func(args)
        # Flush here, not at exit: a reader that went away (`modelfs ls | head -1`) must be
        # seen while BrokenPipeError can still be handled, or Python prints a traceback-like
        # "Exception ignored" and exits 120.
        sys.stdout.flush()
        return status
    except USER_ERRORS as exc:
        _error(str(exc))
        return 1
    except BrokenPipeError:
        # `modelfs ls | head` is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # An unreadable or unnamable store (EACCES, ENAMETOOLONG, EIO): the user's to fix.
        _error(_os_error(exc))
        return 1
    except KeyboardInterrupt:
        return 130


def main() -> None:
    sys.exit(run())
