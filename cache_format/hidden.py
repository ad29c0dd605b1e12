"""Hidden-state targets (FORMAT.md 4.10): the teacher's final hidden states per row and its output
head, stored once per cache, from which a trainer rebuilds the teacher's exact logits.

The value codecs (bfloat16 and float8 e4m3 with a per-row scale) are written here in NumPy so
that the format needs neither torch nor ml_dtypes; the tests compare them with torch's casts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .errors import ManifestError, RecordError
from .records import _as_mask, checked_tokens, content_key

HiddenDtype = Literal["bfloat16", "float8_e4m3"]
HeadDtype = Literal["bfloat16", "float32"]
HIDDEN_DTYPES: tuple[str, ...] = ("bfloat16", "float8_e4m3")
HEAD_DTYPES: tuple[str, ...] = ("bfloat16", "float32")
SPEC_KEYS = frozenset(
    {"dim", "dtype", "head_dtype", "head_digest", "bias", "logit_scale", "softcap"}
)
E4M3_MAX = 448.0
"""Largest finite float8 e4m3 (``fn``) value: a row is scaled so its largest magnitude is it."""

STORED = {"bfloat16": "uint16", "float8_e4m3": "uint8", "float32": "float32"}
"""Zarr dtype of each value encoding: bfloat16 and e4m3 as their bit patterns."""


def bytes_per_position(dim: int, dtype: str) -> int:
    """Stored bytes of one row before compression: ``2 d`` (bfloat16) or ``d + 4`` (e4m3 and
    its float32 scale)."""
    return 2 * dim if dtype == "bfloat16" else dim + 4


def check_spec(v: Any, k: int) -> None:
    """The manifest's ``hidden`` object (FORMAT.md 4.10); ``ValueError`` naming what is wrong."""
    if not isinstance(v, dict) or set(v) != SPEC_KEYS:
        raise ValueError(f'targets="hidden" needs hidden with exactly {sorted(SPEC_KEYS)}')
    if k != 1:
        raise ValueError(f'a targets="hidden" store has k=1 (no top-k entries), got k={k}')
    dim = v["dim"]
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"hidden.dim must be an int >= 1, got {dim!r}")
    if v["dtype"] not in HIDDEN_DTYPES:
        raise ValueError(f"hidden.dtype must be one of {HIDDEN_DTYPES}, got {v['dtype']!r}")
    if v["head_dtype"] not in HEAD_DTYPES:
        raise ValueError(f"hidden.head_dtype must be one of {HEAD_DTYPES}, got {v['head_dtype']!r}")
    if not (isinstance(v["head_digest"], str) and v["head_digest"].startswith("sha256:")):
        raise ValueError(f"hidden.head_digest must be 'sha256:<hex>', got {v['head_digest']!r}")
    if not isinstance(v["bias"], bool):
        raise ValueError(f"hidden.bias must be a bool, got {v['bias']!r}")
    s = v["logit_scale"]
    if isinstance(s, bool) or not isinstance(s, int | float) or not np.isfinite(s) or s <= 0:
        raise ValueError(f"hidden.logit_scale must be a finite number > 0, got {s!r}")
    c = v["softcap"]
    if c is not None and (
        isinstance(c, bool) or not isinstance(c, int | float) or not np.isfinite(c) or c <= 0
    ):
        raise ValueError(f"hidden.softcap must be null or a finite number > 0, got {c!r}")


# --------------------------------------------------------------------------- value codecs
def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (finite input)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return r.astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    exp, man = (codes >> 3) & 0xF, codes & 7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where(codes & 0x80, -mag, mag)
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


E4M3_VALUES = _e4m3_table()
"""float32 value of every e4m3 (``fn``: no infinities, ``0x7F``/``0xFF`` NaN) bit pattern."""


