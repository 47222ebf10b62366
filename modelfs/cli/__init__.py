"""The `modelfs` command: argument parsing, presentation (sizes, progress, reports) and the
one place errors become messages and exit codes."""

from modelfs.cli.app import main

__all__ = ["main"]
