"""On-demand scoring: the scoring service, named caches, cache hits and target kinds."""