def to_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """float32 (finite, ``|x| <= 448``) -> e4m3fn bit patterns (uint8), round to nearest even.

    Normal values round the float32 significand to 3 bits; values below ``2^-6`` are multiples
    of ``2^-9`` (subnormals), rounded with ``rint``; the code of a subnormal multiple ``q`` is
    ``q`` itself (``q = 8`` is the smallest normal, code 8)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    a = np.minimum(np.abs(f), np.float32(E4M3_MAX))
    u = a.view(np.uint32)
    r = (u + np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
    exp = (r >> np.uint32(23)).astype(np.int32) - 127 + 7
    code = (exp << 3) | ((r >> np.uint32(20)) & np.uint32(7)).astype(np.int32)
    sub = np.rint(a * np.float32(512.0)).astype(np.int32)
    code = np.where(a < np.float32(2.0**-6), sub, np.minimum(code, 0x7E))
    return (code | np.where(np.signbit(f), 0x80, 0)).astype(np.uint8)


def encode_e4m3(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``h [n, d]`` -> (e4m3 bits ``[n, d]``, float32 scales ``[n]``): ``scale =
    max_j |h_j| / 448`` (1 for an all-zero row), bits of ``h / scale``."""
    h = np.asarray(h, dtype=np.float32)
    amax = np.abs(h).max(axis=1) if h.shape[1] else np.zeros(h.shape[0], np.float32)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    return to_e4m3_bits(h / scale[:, None]), scale


def decode_rows(stored: np.ndarray, dtype: str, scale: np.ndarray | None) -> np.ndarray:
    """Stored rows -> float32 ``[n, d]`` (bfloat16 exactly; e4m3 as ``value * scale``)."""
    if dtype == "bfloat16":
        return from_bf16_bits(stored)
    assert scale is not None
    return E4M3_VALUES[stored] * np.asarray(scale, dtype=np.float32)[:, None]


