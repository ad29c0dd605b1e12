"""The numba kernel of :mod:`.fastencode` (imported only by :func:`.fastencode.ready`: numba is
optional). Module-level functions, not closures (numba's cache key of a closure is its pickled
bytes, which differ from process to process), so that numba's on-disk cache (``cache=True``)
finds them again in the next process."""

from __future__ import annotations

import numba
import numpy as np

from ._numba import harden_llvmlite

harden_llvmlite()  # numba imported llvmlite: keep an in-process vLLM engine startable (see there)


@numba.njit(nogil=True, cache=True)
def _half(x, a):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    """The half bits of ``max(min(x, +0.0), -65504)`` (``a``: ``|x|``'s float32 bits), every
    case: ``x >= 0`` (also -0.0: numpy's ``minimum(x, +0.0)`` gives +0.0), the clip, a
    subnormal or zero half, a normal one."""
    if x >= 0.0:
        return 0
    if a >= 0x477FE000:  # at or past -65504
        return 0xFBFF
    if a >= 0x38800000:  # normal
        h = (a >> 13) - 0x1C000
        rem = a & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
            h += 1
        return 0x8000 | h
    e = a >> 23
    if e < 102:  # below half the smallest subnormal: -0
        return 0x8000
    m = (a & 0x7FFFFF) | 0x800000
    shift = 126 - e
    h = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1
    return 0x8000 | h


@numba.njit(nogil=True, cache=True)
def _rare(x, b):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    """Whether ``x`` (float32 bits ``b``) is not :func:`_half`'s normal case."""
    a = np.int32(b & np.uint32(0x7FFFFFFF))
    return (x >= 0.0) or (a < 0x38800000) or (a >= 0x477FE000)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def encode_rows(ids, lp, bits, ids_out, stored_out, seen, state, vocab, tol):  # type: ignore[no-untyped-def]  # noqa: ANN001, E501
    """Check and encode one record's rows; 0 when they pass, 1 at the first failing row (the caller
    then runs the per-record checks for the error). ``ids``: ``[n, k]``, any strides; ``lp``:
    C-ordered ``[n, w]``, ``w >= k`` (:func:`.fastencode.parent_rows`); ``bits``: ``lp`` as uint32;
    ``seen``: uint16 stamps per vocabulary id, ``state[0]`` the last stamp given (each row takes the
    next; past 65535 the table is zeroed). The checks are branch-free flags tested once per row; the
    logprob loop vectorises, and the rare values (zero, subnormal, clipped) are then recomputed by
    :func:`_half`."""
    n, k = ids_out.shape
    top = vocab - 1
    hs = np.empty(k, np.int32)  # one row's half bits
    cur = state[0]
    for r in range(n):
        cur += 1
        if cur > 0xFFFF:  # stamps used up: a clean table
            seen[:] = 0
            cur = 1
        state[0] = cur
        s = np.uint16(cur)
        bad = False
        for j in range(k):  # ids: range and copy (vectorised)
            v = ids[r, j]
            bad |= (v < 0) | (v > top)
            ids_out[r, j] = v
        if bad:
            return 1
        for j in range(k):  # distinct: the stamp table (scalar)
            vi = ids[r, j]
            bad |= seen[vi] == s
            seen[vi] = s
        rare = False
        for j in range(k):  # logprobs: branch-free, vectorised
            x = lp[r, j]
            # NaN, too large, -inf, or larger than the value before it
            bad |= (not (x <= tol)) | (x == -np.inf) | (x > lp[r, max(j - 1, 0)])
            a = np.int32(bits[r, j] & np.uint32(0x7FFFFFFF))
            rare |= (x >= 0.0) | (a < 0x38800000) | (a >= 0x477FE000)
            h = (a >> 13) - np.int32(0x1C000)  # a normal half: 13 bits off, nearest-even
            rem = a & np.int32(0x1FFF)
            h += np.int32((rem > 0x1000) | ((rem == 0x1000) & ((h & 1) == 1)))
            hs[j] = h | np.int32(0x8000)
        if rare and not bad:  # zero, subnormal or clipped values: the exact path for them
            # a row that passes is non-increasing, so they are a prefix (>= -2**-14, e.g. a
            # confident teacher's top-1) and a suffix (<= -65504); the rest is _half's normal
            # case, computed above
            j = 0
            while j < k and _rare(lp[r, j], bits[r, j]):
                hs[j] = _half(lp[r, j], np.int32(bits[r, j] & np.uint32(0x7FFFFFFF)))
                j += 1
            j = k - 1
            while j >= 0 and _rare(lp[r, j], bits[r, j]):
                hs[j] = _half(lp[r, j], np.int32(bits[r, j] & np.uint32(0x7FFFFFFF)))
                j -= 1
        stored_out[r, 0] = np.uint16(hs[0])
        for j in range(1, k):  # row deltas, modulo 2**16
            stored_out[r, j] = np.uint16((hs[j] - hs[j - 1]) & 0xFFFF)
        if bad:
            return 1
    return 0


