"""What a scan finds (found: StoreIndex, Entry, Problem), and the scan index: what a scan read
and worked out, kept under `.modelfs/` for the next scan (scancache; its file, indexfile; its
manifests, built when first used, lazy; its directory listings, dirs). GC's reach index:
reachcache."""
