"""check_record's row checks (distinct ids, descending logprobs) on row boundaries."""

from __future__ import annotations

import numpy as np
import pytest
from logitcache.cache_format import SequenceRecord, check_record
from logitcache.cache_format.errors import RecordError


def _record(ids: list[list[int]], lps: list[list[float]]) -> SequenceRecord:
    rows = len(ids)
    return SequenceRecord(
        key="s",
        input_ids=np.arange(rows + 1, dtype=np.int32),
        topk_ids=np.array(ids, dtype=np.int32),
        topk_logprobs=np.array(lps, dtype=np.float32),
    )


def test_values_repeated_across_rows_are_allowed() -> None:
    # row 0 ends with the id and logprob row 1 starts with: no pair within a row
    rec = _record([[1, 2, 3], [3, 2, 1]], [[-0.1, -0.5, -3.0], [-0.01, -0.6, -0.7]])
    check_record(rec, k=3, vocab_size=8)


@pytest.mark.parametrize("row", [0, 2])
def test_repeated_id_within_a_row_names_the_row(row: int) -> None:
    ids = [[1, 2, 3], [4, 5, 6], [7, 0, 2]]
    ids[row][2] = ids[row][0]
    rec = _record(ids, [[-0.1, -0.2, -0.3]] * 3)
    with pytest.raises(RecordError, match=f"row {row}: repeated token id"):
        check_record(rec, k=3, vocab_size=8)


@pytest.mark.parametrize("row", [0, 2])
def test_unsorted_logprobs_name_the_row(row: int) -> None:
    lps = [[-0.1, -0.2, -0.3] for _ in range(3)]
    lps[row][2] = -0.15
    rec = _record([[1, 2, 3]] * 3, lps)
    with pytest.raises(RecordError, match=f"row {row}: logprobs not sorted descending"):
        check_record(rec, k=3, vocab_size=8)


def test_k1_rows_pass() -> None:
    check_record(_record([[1], [1]], [[-0.5], [-0.1]]), k=1, vocab_size=8)
