"""What a job does with a sequence longer than the server's max length, and the input counts a
job reports (``JobCreate.on_long``, ``JobStatus.input``).

``on_long`` (for a sequence of ``L > M`` tokens, ``M`` = the server's effective max sequence
length, printed in the start-up banner):

* ``reject`` (default): the job is refused (422/413 listing the records), nothing written;
* ``skip``: the record is left out and counted (``skipped``);
* ``truncate``: its first ``M`` tokens are scored (``truncated``); the key is the record's id,
  else the content key of the kept tokens;
* ``split``: it is scored as windows of at most ``M`` tokens (``split``, ``windows``). With
  ``O = split_overlap`` (default 1, ``1 <= O < M``) and stride ``S = M - O``, window ``w`` holds
  tokens ``[w*S, min(w*S + M, L))``; the last window is the first that reaches ``L``. Window
  ``w``'s row ``j`` is the teacher's distribution of token ``w*S + j + 1`` given tokens
  ``w*S .. w*S + j`` (the window only: the context is cut at the window's start). With ``O = 1``
  consecutive windows share one token, so the windows' rows, concatenated in window order, are
  exactly the ``L - 1`` rows of the whole sequence, each position predicted once; with ``O > 1``
  the first ``O - 1`` rows of every window after the first repeat positions the window before
  already predicted (with less context), in exchange for more context on the rest. Window keys
  are ``<key>#w<index>`` where ``<key>`` is the record's id, else the content key of all ``L``
  tokens, so a trainer can put a split record back together.

Duplicates: a record whose content key (no explicit id) was seen before is dropped and counted
(``duplicates``); an explicit id seen twice is an error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def windows(n: int, max_seq_len: int, overlap: int = 1) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of the split windows of an ``n``-token sequence (module docstring)."""
    if not 1 <= overlap < max_seq_len:
        raise ValueError(f"split_overlap must be in [1, {max_seq_len}), got {overlap}")
    if n <= max_seq_len:
        return [(0, n)]
    stride = max_seq_len - overlap
    out = []
    start = 0
    while True:
        stop = min(start + max_seq_len, n)
        out.append((start, stop))
        if stop >= n:
            return out
        start += stride


def window_key(key: str, index: int) -> str:
    return f"{key}#w{index}"


@dataclass
class InputCounts:
    """What a job's input held: records read, sequences to score, and what was done to the rest."""

    records: int = 0
    sequences: int = 0
    duplicates: int = 0
    skipped: int = 0
    truncated: int = 0
    split: int = 0
    windows: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
