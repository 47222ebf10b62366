"""`modelfs status`: ask the local sync daemon, show this host and each peer."""

from __future__ import annotations

import ssl
import time
from pathlib import Path
from typing import Any

import httpx

from modelfs.cli.human import table
from modelfs.store.tagid import TagId, tag_ids
from modelfs.store.units import counted, human_bytes
from modelfs.sync.client.credentials import CredentialsError, read_credentials


def fetch_status(
    url: str, token_file: Path | None, *, verify: ssl.SSLContext | bool = True
) -> tuple[dict[str, Any] | None, str | None]:
    """(the daemon's /modelfs/v1/status, None) or (None, a one-line reason)."""
    headers = {}
    if token_file is not None:
        try:
            headers["Authorization"] = read_credentials(token_file).authorization
        except CredentialsError as exc:
            return None, str(exc)
    target = url.rstrip("/") + "/modelfs/v1/status"
    try:
        r = httpx.get(target, headers=headers, timeout=10.0, verify=verify)
    except httpx.InvalidURL as exc:
        return None, f"--url {url!r}: {exc}"
    except httpx.HTTPError as exc:
        return None, f"no sync daemon answers at {url} ({type(exc).__name__}: {exc})"
    if r.status_code in (401, 403):
        return None, f"{target}: {r.status_code}; give the daemon's token with --token-file"
    if not r.is_success:
        return None, f"{target}: HTTP {r.status_code}"
    try:
        body = r.json()
    except ValueError:
        return None, f"{target}: not JSON"
    if not isinstance(body, dict):
        return None, f"{target}: not a JSON object"
    if "daemon" not in body:
        return body, f"{url} is `modelfs serve`, not the sync daemon: no peers or transfers"
    return body, None


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "never"
    s = max(now - ts, 0)
    if s < 120:
        return f"{s:.0f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.0f}h ago"


def _peer(p: dict[str, Any]) -> str:
    """A peer as status names it: its host id (the one its answers give), else its URL."""
    return str(p.get("host_id") or p["url"])


def render_status(status: dict[str, Any]) -> str:
    now = time.time()
    d = status.get("daemon") or {}
    lines = [
        f"host {status.get('host_id')}: store {status.get('store')}, "
        f"{counted(int(status.get('models') or 0), 'model')}, "
        f"{counted(int(status.get('blobs') or 0), 'blob')}, "
        f"up {status.get('uptime_seconds', 0):.0f}s, "
        f"{human_bytes(int(status.get('bytes_served', 0)))} served"
    ]
    if not d:
        return "\n".join(lines)
    replicate = ", ".join(d.get("replicate") or []) or "nothing (serve only)"
    lines.append(
        f"replicates: {replicate}; every {d.get('interval', 0):g}s, round {d.get('rounds')}"
    )
    if d.get("pin"):
        lines.append(f"TLS pin: {d['pin']} (its peers' `pin` for this host)")
    peers = status.get("peers") or []
    if peers:
        lines.append("peers:")
        rows = []
        for p in peers:
            state = "ok" if p.get("ok") else f"DOWN: {p.get('error') or 'not reached yet'}"
            if p.get("untrusted"):
                state = f"UNTRUSTED: {p.get('error') or p['untrusted']}"
            rows.append(
                [
                    f"  {_peer(p)} ({p['url']})" if p.get("host_id") else "  " + p["url"],
                    state,
                    f"listed {_ago(p.get('last_ok'), now)}",
                    counted(len(p.get("models") or {}), "model"),
                    f"{human_bytes(int(p.get('bytes_in', 0)))} received",
                ]
            )
        lines.append(table(rows))
    local: dict[str, str] = d.get("models") or {}
    ids = {n: str(TagId(**i)) for n, i in (d.get("ids") or {}).items()}
    names = sorted(set(local) | {n for p in peers for n in (p.get("models") or {})})
    if names:
        lines.append("models:")
        rows = [["  NAME", "HERE", *[_peer(p) for p in peers]]]
        for n in names:
            here = local.get(n, "")
            row = ["  " + n, ids.get(n) or (str(tag_ids(here)) if here else "-")]
            for p in peers:
                theirs = (p.get("models") or {}).get(n)
                if theirs is None:
                    row.append("-")
                elif not theirs:
                    row.append("listed")
                else:
                    row.append("same" if theirs == here else str(tag_ids(theirs)))
            rows.append(row)
        lines.append(table(rows))
    transfers = d.get("transfers") or []
    for t in transfers:
        if t.get("state") == "waiting":
            lines.append(f"waiting to pull {t['name']} ({d.get('max_transfers')} at a time)")
            continue
        done, total = int(t.get("bytes") or 0), int(t.get("total_bytes") or 0)
        lines.append(
            f"pulling {t['name']} from {', '.join(t['from'])} since {_ago(t['since'], now)}: "
            f"{human_bytes(done)} of {human_bytes(total)}"
        )
    behind = d.get("behind") or {}
    for name, lag in (d.get("lag_seconds") or {}).items():
        line = f"behind: {name} for {lag:.0f}s"
        b = behind.get(name) or {}
        if b.get("reason"):
            line += f": {b['reason']}"
        if b.get("error"):
            line += f"; last try: {b['error']}"
        if b.get("next_try_seconds") is not None:
            line += f" (next try in {b['next_try_seconds']:.0f}s)"
        lines.append(line)
    gc = d.get("gc") or {}
    last = gc.get("last")
    if last:
        verdict = "ok" if last.get("ok") else f"stopped short ({last.get('aborted') or 'refused'})"
        lines.append(
            f"last GC: {_ago(last.get('finished'), now)}, {verdict}, {last.get('trashed')} to "
            f"trash, {human_bytes(int(last.get('bytes_freed', 0)))} freed"
        )
    else:
        lines.append("last GC: none by this daemon yet")
    return "\n".join(lines)
