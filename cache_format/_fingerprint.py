"""Tokenizer fingerprint: a hash of what decides token ids (FORMAT.md §4.2).

``sha256`` over canonical JSON of: the vocabulary (``get_vocab()``: token -> id), the special
tokens (names -> tokens and ids: bos/eos/unk/pad/... and additional specials), and, for fast
tokenizers, the backend pipeline (normalizer, pre-tokenizer, model incl. merges, post-processor,
added tokens; runtime padding/truncation state excluded). Duck-typed: works on HF
``PreTrainedTokenizer(Fast)`` and ``tokenizers.Tokenizer`` objects without importing transformers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

_SPECIAL_ATTRS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


def _backend_json(tok: Any) -> Any:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None and type(tok).__module__.startswith("tokenizers"):
        backend = tok
    if backend is None or not hasattr(backend, "to_str"):
        return None
    try:
        data = json.loads(backend.to_str())
    except Exception:
        return None
    data.pop("padding", None)
    data.pop("truncation", None)
    return data


def _specials(tok: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for attr in _SPECIAL_ATTRS:
        value = getattr(tok, attr, None)
        if value is not None:
            out[attr] = str(value)
            tid = getattr(tok, attr + "_id", None)
            if isinstance(tid, int):
                out[attr + "_id"] = tid
    extra = getattr(tok, "additional_special_tokens", None)
    if extra:
        out["additional_special_tokens"] = [str(t) for t in extra]
    ids = getattr(tok, "all_special_ids", None)
    if ids:
        out["all_special_ids"] = sorted(int(i) for i in ids)
    return out


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """``"sha256:<hex>"`` identifying ``tokenizer``'s id assignment (see module docstring);
    TypeError for objects without ``get_vocab()``."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        raise TypeError(f"{type(tokenizer).__name__} has no get_vocab(); not a tokenizer")
    vocab = get_vocab()
    doc = {
        "vocab": sorted((str(t), int(i)) for t, i in vocab.items()),
        "specials": _specials(tokenizer),
        "backend": _backend_json(tokenizer),
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()
