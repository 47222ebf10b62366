"""Errors of the FUSE view. Kept apart from fsd.mount so the CLI can name it without
importing pyfuse3."""

from __future__ import annotations


class MountError(Exception):
    """The mount could not be set up; the message is one line for the user."""
