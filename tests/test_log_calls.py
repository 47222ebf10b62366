"""Every log call in modelfs has as many arguments as its format has placeholders.

A mismatch is no error where the call is made: the logging module prints `--- Logging error
---` with a traceback when the record is formatted, and drops the line, so a call on a path no
test logs at its level is wrong unseen. This reads each call's format and counts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "modelfs"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
# printf conversions as logging's %-formatting reads them; `%%` is a literal percent sign.
PLACEHOLDER = re.compile(
    r"%(?:%|(?:\([^)]*\))?[#0 +-]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa])"
)


def placeholders(fmt: str) -> int:
    count = 0
    for match in PLACEHOLDER.finditer(fmt):
        text = match.group(0)
        if text == "%%":
            continue
        count += 1 + text.count("*")
    return count


def log_calls() -> list[tuple[str, int, str, int]]:
    """(file, line, format, number of arguments) of each `<logger>.<level>("…", …)` call."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVELS
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args):
                continue
            rel = str(path.relative_to(PACKAGE.parent))
            calls.append((rel, node.lineno, node.args[0].value, len(node.args) - 1))
    return calls


def test_placeholders_are_counted_as_logging_reads_them() -> None:
    assert placeholders("%s %d bytes %.3f s, 100%% done") == 3
    assert placeholders("%(name)s") == 1
    assert placeholders("%*d") == 2


def test_every_log_call_has_one_argument_per_placeholder() -> None:
    calls = log_calls()
    assert len(calls) > 100, "the walk found too few log calls to be looking in the right place"
    wrong = [
        f"{file}:{line}: {placeholders(fmt)} placeholder(s), {n} argument(s): {fmt!r}"
        for file, line, fmt, n in calls
        if n > 0 and placeholders(fmt) != n
    ]
    assert not wrong, "\n".join(wrong)
