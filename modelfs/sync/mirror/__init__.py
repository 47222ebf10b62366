"""A pull-through cache of one upstream registry, served by the registry server."""
