"""``open_source``: a source passes through untouched; anything else that is not a location is
refused with a typed error."""

from __future__ import annotations

import socket

import pytest
from logitcache.client.sources import HttpSource, SourceError, open_source


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_http_source_is_returned_without_a_request() -> None:
    # Nothing listens on the port: any request inside open_source would raise. Python 3.11's
    # isinstance() on the runtime-checkable CacheSource protocol read every property, so the
    # manifest request was made (and failed) here.
    src = HttpSource(f"http://127.0.0.1:{_closed_port()}", "c")
    assert open_source(src) is src
    with pytest.raises(Exception):  # noqa: B017 - the request does fail when made
        _ = src.num_sequences


def test_a_non_location_is_a_typed_error() -> None:
    with pytest.raises(SourceError, match="not int"):
        open_source(3)  # type: ignore[arg-type]


def test_a_source_with_instance_attributes_passes_through() -> None:
    class Plain:  # the protocol's data members set on the object, not properties of its type
        def __init__(self) -> None:
            self.manifest, self.num_sequences, self.lengths = None, 0, []

        def fetch(self, indices):  # pragma: no cover - never read
            return {}

        def refresh(self) -> None:  # pragma: no cover
            pass

    src = Plain()
    assert open_source(src) is src
