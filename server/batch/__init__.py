"""Batch scoring: the job table and runner, the one batch pipeline, and Ray shards with their
driver (``logitcache-distributed``)."""
