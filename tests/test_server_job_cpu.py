"""The job path's cheaper steps (issue #19) give the same answers as the checks they replace."""

from __future__ import annotations

import numpy as np
import pytest
from logitcache.server import inputs
from logitcache.server.errors import InvalidInputError

LIMITS = inputs.Limits(vocab_size=100, max_seq_len=8)


@pytest.mark.parametrize(
    "ids",
    [
        [1, 2, 99],
        (1, 2, 99),
        [np.int64(1), 2, 99],  # numpy integers take the per-token path
        [np.uint8(1), np.int32(2), 99],
    ],
)
def test_check_ids_plain_and_numpy_ints(ids: list) -> None:
    arr = inputs.check_ids(ids, LIMITS, "x")
    assert arr.dtype == np.int32 and arr.flags.c_contiguous and arr.tolist() == [1, 2, 99]


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, True], "list of integers"),
        ([False, 1], "list of integers"),
        ([1, 2.0], "list of integers"),
        ([1, "2"], "list of integers"),
        ([1, None], "list of integers"),
        ([[1, 2], [3, 4]], "list of integers"),
        ([1, 2**31], r"outside the teacher's vocabulary \[0, 100\)"),
        ([-(2**31) - 1, 1], r"outside the teacher's vocabulary \[0, 100\)"),
        ([1, 2**70], r"outside the teacher's vocabulary \[0, 100\)"),
        ([1, 100], "token id 100 outside"),
        ([], "at least 2 tokens"),
    ],
)
def test_check_ids_rejects(ids: list, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        inputs.check_ids(ids, LIMITS, "x")
