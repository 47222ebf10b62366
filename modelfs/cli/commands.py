"""What each `modelfs` command does once its arguments are parsed (modelfs.cli.app parses them
and turns the errors these raise into exits): `cmd_<command>(args) -> exit status`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from modelfs.cli.human import go_text
from modelfs.fsd.errors import MountError
from modelfs.store.errors import StoreError
from modelfs.store.layout import Layout, find_store_root
from modelfs.store.scan import STRAY_KINDS, Problem, ScanCache, StoreIndex, scan_store
from modelfs.store.units import counted
from modelfs.sync.errors import SyncError

if TYPE_CHECKING:
    import ssl  # a tenth of the CLI's imports, for two annotations

    from modelfs.sync.client.credentials import Credentials

log = logging.getLogger("modelfs")


GC_BUSY = 75  # EX_TEMPFAIL: another GC holds the lock; try later (modelfs-gc.service allows it)
DEFAULT_STATUS_URL = "http://127.0.0.1:11500"  # the daemon's default `listen` port, on loopback


class UserError(Exception):
    """A mistake the user can fix; printed as one line."""


# Each layer's one base error, and the CLI's own: caught only in `run`, where each becomes
# one line `modelfs: error: …` and exit 1. A command catches one of these only to say more
# (which file, which setting), never to re-wrap it.
USER_ERRORS = (StoreError, SyncError, MountError, UserError)


def _problems_summary(problems: Sequence[Problem]) -> str | None:
    """One line for a command that reads the store: how many strays (in the word `verify`
    and `gc` use) and other problems, and the command that names them; None for none."""
    if not problems:
        return None
    strays = sum(p.kind in STRAY_KINDS for p in problems)
    others = len(problems) - strays
    said = [counted(strays, "stray file")] if strays else []
    if others:
        said.append(counted(others, "problem"))
    them = "it" if len(problems) == 1 else "them"
    return f"{' and '.join(said)} in the store; `modelfs verify` names {them}"


def _open_index(args: argparse.Namespace) -> StoreIndex:
    root = find_store_root(args.store)
    # The store's scan index (.modelfs/scan-index): only the tag files that changed are read.
    index = scan_store(root, ScanCache.open(Layout(root)))
    for problem in index.problems:
        log.debug("problem: %s", problem)
    summary = _problems_summary(index.problems)
    if summary is not None:
        log.info("%s", summary)
    return index


def _print(data: str | bytes) -> None:
    """One document and a newline on stdout, always UTF-8, whatever the locale says.

    Text from a store (a config's `file_type`, a layer's `name`) may hold a lone surrogate
    escape that Python's JSON decoder keeps and no encoder accepts; it prints as U+FFFD, which
    is what Go's decoder turns it into.
    """
    if isinstance(data, str):
        data = go_text(data).encode()
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(data.decode() + "\n")
        return
    sys.stdout.flush()
    buffer.write(data + b"\n")


def cmd_ls(args: argparse.Namespace) -> int:
    from modelfs.cli.ls import render_table, tags_json

    index = _open_index(args)
    if args.json:
        _print(tags_json(index, args.prefer))
    else:
        _print(render_table(index, args.prefer))
    if index.cache is not None:
        index.cache.save()  # with what the listing read from blobs (GGUF headers, templates)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from modelfs.cli.show import render, show_record

    index = _open_index(args)
    entry = index.lookup(args.name)
    record = show_record(index, entry, args.prefer)
    if args.json:
        _print(json.dumps(record, indent=2, ensure_ascii=False))
    else:
        _print(render(record))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from modelfs.cli.diff import render
    from modelfs.store.formats.diff import diff, resolve, resolve_previous
    from modelfs.store.history import TagHistory

    index = _open_index(args)
    history = TagHistory(index.layout)
    a = resolve(index, history, args.a, args.prefer)
    if args.b is None:
        b = resolve_previous(index, history, a, args.prefer)
    else:
        b = resolve(index, history, args.b, args.prefer)
    record = diff(index, history, a, b).as_json()
    if args.json:
        _print(json.dumps(record, indent=2, ensure_ascii=False))
    else:
        _print(render(record))
    return 0


def cmd_demo_store(args: argparse.Namespace) -> int:
    from modelfs.demo import main as demo_main

    argv = [str(args.dir)] + (["--size", args.size] if args.size else [])
    return demo_main(argv)


def cmd_mount(args: argparse.Namespace) -> int:
    from modelfs.fsd.mount import Mount

    root = find_store_root(args.store)
    Mount(
        root,
        args.mountpoint,
        prefer=args.prefer,
        data=args.data,
        allow_other=args.allow_other,
    ).run()
    return 0


def cmd_link(args: argparse.Namespace) -> int:
    from modelfs.store.tools.toollink import write_links
    from modelfs.store.tools.toolviews import blob_tensor_names, layout_files, tool_models

    index = _open_index(args)
    files = layout_files(args.layout, tool_models(index, args.prefer), blob_tensor_names(index))
    report = write_links(index.layout.blobs, files, args.dir, args.layout)
    for path in report.skipped:
        log.warning("%s: left alone (not written by modelfs link)", args.dir / path)
    log.info(
        "%s: %d added, %d updated, %d removed, %d unchanged",
        args.dir,
        len(report.added),
        len(report.updated),
        len(report.removed),
        report.unchanged,
    )
    return 0


def cmd_build_passthrough(args: argparse.Namespace) -> int:
    from modelfs.cli.build_passthrough import main as build_main

    return build_main(args.rest)


def cmd_umount(args: argparse.Namespace) -> int:
    from modelfs.fsd.mount import unmount

    unmount(args.mountpoint)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from modelfs.sync.registry.serve import print_pin, run_server

    if args.print_pin:
        if args.tls_cert is None:
            raise UserError("--print-pin needs --tls-cert FILE")
        _print(print_pin(args.tls_cert))
        return 0
    root = find_store_root(args.store)

    def ready(url: str) -> None:
        print(f"listening on {url}", flush=True)

    run_server(
        root,
        listen=args.listen,
        token_file=args.token_file,
        authorized_keys=args.authorized_keys,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        prefer=args.prefer,
        mirror=args.mirror,
        mirror_ttl=args.mirror_ttl,
        public_urls=args.public_url,
        ready=ready,
    )
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from modelfs.cli.push import run_push

    index = _open_index(args)
    credentials = _credentials(args)
    run_push(
        index, args.names, args.to, json_lines=args.json, credentials=credentials, fmt=args.format
    )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from modelfs.cli.gcreport import render_gc
    from modelfs.store.collect.gc import GcPolicy, grace_problem
    from modelfs.store.errors import LockBusyError
    from modelfs.sync.client.threads import run_unwrapped
    from modelfs.sync.daemon.gc import run_gc

    problem = grace_problem(args.grace, args.grace_below_floor, "--grace-below-floor")
    if problem is not None:
        raise UserError(problem)
    root = find_store_root(args.store)
    policy = GcPolicy(
        grace=args.grace,
        partial_grace=args.partial_grace,
        trash_retention=args.trash_retention,
        below_floor=args.grace_below_floor,
    )
    try:
        report = run_unwrapped(lambda: run_gc(Layout(root), policy, dry_run=args.dry_run))
    except LockBusyError as exc:
        # Another host's (or the daemon's) GC is at work: not a failure of this one.
        log.info("gc: skipped: %s", exc)
        return GC_BUSY
    if args.json:
        _print(json.dumps(report.as_json()))
    else:
        _print(render_gc(report))
    if report.refused:
        raise UserError(
            f"gc refused: {counted(len(report.refused), 'file')} cannot be read, so nothing was "
            f"deleted (first: {report.refused[0]})"
        )
    if report.aborted:
        raise UserError(f"gc stopped: {report.aborted}")
    if report.errors:
        raise UserError(
            f"gc: {counted(len(report.errors), 'step')} failed (first: {report.errors[0]})"
        )
    return 0


def _writable_root(explicit: Path | None) -> Path:
    """The store root; one is created where none is yet, as `ollama pull` does."""
    try:
        return find_store_root(explicit)
    except StoreError:
        env = os.environ.get("OLLAMA_MODELS", "").strip().strip("\"'")
        fresh = explicit or (Path(env) if env else Path.home() / ".ollama" / "models")
        if fresh.exists() and not fresh.is_dir():
            raise UserError(f"store {fresh} is not a directory") from None
        fresh.expanduser().mkdir(parents=True, exist_ok=True)
        return find_store_root(fresh)


def cmd_sync(args: argparse.Namespace) -> int:
    from modelfs.sync.client.credentials import CredentialsError, read_credentials
    from modelfs.sync.daemon.config import load_config
    from modelfs.sync.daemon.daemon import run_daemon

    config = load_config(args.config)
    root = _writable_root(args.store or config.store)
    try:
        read_credentials(config.token_file)
    except CredentialsError as exc:
        raise UserError(f"{config.path}: token_file: {exc}") from None
    if config.authorized_keys is not None:
        from modelfs.sync.wire.signin import AccessConfigError, AuthorizedKeys

        try:
            AuthorizedKeys(config.authorized_keys)
        except AccessConfigError as exc:
            raise UserError(f"{config.path}: authorized_keys: {exc}") from None
    if config.tls_cert is not None and config.tls_key is not None:
        from modelfs.sync.registry.serve import ServeError, check_tls

        try:
            check_tls(config.tls_cert, config.tls_key)
        except ServeError as exc:
            raise UserError(f"{config.path}: tls_cert, tls_key: {exc}") from None
    if config.token_file is None and config.peers:
        log.info("no token_file: peers must serve loopback clients without a token")
    run_daemon(config, Layout(root))
    return 0


def _own_certificate(tls_cert: Path) -> ssl.SSLContext | bool:
    """The daemon found through its config is trusted by its own certificate's pin (a
    self-signed one is no CA's); a certificate this user cannot read: the usual checks."""
    from modelfs.sync.wire.pins import pin_of_cert_file, pinned_context

    try:
        return pinned_context(pin_of_cert_file(tls_cert))
    except (OSError, ValueError):
        return True