@numba.njit(nogil=True, cache=True, boundscheck=False)
def tail_rest(lp, rest):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """``rest[r, j] = lp[r, j + 1] - lp[r, 0]`` (float32, as numpy subtracts) for ``rest``'s
    ``[n, k - 1]`` (``lp``: C-ordered ``[n, w]``, ``w >= k``); 1 when some difference is not
    ``<= 0`` (an unsorted row, NaN), else 0."""
    n, c = rest.shape
    bad = False
    for r in range(n):
        m = lp[r, 0]
        for j in range(c):
            d = lp[r, j + 1] - m
            bad |= not (d <= 0.0)
            rest[r, j] = d
    return 1 if bad else 0


#: Longest row :func:`row_sums` takes: numpy's pairwise sum splits longer ones in halves,
#: recursively (a self-recursive numba function does not survive ``cache=True``).
PAIRWISE_BLOCK = 128


@numba.njit(nogil=True, cache=True, boundscheck=False)
def row_sums(x, out):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """``out[r] = x[r].sum(dtype=float32)`` bit for bit as numpy sums a C-ordered float32
    ``[n, c]``, ``c <= PAIRWISE_BLOCK``, along its rows: the identity 0 plus numpy's
    ``pairwise_sum`` of the row, operation for operation (under 8 values a plain loop; else eight
    accumulators combined as ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``, then the
    values past the last multiple of 8)."""
    n, c = x.shape
    end = c - c % 8
    acc = np.empty(8, np.float32)  # r0..r7: one vector add per 8 values
    for r in range(n):
        if c < 8:
            res = np.float32(0.0)
            for i in range(c):
                res += x[r, i]
        else:
            for j in range(8):
                acc[j] = x[r, j]
            for i in range(8, end, 8):
                for j in range(8):
                    acc[j] += x[r, i + j]
            res = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
            for i in range(end, c):
                res += x[r, i]
        out[r] = np.float32(0.0) + res


@numba.njit(nogil=True, cache=True, boundscheck=False)
def key_sums(buf, ends, weights, out):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """``out[i]``: the sum over key ``i``'s bytes ``buf[ends[i-1]:ends[i]]`` (uint8) of
    ``(byte + 1) * weights[position in the key]``, modulo ``2**64`` (uint64 throughout): the
    sums :func:`._keyindex.byte_hashes` mixes, in one pass over the bytes."""
    one = np.uint64(1)
    start = 0
    for i in range(ends.shape[0]):
        end = ends[i]
        s = np.uint64(0)
        for j in range(start, end):
            s += (np.uint64(buf[j]) + one) * weights[j - start]
        out[i] = s
        start = end


@numba.njit(nogil=True, cache=True, boundscheck=False)
def merge_pairs(a, b, out):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """Merge ``a`` and ``b`` (int64 ``[n, 2]``: key-index entries, hash then sequence, each
    sorted by hash) into ``out``, stably: on equal hashes ``a``'s entries first."""
    na, nb = a.shape[0], b.shape[0]
    i = j = k = 0
    while i < na and j < nb:
        if b[j, 0] < a[i, 0]:
            out[k, 0] = b[j, 0]
            out[k, 1] = b[j, 1]
            j += 1
        else:
            out[k, 0] = a[i, 0]
            out[k, 1] = a[i, 1]
            i += 1
        k += 1
    while i < na:
        out[k, 0] = a[i, 0]
        out[k, 1] = a[i, 1]
        i += 1
        k += 1
    while j < nb:
        out[k, 0] = b[j, 0]
        out[k, 1] = b[j, 1]
        j += 1
        k += 1
