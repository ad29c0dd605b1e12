"""A faster reading of JSONL input lines whose token ids are plain integer lists.

msgspec splits a line's object into raw top-level values, a compiled pass (numba) turns the ids
array's bytes straight into int32, and the other fields are decoded by ``json.loads``. Anything
else (a line msgspec refuses, ids not all JSON integers in int32 range) takes the ``json`` path,
so accepted input, values and errors stay ``json.loads``'s. Without msgspec or numba, or if its
self-check fails, :func:`ready` is ``False`` and every line takes the ``json`` path.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

_decoder: Any = None
_kernel: Any = None
_state = "unknown"  # "unknown" | "ready" | "off"
_lock = threading.Lock()


def ready() -> bool:
    """Whether :func:`fields` is usable (imports, compiles or loads, self-checks once)."""
    global _decoder, _kernel, _state
    if _state == "unknown":
        with _lock:
            if _state == "unknown":
                try:
                    import msgspec

                    from . import _jsonkernels

                    _decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
                    _kernel = _jsonkernels.int_list
                    _state = "ready" if _self_check() else "off"
                except Exception:  # no msgspec or numba, a failed compile: json alone
                    _state = "off"
    return _state == "ready"


def int_list(raw: Any) -> np.ndarray | None:
    """The int32 array of a JSON array of integers (``raw``: its bytes), else ``None``."""
    b = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty((b.size + 1) // 2, np.int32)
    n = _kernel(b, out)
    return None if n < 0 else out[:n].copy()


def fields(line: bytes, names: Iterable[str], ids_name: str) -> dict[str, Any] | None:
    """The values of ``names`` in the JSON object ``line`` (``ids_name``'s as int32 when it is a
    list of int32 integers), or ``None`` when msgspec cannot read it so (use ``json``)."""
    try:
        top = _decoder.decode(line.decode("utf-8"))
    except Exception:  # noqa: BLE001 - any refusal: json.loads decides, with its own message
        return None
    out: dict[str, Any] = {}
    for name in names:
        raw = top.get(name)
        if raw is None:
            continue
        got = int_list(raw) if name == ids_name else None
        out[name] = got if got is not None else json.loads(bytes(raw).decode("utf-8"))
    return out


def _self_check() -> bool:
    """:func:`fields` against ``json.loads`` on lines of every kind the kernel must refuse."""
    good = b'{"id": "a", "input_ids": [0, -1, 2147483647, -2147483648, 12 , 3],"x":[1.5]}'
    got = fields(good, ("id", "input_ids"), "input_ids")
    want = json.loads(good)
    if got is None or got["id"] != want["id"] or got["input_ids"].tolist() != want["input_ids"]:
        return False
    if got["input_ids"].dtype != np.int32:
        return False
    for ids in (b"[]", b"[ ]", b"[7]"):
        got = fields(b'{"i": ' + ids + b"}", ("i",), "i")
        if got is None or got["i"].tolist() != json.loads(ids):
            return False
    refused = (b"[1.0]", b"[1e3]", b"[-0.0]", b"[2147483648]", b"[true]", b'["1"]', b"[[1]]", b"{}")
    for ids in refused:
        got = fields(b'{"i": ' + ids + b"}", ("i",), "i")
        if got is None or isinstance(got["i"], np.ndarray) or got["i"] != json.loads(ids):
            return False
    not_json = (b'{"i": NaN}', b'{"i": [01]}', b"[1]", b'{"i": [1,]}')  # json.loads decides
    return all(fields(line, ("i",), "i") is None for line in not_json)
