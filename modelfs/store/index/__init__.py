"""The scan index: what a scan parsed, kept under `.modelfs/` for the next scan (scancache)."""
