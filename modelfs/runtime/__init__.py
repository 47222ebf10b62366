"""Trio plumbing shared by the mount (fsd) and the sync daemon: leases kept alive on disk,
systemd notifications. Neither fsd nor sync imports the other."""