# --------------------------------------------------------------------------- the teacher head
@dataclass(frozen=True, eq=False)
class TeacherHead:
    """The teacher's output head: ``logits = softcap(logit_scale * (h W^T + b))`` with
    ``softcap(z) = c tanh(z / c)`` when set (Gemma 2) and ``logit_scale`` Cohere's multiplier (1
    elsewhere). ``weight`` ``[V, d]``: float32, or bfloat16 bit patterns (uint16) with
    ``dtype="bfloat16"``; ``bias`` float32 ``[V]`` or ``None``."""

    weight: np.ndarray
    bias: np.ndarray | None = None
    logit_scale: float = 1.0
    softcap: float | None = None
    dtype: HeadDtype = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in HEAD_DTYPES:
            raise ManifestError(f"head dtype must be one of {HEAD_DTYPES}, got {self.dtype!r}")
        w = np.ascontiguousarray(self.weight, dtype=STORED[self.dtype])
        if w.ndim != 2 or 0 in w.shape:
            raise ManifestError(f"head weight must be [V, d], got {w.shape}")
        if self.dtype == "float32" and not bool(np.isfinite(w).all()):
            raise ManifestError("head weight holds NaN or inf")
        object.__setattr__(self, "weight", w)
        if self.bias is not None:
            b = np.ascontiguousarray(self.bias, dtype=np.float32)
            if b.shape != (w.shape[0],) or not bool(np.isfinite(b).all()):
                raise ManifestError(f"head bias must be finite [V={w.shape[0]}], got {b.shape}")
            object.__setattr__(self, "bias", b)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def dim(self) -> int:
        return int(self.weight.shape[1])

    def weight_float32(self) -> np.ndarray:
        """``weight`` as float32 ``[V, d]`` (bfloat16 widened exactly)."""
        return from_bf16_bits(self.weight) if self.dtype == "bfloat16" else self.weight

    def digest(self) -> str:
        """``"sha256:" + hex(sha256(weight bytes LE || bias float32 LE bytes))``."""
        h = hashlib.sha256(self.weight.astype(self.weight.dtype.newbyteorder("<")).tobytes())
        if self.bias is not None:
            h.update(self.bias.astype("<f4").tobytes())
        return "sha256:" + h.hexdigest()

    def spec(self, hidden_dtype: HiddenDtype = "bfloat16") -> dict[str, Any]:
        """The manifest's ``hidden`` object for a cache of this head."""
        return {
            "dim": self.dim,
            "dtype": hidden_dtype,
            "head_dtype": self.dtype,
            "head_digest": self.digest(),
            "bias": self.bias is not None,
            "logit_scale": float(self.logit_scale),
            "softcap": None if self.softcap is None else float(self.softcap),
        }

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 logits ``[n, V]`` of float32 hidden rows ``[n, d]`` (a reference: the loss
        never forms them)."""
        z = np.asarray(hidden, dtype=np.float32) @ self.weight_float32().T
        if self.bias is not None:
            z = z + self.bias
        z = z * np.float32(self.logit_scale)
        if self.softcap is not None:
            c = np.float32(self.softcap)
            z = c * np.tanh(z / c)
        return z.astype(np.float32)

    def logprobs(self, hidden: np.ndarray) -> np.ndarray:
        """``log_softmax`` of :meth:`logits` (float64 internally, float32 out)."""
        z = self.logits(hidden).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        return (z - np.log(np.exp(z).sum(axis=1, keepdims=True))).astype(np.float32)


def check_head(head: TeacherHead | None, hidden: dict[str, Any], vocab_size: int) -> TeacherHead:
    """``head`` if it is the one the manifest's ``hidden`` describes (digest, shape, dtype,
    bias, scale, softcap), else :class:`ManifestError` naming the difference."""
    if head is None:
        raise ManifestError('a targets="hidden" store needs the teacher head (head=TeacherHead)')
    got = head.spec(hidden["dtype"])
    diff = {n: (got[n], hidden[n]) for n in SPEC_KEYS if got[n] != hidden[n]}
    if head.vocab_size != vocab_size:
        diff["vocab_size"] = (head.vocab_size, vocab_size)
    if diff:
        raise ManifestError(f"teacher head differs from the manifest's hidden: {diff}")
    return head


# --------------------------------------------------------------------------- records
@dataclass(frozen=True, eq=False)
class HiddenRecord:
    """One sequence of a hidden cache: ``input_ids`` ``[L]`` int32, ``hidden`` ``[L-1, d]``
    (float32; row ``j`` is the teacher's final-norm output at position ``j``, the input of its
    head for token ``j + 1``), ``loss_mask`` ``[L-1]`` uint8 0/1 or ``None``. A reader asked for
    ``logprob_dtype="bfloat16"`` gives ``hidden`` as bfloat16 bit patterns (uint16)."""

    key: str | None
    input_ids: np.ndarray
    hidden: np.ndarray
    loss_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        key = self.key
        ids = checked_tokens(key, self.input_ids)
        h = np.asarray(self.hidden)
        if h.dtype.kind != "f":
            raise RecordError(f"hidden must be floats, got dtype {h.dtype}", key=key)
        h = np.ascontiguousarray(h, dtype=np.float32)
        if h.ndim != 2 or h.shape[0] != ids.shape[0] - 1 or h.shape[1] < 1:
            raise RecordError(f"hidden must be [L-1={ids.shape[0] - 1}, d], got {h.shape}", key=key)
        if self.loss_mask is not None:
            object.__setattr__(self, "loss_mask", _as_mask(self.loss_mask, h.shape[0], key))
        object.__setattr__(self, "input_ids", ids)
        object.__setattr__(self, "hidden", h)
        if key is None:
            object.__setattr__(self, "key", content_key(ids))

    @classmethod
    def trusted(
        cls, key: str, input_ids: np.ndarray, hidden: np.ndarray, loss_mask: np.ndarray | None
    ) -> HiddenRecord:
        """A record of a reader's decoded arrays, without the constructor's coercion."""
        rec = object.__new__(cls)
        rec.__dict__.update(key=key, input_ids=input_ids, hidden=hidden, loss_mask=loss_mask)
        return rec

    @property
    def num_rows(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def labels(self) -> np.ndarray:
        return self.input_ids[1:]

    def to_torch(self) -> dict[str, Any]:
        """Tensors: input_ids, labels (int64), hidden (float32, or bfloat16 for bit patterns),
        the key, and ``loss_mask`` (bool) when the record has one."""
        import torch

        out = {
            "key": self.key,
            "input_ids": torch.from_numpy(self.input_ids.astype(np.int64)),
            "labels": torch.from_numpy(self.labels.astype(np.int64)),
            "hidden": hidden_tensor(self.hidden),
        }
        if self.loss_mask is not None:
            out["loss_mask"] = torch.from_numpy(self.loss_mask.astype(bool))
        return out


@dataclass(frozen=True, eq=False)
class HiddenRows:
    """Rows ``[start, stop)`` of a hidden cache's flat row arrays (may span sequences)."""

    start: int
    hidden: np.ndarray  # [n, d] float32, or bfloat16 bits (uint16)
    loss_mask: np.ndarray | None = None

    @property
    def stop(self) -> int:
        return self.start + int(self.hidden.shape[0])

    def to_torch(self) -> dict[str, Any]:
        import torch

        out = {"hidden": hidden_tensor(self.hidden)}
        if self.loss_mask is not None:
            out["loss_mask"] = torch.from_numpy(self.loss_mask.astype(bool))
        return out


