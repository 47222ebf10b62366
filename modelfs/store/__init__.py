"""The pure model of an Ollama store: names, digests, manifests, blobs, headers.

Synchronous and free of pyfuse3, trio and httpx, so that the FUSE view (`fsd`), the
replicator (`sync`) and the CLI all read the store through the same code.
"""
