"""Speaking to a peer registry: sessions, credentials, token flow, proxies, ranged reads, push."""
