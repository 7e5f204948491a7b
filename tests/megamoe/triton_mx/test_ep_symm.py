"""MXFP8 at EP > 1 over the symmetric-memory workspace (:mod:`megamoe.backends.triton_mx.ep_symm`), on CPU.

Real gloo ranks, the workspace in host shared memory, every kernel (the row transport's and the MX
ones) under ``TRITON_INTERPRET=1``, as tests/megamoe/symm/test_fused_interpreted.py. Compared per rank
with the exact emulation (which exchanges rows with gloo ``all_to_all``), forward and backward, over
layers back to back (a peer never overwrites a pool or combine slot still being read), in each dispatch
mode, with ragged tokens per rank and a rank with none. The GPU run is in test_gpu_backend.py.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy import snr_db
from tests._dist import run_ranks
from tests.megamoe.triton_mx.test_backend import GRADS, _case

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors need TRITON_INTERPRET=1"),
    pytest.mark.slow,  # EP ranks in Triton's interpreter: about a minute together, so not in `make unit`
]
SHAPE = (32, 16, 6, 2)  # H, I, E, K


def ep_symm_rank(
    rank: int,
    world: int,
    tokens: list[list[int]],
    dispatch: str,
    precision: str = "mxfp8",
    shape: tuple[int, int, int, int] = SHAPE,
) -> list[dict]:
    """Per layer, ``{"triton": outputs, "reference": outputs, "row_bytes": [...]}`` of one rank:
    ``row_bytes``, the bytes of one moved row for each op that moves rows, in order (the FP8 twin of
    this test runs it with its precision and shape)."""
    import os

    import torch.distributed as dist

    from megamoe import fused_mega_moe
    from megamoe.backends.symm import transport
    from megamoe.backends.symm.workspace import live_workspaces
    from tests.megamoe.triton.interpreter_compat import install

    install()
    row_bytes: list[int] = []
    dispatch_rows = transport.dispatch_rows

    def recording(plan, src_TH, *args, **kwargs):
        row_bytes.append(src_TH.shape[1] * src_TH.element_size())
        return dispatch_rows(plan, src_TH, *args, **kwargs)

    transport.dispatch_rows = recording  # a rank process of its own: nothing else sees it
    os.environ["MEGAMOE_EP_TRANSPORT"] = "symm"
    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch
    os.environ["MEGAMOE_SYMM_DEBUG"] = "1"  # a stuck wait raises instead of hanging the test
    os.environ["MEGAMOE_SYMM_MAX_TOKENS"] = str(max(max(layer) for layer in tokens))
    H, I, E, K = shape
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
        row_bytes.clear()
        for backend in ("triton", "reference"):
            leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
            y = fused_mega_moe(
                leaves[0], idx, *leaves[1:], group=dist.group.WORLD, backend=backend, precision=precision
            )
            grads = torch.autograd.grad(y, leaves, dy)
            got[backend] = dict(zip(GRADS, (y.detach(), *grads), strict=True))
        got["row_bytes"] = list(row_bytes)
        out.append(got)
    (ws,) = live_workspaces()
    assert int(ws.state[0]) == 4 * len(tokens)  # the symm transport ran: one epoch per step
    return out


@pytest.mark.parametrize(
    ("world", "tokens", "dispatch"),
    [
        (2, [[11, 6], [0, 9]], "broadcast"),
        (2, [[11, 6], [0, 9]], "push"),
        (2, [[7, 10]], "pull"),
        (3, [[5, 0, 8]], "push"),
    ],
    ids=["ep2-broadcast-two-layers", "ep2-push-two-layers", "ep2-pull", "ep3-push-a-rank-without-tokens"],
)
def test_mxfp8_over_symmetric_memory_matches_the_emulation(tmp_path, world, tokens, dispatch) -> None:
    for rank, layers in enumerate(run_ranks(ep_symm_rank, world, tmp_path, tokens, dispatch, timeout=600)):
        for layer, got in enumerate(layers):
            for name in GRADS:
                ours, ref = got["triton"][name], got["reference"][name]
                assert ours.shape == ref.shape and ours.dtype == ref.dtype, (rank, layer, name)
                if ref.numel() == 0 or ref.abs().max() == 0:
                    assert (ours == 0).all(), f"rank {rank} layer {layer} {name}: expected zeros"
                    continue
                db = snr_db(ours, ref)
                assert db >= 60.0, f"rank {rank} layer {layer} {name}: {db:.1f} dB"
            # x, dy and x again move unquantised (float32 here): GEMM1 quantises its rows where they land
            assert got["row_bytes"] == [4 * SHAPE[0]] * 3
