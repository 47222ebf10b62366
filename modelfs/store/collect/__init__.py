"""Garbage collection planned and stepped (gc), what is reachable (reach), blob checks
(verify) and the verify report."""
