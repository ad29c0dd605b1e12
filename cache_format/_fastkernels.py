"""The numba kernels of :mod:`._fastdecode` (imported only by :func:`._fastdecode.ready`: numba is
optional). Module-level functions, so that numba's on-disk cache (``cache=True``) finds them again
in the next process; the C functions they call are arguments (``fns``: their addresses, an int64
array), not globals (numba cannot cache code holding function pointers), called through the
intrinsics below (a ctypes function object as an argument costs a dispatch per call)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ._numba import EMPTY as _EMPTY
from ._numba import FALLBACK, NEED_BUFFER, NEED_SHARDS, OK, harden_llvmlite

EMPTY = np.uint64(_EMPTY)

harden_llvmlite()  # numba imported llvmlite: keep an in-process vLLM engine startable (see there)


@intrinsic
def h2f(typingctx: Any, u: Any) -> Any:
    """float16 bits (uint16) -> float32, exact (LLVM ``fpext half``)."""
    if u != types.uint16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


def _c_call(ret: str, params: tuple[int, ...]) -> Any:
    """An intrinsic ``f(address, *args)`` calling the C function at ``address`` (int64) with
    the C signature ``ret(params)`` (integer widths; pointers passed as 64-bit integers), its
    int64 arguments truncated to narrower parameters and its result widened back to int64
    (``"u32"``: zero-extended, ``"i32"``: sign-extended)."""
    ret_t = ir.IntType(64 if ret == "i64" else 32)
    fnty = ir.FunctionType(ret_t, [ir.IntType(b) for b in params])

    def codegen(context: Any, builder: Any, signature: Any, llargs: Any) -> Any:
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        conv = [
            builder.trunc(v, t) if t.width < 64 else v
            for v, t in zip(llargs[1:], fnty.args, strict=True)
        ]
        got = builder.call(fn, conv)
        if ret == "i64":
            return got
        widen = builder.zext if ret == "u32" else builder.sext
        return widen(got, ir.IntType(64))

    sig = types.int64(*[types.int64] * (1 + len(params)))

    def typer(typingctx: Any, *args: Any) -> Any:
        return sig, codegen

    # numba's intrinsic reads the typer's own arguments: one of fixed arity each
    fixed = {
        2: lambda typingctx, f, a, b: typer(typingctx),
        3: lambda typingctx, f, a, b, c: typer(typingctx),
        4: lambda typingctx, f, a, b, c, d: typer(typingctx),
    }
    return intrinsic(fixed[len(params)])


crc32c = _c_call("u32", (64, 64))  # crc32c_value(const uint8_t *data, size_t n)
blosc_decompress_ctx = _c_call("i32", (64, 64, 64, 32))  # (src, dest, destsize, nthreads)
pread = _c_call("i64", (32, 64, 64, 64))  # (fd, buf, count, offset)
memcpy = _c_call("i64", (64, 64, 64))  # (dest, src, n)
preadv = _c_call("i64", (32, 64, 32, 64))  # (fd, iov, iovcnt, offset)

jit = numba.njit(nogil=True, cache=True, boundscheck=False)

MAX_RUN = 256
"""Raw chunks per ``preadv`` (2 ``iovec`` each: well below the usual ``IOV_MAX`` of 1,024)."""


@jit
def u32(buf: Any, p: int) -> Any:
    return (
        np.int64(buf[p])
        | (np.int64(buf[p + 1]) << 8)
        | (np.int64(buf[p + 2]) << 16)
        | (np.int64(buf[p + 3]) << 24)
    )


LANES = 32
"""uint16 values per vector of :func:`scan16_widen` / :func:`scan16_inplace` (one AVX-512
register, two AVX2 ones: LLVM splits a vector wider than the machine's)."""

_I16, _I32 = ir.IntType(16), ir.IntType(32)
_V16 = ir.VectorType(_I16, LANES)
_VI32 = ir.VectorType(_I32, LANES)


def _scan_vector(builder: Any, x: Any, carry: Any) -> tuple[Any, Any]:
    """LLVM IR: the inclusive prefix sum of the ``LANES`` uint16 lanes of ``x`` (wrapping), plus
    ``carry`` in every lane: log2(LANES) steps of ``x += x shifted up by s lanes`` (zeros
    shifted in), s = 1, 2, 4, ...; returns the sums and the last one (the next carry)."""
    zero = ir.Constant(_V16, None)
    s = 1
    while s < LANES:
        shift = ir.Constant(_VI32, [j if j < s else LANES + j - s for j in range(LANES)])
        x = builder.add(x, builder.shuffle_vector(zero, x, shift))
        s *= 2
    one = builder.insert_element(ir.Constant(_V16, ir.Undefined), carry, ir.Constant(_I32, 0))
    splat = ir.Constant(_VI32, [0] * LANES)
    x = builder.add(x, builder.shuffle_vector(one, ir.Constant(_V16, ir.Undefined), splat))
    return x, builder.extract_element(x, ir.Constant(_I32, LANES - 1))


def _scan_intrinsic(widen: bool) -> Any:
    """``f(src, dst, carry) -> carry``: :func:`_scan_vector` of the ``LANES`` uint16 at address
    ``src`` (int64), stored at ``dst`` as uint16 (``dst`` may be ``src``) or, ``widen``, as the
    float32 values of those float16 bits (LLVM ``fpext half``, exact)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        src, dst, carry = args
        x = builder.load(builder.inttoptr(src, _V16.as_pointer()), align=2)
        x, last = _scan_vector(builder, x, carry)
        if widen:
            half = builder.bitcast(x, ir.VectorType(ir.HalfType(), LANES))
            f32 = ir.VectorType(ir.FloatType(), LANES)
            wide = builder.fpext(half, f32)
            builder.store(wide, builder.inttoptr(dst, f32.as_pointer()), align=4)
        else:
            builder.store(x, builder.inttoptr(dst, _V16.as_pointer()), align=2)
        return last

    def typer(typingctx: Any, src: Any, dst: Any, carry: Any) -> Any:
        return types.uint16(types.int64, types.int64, types.uint16), codegen

    return intrinsic(typer)


scan16_widen = _scan_intrinsic(True)
scan16_inplace = _scan_intrinsic(False)


@jit
def undelta(d: Any, out: Any, widen: bool) -> None:
    """The row-wise cumulative sum of unsigned ``d`` (uint16 or uint32) modulo 2^bits: in place, or
    (``widen``: float16 bits) as float32 into ``out``; uint16 rows ``LANES`` values at a time
    through the vector scan (:func:`_scan_vector`), the rest serially."""
    n, k = d.shape
    full = k // LANES * LANES if d.itemsize == 2 else 0
    src, dst = np.int64(d.ctypes.data), np.int64(out.ctypes.data)
    s_row, o_row = d.strides[0], out.strides[0]
    for r in range(n):
        acc = d.dtype.type(0)
        for j in range(0, full, LANES):
            if widen:
                got = scan16_widen(src + r * s_row + 2 * j, dst + r * o_row + 4 * j, np.uint16(acc))
            else:
                at = src + r * s_row + 2 * j
                got = scan16_inplace(at, at, np.uint16(acc))
            acc = d.dtype.type(got)
        for j in range(full, k):
            acc = d.dtype.type(acc + d[r, j])
            if widen:
                out[r, j] = h2f(np.uint16(acc))
            else:
                d[r, j] = acc


@jit
def read_items(
    fns: Any,
    fd_tabs: Any,
    idx_tabs: Any,
    meta: Any,
    items: Any,
    arena: Any,
    lp: Any,
    lp_out: Any,
    scratch: Any,
    buf: Any,
    status: Any,
) -> None:
    """Decode every item ``(array, first row, end row, output row)`` of ``items`` into its array's
    block of ``arena``, each needed chunk once (``meta[a]``: chunks per shard, chunk rows, row
    bytes, shard rows, block offset, 1 if ``raw``). The logprob array ``lp[0]`` is, if ``lp[1]``
    (float16 widened), summed chunk by chunk straight into ``lp_out``; else row-delta inverted in
    place after all chunks. ``fns``: the C functions' addresses (:func:`._fastdecode._cfuncs`;
    arguments, not globals, so that numba can cache the compiled code)."""
    crc_fn, dec_fn, pread_fn, memcpy_fn, preadv_fn = fns[0], fns[1], fns[2], fns[3], fns[4]
    status[0] = OK
    n_items = items.shape[0]
    missing = 0
    for i in range(n_items):
        a, st, sp = items[i, 0], items[i, 1], items[i, 2]
        sr = meta[a, 3]
        fd_tab = fd_tabs[a]
        for sh in range(st // sr, (sp - 1) // sr + 1):
            if fd_tab[sh] < 0 and 3 + 2 * missing < status.size:
                dup = False
                for m in range(missing):
                    if status[2 + 2 * m] == a and status[3 + 2 * m] == sh:
                        dup = True
                if not dup:
                    status[2 + 2 * missing] = a
                    status[3 + 2 * missing] = sh
                    missing += 1
    if missing:
        status[0] = NEED_SHARDS
        status[1] = missing
        return
    base = np.int64(buf.ctypes.data)  # addresses as int64 (uintp would unify to float64)
    scr = np.int64(scratch.ctypes.data)
    arena_base = np.int64(arena.ctypes.data)
    for a in range(meta.shape[0]):
        per_shard, cr, row_bytes, out_at = meta[a, 0], meta[a, 1], meta[a, 2], meta[a, 4]
        raw = meta[a, 5] != 0
        # widened logprobs: each chunk's rows summed from the bytes read (or decompressed)
        # straight into lp_out, never through the arena (one pass less over fresh memory)
        to_lp = a == lp[0] and lp[1] != 0
        k_lp = row_bytes // 2
        fd_tab, idx_tab = fd_tabs[a], idx_tabs[a]
        chunk_bytes = cr * row_bytes
        n_pairs = 0
        for i in range(n_items):
            if items[i, 0] == a:
                n_pairs += (items[i, 2] - 1) // cr - items[i, 1] // cr + 1
        if n_pairs == 0:
            continue
        pc = np.empty(n_pairs, np.int64)  # (chunk, item) pairs, sorted by chunk below
        pj = np.empty(n_pairs, np.int64)
        q = 0
        for i in range(n_items):
            if items[i, 0] == a:
                for g in range(items[i, 1] // cr, (items[i, 2] - 1) // cr + 1):
                    pc[q] = g
                    pj[q] = i
                    q += 1
        if q > 1:
            order = np.argsort(pc, kind="mergesort")
            pc = pc[order]
            pj = pj[order]
        n_u = 0
        for q in range(n_pairs):
            if q == 0 or pc[q] != pc[q - 1]:
                n_u += 1
        ug = np.empty(n_u, np.int64)
        ufirst = np.empty(n_u + 1, np.int64)  # pairs [ufirst[u], ufirst[u + 1]) use chunk u
        uoff = np.empty(n_u, np.int64)
        unb = np.empty(n_u, np.int64)
        ush = np.empty(n_u, np.int64)
        u = -1
        for q in range(n_pairs):
            if q == 0 or pc[q] != pc[q - 1]:
                u += 1
                g = pc[q]
                ug[u] = g
                ufirst[u] = q
                sh = g // per_shard
                e = 2 * (g - sh * per_shard)
                if idx_tab[sh, e] == EMPTY:
                    status[0] = FALLBACK
                    status[1] = g
                    return
                uoff[u] = np.int64(idx_tab[sh, e])
                unb[u] = np.int64(idx_tab[sh, e + 1])
                ush[u] = sh
                if raw and unb[u] != chunk_bytes + 4:
                    status[0] = FALLBACK
                    status[1] = g
                    return
        ufirst[n_u] = n_pairs
        # a raw chunk used whole by one item is read straight into the arena (udest: its
        # address there, else -1), its CRC32C into buf where the frame would have been
        udest = np.full(n_u, -1, np.int64)
        if raw and not to_lp:
            for u in range(n_u):
                q0 = ufirst[u]
                if ufirst[u + 1] - q0 == 1:
                    i = pj[q0]
                    r0 = ug[u] * cr
                    if items[i, 1] <= r0 and r0 + cr <= items[i, 2]:
                        udest[u] = (
                            arena_base + out_at + (items[i, 3] + r0 - items[i, 1]) * row_bytes
                        )
        iov = np.empty(4 * MAX_RUN, np.int64)  # struct iovec pairs (address, length)
        # runs of consecutive chunks of one shard whose bytes are contiguous: one pread (raw:
        # preadv) each into the start of buf, its chunks checked and decoded right after, while
        # their bytes are still in the CPU's cache
        u = 0
        while u < n_u:
            v = u + 1
            while (
                v < n_u
                and ush[v] == ush[u]
                and ug[v] == ug[v - 1] + 1
                and uoff[v] == uoff[v - 1] + unb[v - 1]
                and (not raw or v - u < MAX_RUN)
            ):
                v += 1
            size = uoff[v - 1] + unb[v - 1] - uoff[u]
            if size > buf.size:
                status[0] = NEED_BUFFER
                status[1] = size
                return
            if raw:  # one preadv: whole chunks into the arena, the rest into buf
                n_iov = 0
                for w in range(u, v):
                    p = uoff[w] - uoff[u]
                    if udest[w] >= 0:
                        iov[2 * n_iov] = udest[w]
                        iov[2 * n_iov + 1] = chunk_bytes
                        iov[2 * n_iov + 2] = base + p + chunk_bytes
                        iov[2 * n_iov + 3] = 4
                        n_iov += 2
                    else:
                        iov[2 * n_iov] = base + p
                        iov[2 * n_iov + 1] = unb[w]
                        n_iov += 1
                got = preadv(preadv_fn, fd_tab[ush[u]], np.int64(iov.ctypes.data), n_iov, uoff[u])
            else:
                got = pread(pread_fn, fd_tab[ush[u]], base, size, uoff[u])
            if got != size:
                status[0] = FALLBACK
                status[1] = ug[u]
                return
            for w in range(u, v):
                p, nb, g = uoff[w] - uoff[u], unb[w], ug[w]
                if raw:  # the chunk's bytes (in the arena, or in buf), then their CRC32C
                    at = udest[w] if udest[w] >= 0 else base + p
                    bad = crc32c(crc_fn, at, chunk_bytes) != u32(buf, p + chunk_bytes)
                else:  # a blosc frame of exactly one chunk, then its CRC32C
                    bad = (
                        nb < 20
                        or crc32c(crc_fn, base + p, nb - 4) != u32(buf, p + nb - 4)
                        or u32(buf, p + 4) != chunk_bytes
                        or u32(buf, p + 12) != nb - 4
                    )
                if bad:
                    status[0] = FALLBACK
                    status[1] = g
                    return
                r0 = g * cr
                q0, q1 = ufirst[w], ufirst[w + 1]
                i = pj[q0]
                whole = q1 - q0 == 1 and not to_lp  # all one item's: decoded in place in the arena
                whole = whole and items[i, 1] <= r0 and r0 + cr <= items[i, 2]
                if whole and raw:
                    continue  # read in place
                src_buf, at, dest = buf, p, scr  # raw: rows copied (or summed) from the bytes read
                if whole:
                    dest = arena_base + out_at + (items[i, 3] + r0 - items[i, 1]) * row_bytes
                elif not raw:
                    src_buf, at = scratch, 0
                if not raw and (
                    blosc_decompress_ctx(dec_fn, base + p, dest, chunk_bytes, 1) != chunk_bytes
                ):
                    status[0] = FALLBACK
                    status[1] = g
                    return
                if whole:
                    continue
                src = np.int64(src_buf.ctypes.data) + at
                for q in range(q0, q1):
                    i = pj[q]
                    st, sp = items[i, 1], items[i, 2]
                    x, y = max(st, r0), min(sp, r0 + cr)
                    if to_lp:
                        b0 = at + (x - r0) * row_bytes
                        rows16 = src_buf[b0 : b0 + (y - x) * row_bytes].view(np.uint16)
                        o = items[i, 3] + x - st
                        undelta(rows16.reshape((y - x, k_lp)), lp_out[o : o + y - x], True)
                    else:
                        o = out_at + (items[i, 3] + x - st) * row_bytes
                        memcpy(
                            memcpy_fn,
                            arena_base + o,
                            src + (x - r0) * row_bytes,
                            (y - x) * row_bytes,
                        )
            u = v
    a = lp[0]
    if a < 0 or lp[1] != 0:  # (widened logprobs were summed chunk by chunk above)
        return
    k = meta[a, 2] // lp[2]
    for i in range(n_items):
        if items[i, 0] != a:
            continue
        o = meta[a, 4] + items[i, 3] * meta[a, 2]
        rows = items[i, 2] - items[i, 1]
        n = rows * meta[a, 2]
        if lp[2] == 4:  # in place (lp_out: not written)
            undelta(arena[o : o + n].view(np.uint32).reshape((rows, k)), lp_out, False)
        else:
            undelta(arena[o : o + n].view(np.uint16).reshape((rows, k)), lp_out, False)
