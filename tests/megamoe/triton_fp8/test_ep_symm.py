"""Blockwise FP8 at EP > 1 over the symmetric-memory workspace (:mod:`megamoe.backends.triton_fp8.ep_symm`),
on CPU.

Real gloo ranks, the workspace in host shared memory, every kernel (the row transport's, the return of
the rows the FP8 GEMMs made, and the FP8 ones) under ``TRITON_INTERPRET=1``, as
tests/megamoe/triton_mx/test_ep_symm.py. Compared per rank with the exact emulation (which exchanges
rows with gloo ``all_to_all``), forward and backward, over layers back to back, in each dispatch mode,
with ragged tokens per rank and a rank with none. The GPU run needs two GPUs.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests.megamoe.triton_fp8.test_backend import FLOOR_DB, _assert_matches
from tests.megamoe.triton_mx.test_backend import GRADS, _case

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors need TRITON_INTERPRET=1"),
    pytest.mark.slow,  # EP ranks in Triton's interpreter: about a minute together, so not in `make unit`
]
H, I, E, K = 144, 32, 6, 2
# H past one 128-column tile: with more pool rows than dW1 has (2I x G, the push case), fc1's dgrad
# makes dx in two column ranges, each sent home on its own


def _rank(rank: int, world: int, tokens: list[list[int]], dispatch: str) -> list[dict]:
    import os

    import torch.distributed as dist

    from megamoe import fused_mega_moe
    from megamoe.backends.symm.workspace import live_workspaces
    from tests.megamoe.triton.interpreter_compat import install

    install()
    os.environ["MEGAMOE_EP_TRANSPORT"] = "symm"
    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch
    os.environ["MEGAMOE_SYMM_DEBUG"] = "1"  # a stuck wait raises instead of hanging the test
    os.environ["MEGAMOE_SYMM_MAX_TOKENS"] = str(max(max(layer) for layer in tokens))
    G = E // world
    out = []
    for layer, per_rank in enumerate(tokens):
        x, idx, tw, _, _, dy = _case(
            per_rank[rank], H, I, E, K, drop=0.1, seed=10 * layer + rank, device="cpu"
        )
        w1, w2 = (
            w[rank * G : (rank + 1) * G] for w in _case(4, H, I, E, K, drop=0, seed=layer, device="cpu")[3:5]
        )
        got = {}
        for backend in ("triton", "reference"):
            leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
            y = fused_mega_moe(
                leaves[0], idx, *leaves[1:], group=dist.group.WORLD, backend=backend, precision="fp8"
            )
            grads = torch.autograd.grad(y, leaves, dy)
            got[backend] = dict(zip(GRADS, (y.detach(), *grads), strict=True))
        out.append(got)
    (ws,) = live_workspaces()
    assert int(ws.state[0]) == 4 * len(tokens)  # the symm transport ran: one epoch per step
    return out


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
    for rank, layers in enumerate(run_ranks(_rank, world, tmp_path, tokens, dispatch, timeout=600)):
        for layer, got in enumerate(layers):
            _assert_matches(got["triton"], got["reference"], FLOOR_DB, where=f"rank {rank} layer {layer} ")
