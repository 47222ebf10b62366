"""Pulling models from peers into a store: manifests, sources, blob transfers, progress."""