def hidden_tensor(h: np.ndarray) -> Any:
    """A torch tensor of decoded hidden rows: float32 as is, bfloat16 bit patterns (uint16)
    viewed as ``torch.bfloat16`` (no copy)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(h))
    return t.view(torch.bfloat16) if h.dtype == np.uint16 else t


# --------------------------------------------------------------------------- writing
def encode_rows(records: list[Any], hidden: dict[str, Any], vocab_size: int, mask: bool) -> dict:
    """The stored row arrays of a batch of :class:`HiddenRecord` (W1 for hidden stores:
    every record a HiddenRecord of the store's ``d``, ids in the vocabulary, hidden finite,
    a mask only in a mask store), plus ``"input_ids"``; :class:`RecordError` otherwise."""
    from . import spec

    dim = hidden["dim"]
    for i, r in enumerate(records):
        if not isinstance(r, HiddenRecord):
            raise RecordError(
                f'a targets="hidden" store takes HiddenRecord, got {type(r).__name__}', index=i
            )
        if r.hidden.shape[1] != dim:
            raise RecordError(
                f"hidden dim mismatch: record has {r.hidden.shape[1]}, cache has {dim}",
                key=r.key,
                index=i,
            )
        lo, hi = int(r.input_ids.min()), int(r.input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise RecordError(
                f"input_ids outside vocab [0, {vocab_size}): min {lo}, max {hi}", key=r.key, index=i
            )
        if not bool(np.isfinite(r.hidden).all()):
            raise RecordError("hidden holds NaN or inf", key=r.key, index=i)
        if r.loss_mask is not None and not mask:
            raise RecordError(
                "record has a loss_mask but the store has none (create it with loss_mask=True)",
                key=r.key,
                index=i,
            )
    h = np.concatenate([r.hidden for r in records])
    out: dict[str, np.ndarray] = {"input_ids": np.concatenate([r.input_ids for r in records])}
    if hidden["dtype"] == "bfloat16":
        out[spec.HIDDEN] = to_bf16_bits(h)
    else:
        out[spec.HIDDEN], out[spec.HIDDEN_SCALE] = encode_e4m3(h)
    if mask:
        out[spec.LOSS_MASK] = np.concatenate(
            [np.ones(r.num_rows, np.uint8) if r.loss_mask is None else r.loss_mask for r in records]
        )
    return out


def head_columns(head: TeacherHead) -> dict[str, np.ndarray]:
    """The head arrays the first commit of a hidden store writes (FORMAT.md 4.10)."""
    from . import spec

    cols = {spec.HEAD_WEIGHT: head.weight}
    if head.bias is not None:
        cols[spec.HEAD_BIAS] = head.bias
    return cols
