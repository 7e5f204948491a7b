"""Blockwise FP8 at EP > 1 over the symmetric-memory workspace (:mod:`megamoe.backends.triton_fp8.ep_symm`),
on CPU.

The MXFP8 twin's ranks (tests/megamoe/triton_mx/test_ep_symm.py) with ``precision="fp8"``: real gloo
ranks, the workspace in host shared memory, every kernel (the row transport's, the return of the rows
the FP8 GEMMs made, and the FP8 ones) under ``TRITON_INTERPRET=1``. Compared per rank with the exact
emulation (which exchanges rows with gloo ``all_to_all``), forward and backward, over layers back to
back, in each dispatch mode, with ragged tokens per rank and a rank with none. The GPU run is in
test_gpu_ep_symm.py.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.backends.triton_fp8.quantize import packed_row_bytes
from tests._dist import run_ranks
from tests.megamoe.triton_fp8.test_backend import FLOOR_DB, _assert_matches
from tests.megamoe.triton_mx.test_ep_symm import ep_symm_rank

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors need TRITON_INTERPRET=1"),
    pytest.mark.slow,  # EP ranks in Triton's interpreter: about a minute together, so not in `make unit`
]
SHAPE = (144, 32, 6, 2)  # H, I, E, K
"""H past one 128-column tile: with more pool rows than dW1 has (2I x G, the push case), fc1's dgrad
makes dx in two column ranges, each sent home on its own."""


@pytest.mark.parametrize(
    ("world", "tokens", "dispatch"),
    [
        (2, [[11, 6], [0, 9]], "broadcast"),
        (2, [[52, 20]], "push"),
        (3, [[5, 0, 8]], "pull"),
    ],
    ids=["ep2-broadcast-two-layers", "ep2-push-dx-in-two-column-ranges", "ep3-pull-a-rank-without-tokens"],
)
def test_fp8_over_symmetric_memory_matches_the_emulation(tmp_path, world, tokens, dispatch) -> None:
    for rank, layers in enumerate(
        run_ranks(ep_symm_rank, world, tmp_path, tokens, dispatch, "fp8", SHAPE, timeout=600)
    ):
        for layer, got in enumerate(layers):
            _assert_matches(got["triton"], got["reference"], FLOOR_DB, where=f"rank {rank} layer {layer} ")
            # the forward's rows travel quantised with their scales (144 E4M3 bytes and 2 float32 scales,
            # 160 bytes with the padding); the backward's dy and x rows unquantised (float32 here)
            assert got["row_bytes"] == [packed_row_bytes(SHAPE[0]), 4 * SHAPE[0], 4 * SHAPE[0]]
            assert packed_row_bytes(SHAPE[0]) == 160