def cmd_status(args: argparse.Namespace) -> int:
    from modelfs.cli.status import fetch_status, render_status

    url, token_file = args.url, args.token_file
    verify: ssl.SSLContext | bool = True
    if url is None or token_file is None:
        from modelfs.sync.daemon.config import DEFAULT_CONFIG, load_config

        # The daemon's own config says where it listens and which token it takes; without
        # one (no --config, nothing at the default path) the daemon's defaults are assumed.
        if args.config is not None or DEFAULT_CONFIG.exists():
            config = load_config(args.config or DEFAULT_CONFIG)
            if url is None and config.tls_cert is not None:
                verify = _own_certificate(config.tls_cert)
            url = url or config.local_url
            token_file = token_file or config.token_file
    status, error = fetch_status(url or DEFAULT_STATUS_URL, token_file, verify=verify)
    if args.json:
        _print(json.dumps(status if status is not None else {"error": error}))
    elif status is not None:
        _print(render_status(status))
    if error is not None:
        raise UserError(error)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from modelfs.cli.progress import BarProgress, JsonProgress, LineProgress
    from modelfs.sync.pull.options import PullOptions
    from modelfs.sync.pull.progress import Progress
    from modelfs.sync.pull.puller import run_pull

    sources = [u.rstrip("/") for u in args.sources]
    for url in sources:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--from {url!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
    credentials = _credentials(args)
    root = _writable_root(args.store)
    progress: Progress
    if args.json:
        progress = JsonProgress(sys.stdout)
    elif sys.stderr.isatty() and not args.quiet:
        progress = BarProgress(sys.stderr)
    else:
        progress = LineProgress(log)
    options = PullOptions(
        prefer=args.prefer, all_variants=args.all_variants, read_timeout=args.timeout
    )
    try:
        report = run_pull(
            root,
            args.names,
            sources,
            options=options,
            progress=progress,
            credentials=credentials,
        )
    except (StoreError, SyncError) as exc:
        progress.error(one_line(str(exc)))
        raise
    if report.failed:
        # Each failure was said as it happened; the summary says where the run ended.
        for result in report.models:
            log.warning("pulled:     %s", result.name)
        for _, failure in report.failed:
            log.warning("NOT pulled: %s", one_line(str(failure)))
        names = ", ".join(text for text, _ in report.failed)
        raise UserError(f"{len(report.failed)} of {len(args.names)} models not pulled: {names}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from modelfs.cli.verify import render
    from modelfs.sync.daemon.verify import VerifyOptions, run_verify

    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    sources = [u.rstrip("/") for u in args.repair_from or ()]
    for url in sources:
        if not url.startswith(("http://", "https://")):
            raise UserError(
                f"--repair-from {url!r}: expected http://HOST[:PORT] or https://HOST[:PORT]"
            )
    credentials = _credentials(args)
    root = find_store_root(args.store)
    options = VerifyOptions(
        quick=args.quick,
        repair_from=sources,
        credentials=credentials,
        read_timeout=args.timeout,
    )
    report = run_verify(root, options)
    if args.json:
        _print(json.dumps(report.as_json(), indent=2, ensure_ascii=False))
    else:
        _print(render(report))
    return 0 if report.ok else 1


# What each word `modelfs status` prints (cli/status.py render_status) means, for its
def _credentials(args: argparse.Namespace) -> Credentials | None:
    """The credentials given on the command line; None: docker's, for registries that ask."""
    from modelfs.sync.client.credentials import read_credentials, read_password

    if (args.username is None) != (not args.password_stdin):
        raise UserError("--username and --password-stdin go together")
    if args.username is not None:
        if args.token_file is not None:
            raise UserError("--token-file and --username: give one of them")
        return read_password(sys.stdin, args.username)
    token_file: Path | None = args.token_file
    return read_credentials(token_file)


def one_line(text: str) -> str:
    """An error message as one line, whatever a path or name in it contains."""
    return text.replace("\r", "\\r").replace("\n", "\\n")
