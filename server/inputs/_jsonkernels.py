"""The numba kernel of :mod:`.jsonids` (imported only by :func:`.jsonids.ready`: numba is
optional), at module level so that numba's on-disk cache finds it again."""

from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _skip_ws(b, i):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    n = b.size
    while i < n and (b[i] == 32 or b[i] == 9 or b[i] == 10 or b[i] == 13):
        i += 1
    return i


@numba.njit(nogil=True, cache=True, boundscheck=False)
def int_list(b, out):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """The integers of the JSON array ``b`` (UTF-8 bytes) into ``out``; their count, or -1 unless
    every value is a JSON integer in int32 range (the caller then parses with ``json``)."""
    n = b.size
    i = _skip_ws(b, 0)
    if i >= n or b[i] != 91:  # [
        return -1
    i = _skip_ws(b, i + 1)
    if i < n and b[i] == 93:  # ]
        return 0 if _skip_ws(b, i + 1) == n else -1
    cnt = 0
    while True:
        neg = False
        if i < n and b[i] == 45:  # -
            neg = True
            i += 1
        if i >= n or b[i] < 48 or b[i] > 57:
            return -1
        v = 0
        if b[i] == 48:  # a lone 0
            i += 1
            if i < n and 48 <= b[i] <= 57:
                return -1
        else:
            digits = 0
            while i < n and 48 <= b[i] <= 57:
                v = v * 10 + (b[i] - 48)
                digits += 1
                i += 1
                if digits > 10:
                    return -1
        if neg:
            v = -v
        if v > 2147483647 or v < -2147483648:
            return -1
        if i < n and (b[i] == 46 or b[i] == 101 or b[i] == 69):  # . e E: a float
            return -1
        out[cnt] = v
        cnt += 1
        i = _skip_ws(b, i)
        if i >= n:
            return -1
        if b[i] == 44:  # ,
            i = _skip_ws(b, i + 1)
            continue
        if b[i] == 93:
            return cnt if _skip_ws(b, i + 1) == n else -1
        return -1
