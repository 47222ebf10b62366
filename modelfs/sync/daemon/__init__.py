"""The sync daemon: its config, its peers and replication, its GC and verify runs."""
