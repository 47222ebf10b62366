"""The registry server: the OCI distribution API over a store, and serving it with hypercorn."""
