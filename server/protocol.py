"""Moved: the API models now live in :mod:`logitcache.protocol` (one module for server and
client, issue #16). This name re-exports them only until the last ``from .protocol import`` in
``server/`` is switched over; import from ``logitcache.protocol``."""

from logitcache.protocol import *  # noqa: F403
