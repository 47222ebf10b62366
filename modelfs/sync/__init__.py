"""Replication over the OCI distribution API: the server, the client, and (later) the daemon."""
