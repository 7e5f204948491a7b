"""The row-block starts of the blocked along-R operands, in one launch (interpreted on CPU, run as is on
a GPU): against the formula, with empty experts, partial and aligned blocks."""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton.segments import block_starts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _want(counts: list[int], block: int, align: int) -> list[int]:
    starts = [0]
    for rows in counts:
        blocks = -(-rows // block)
        starts.append(starts[-1] + -(-blocks // align) * align)
    return starts


@pytest.mark.parametrize(
    ("counts", "block", "align"),
    [
        ([300, 0, 128, 1, 0], 128, 1),  # empty experts, a partial block, an exact one
        ([0], 128, 1),  # one expert, no rows
        ([5], 32, 1),
        ([33, 0, 64, 100, 7, 0, 31], 32, 2),  # the MX wgrad's aligned segments
        ([1] * 37, 32, 4),  # G not a power of two
    ],
)
def test_block_starts_are_the_exclusive_sum_of_each_experts_blocks(counts, block, align) -> None:
    row_start = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    got = block_starts(row_start, block=block, align=align)
    assert got.dtype == torch.int32 and got.device == row_start.device
    assert got.tolist() == _want(counts, block, align)
