"""Touching a store's disk: the one way files are read (fileio), the owner of what we
create (owner), reads asked for ahead of a scan (prefetch)."""
