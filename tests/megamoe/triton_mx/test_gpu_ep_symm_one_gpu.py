"""MXFP8 and blockwise FP8 over the symmetric-memory workspace on ONE GPU (device machine ``nvidia-h200``).

A one-rank EP group drives the quantised backends' whole symmetric-memory path on real GPU memory: the
rows moved through the workspace (FP8: quantised at the source, scales beside the bytes, in narrower
rows), the format's GEMMs on them (on Hopper the Gluon kernels), the rows sent home (the MX GEMMs'
remote epilogue; FP8's ``return_rows``), the combine; forward and backward, in every dispatch mode:

* against the precision's exact emulation: SNR >= 40 dB for y, dx, d_topk_weights, dW1, dW2 (the bar
  of the kernels on one GPU);
* a captured forward + backward replayed on new inputs and routing gives eager's bits (a test of its
  own, so that a capture failure does not hide the accuracy).

The cross-rank protocol needs two GPUs: test_gpu_ep_symm.py.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy import snr_db
from benchmarks.common import capture
from tests._dist import run_ranks

pytestmark = pytest.mark.gpu

GRADS = ("y", "dx", "d_topk_weights", "dw1", "dw2")
T, H, I, E, K = 2000, 1024, 512, 8, 4


def _inputs(seed: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, generator=g).bfloat16()
    idx = torch.rand(T, E, device=device, generator=g).topk(K, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, device=device, generator=g) < 0.05, -1, idx)
    tw = torch.rand(T, K, device=device, generator=g)
    dy = torch.randn(T, H, device=device, generator=g).bfloat16()
    return [x, idx, tw, dy]


def _one_rank(
    rank: int, world: int, dispatch: str, precision: str, graphs: bool, device: str = "cuda"
) -> dict[str, float]:
    """SNR against the emulation per output of one eager step; with ``graphs`` instead, after that step,
    a captured step's replays on new inputs and routing against eager, bit for bit (and ``{}``)."""
    import os

    import torch.distributed as dist

    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch
    from megamoe import fused_mega_moe
    from megamoe.backends.symm.workspace import live_workspaces
    from megamoe.backends.triton_fp8.ep_symm import FP8SymmBackend
    from megamoe.backends.triton_mx.ep_symm import MXFP8SymmBackend
    from megamoe.ops import MegaMoEHandle, _DispatchGroupedGemm, _GroupedGemmCombine, _with_state
    from megamoe.settings import SymmSettings

    group = dist.group.WORLD
    backend = (FP8SymmBackend if precision == "fp8" else MXFP8SymmBackend)(SymmSettings.from_env())
    g = torch.Generator(device=device).manual_seed(1000)
    w1 = (torch.randn(E, 2 * I, H, device=device, generator=g) / H**0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device=device, generator=g) / I**0.5).bfloat16().requires_grad_()

    def ours(x, idx, tw, dy):
        # fresh leaves each call: a leaf shared with an earlier call's live graph keeps that call's
        # gradient accumulator, and with it the stream it ran on, which a capture must not wait on
        leaves = [t.detach().requires_grad_() for t in (x, tw, w1, w2)]
        handle = MegaMoEHandle(backend, backend.make_plan(idx, num_experts=E, group=group), x.shape[0])
        h, weights, act, *state = _DispatchGroupedGemm.apply(leaves[0], leaves[1], leaves[2], handle)
        y = _GroupedGemmCombine.apply(h, weights, leaves[3], _with_state(handle, state), act, True)
        return (y.detach(), *torch.autograd.grad(y, leaves, dy))

    case = _inputs(0, device)
    got = ours(*case)
    (ws,) = live_workspaces()
    assert ws.dispatch == dispatch and int(ws.state[0]) > 0  # the symmetric-memory transport ran
    if graphs:
        static = [t.clone() for t in case]
        graph, captured = capture(lambda: ours(*static), warmup=2)
        for seed in (1, 2):
            fresh = _inputs(seed, device)
            for dst, src in zip(static, fresh, strict=True):
                dst.copy_(src)
            graph.replay()
            eager = ours(*fresh)
            for name, a, b in zip(GRADS, captured, eager, strict=True):
                assert torch.equal(a, b), f"graph replay {seed}: {name} differs from eager"
        return {}
    leaves = [t.detach().requires_grad_() for t in (case[0], case[2], w1, w2)]
    y = fused_mega_moe(
        *leaves[:1], case[1], *leaves[1:], group=group, backend="reference", precision=precision
    )
    want = (y, *torch.autograd.grad(y, leaves, case[3]))
    return {n: snr_db(a.float(), b.float()) for n, a, b in zip(GRADS, got, want, strict=True)}


DISPATCH = pytest.mark.parametrize("dispatch", ["push", "broadcast", "pull"])


@DISPATCH
@pytest.mark.parametrize("precision", ["mxfp8", "fp8"])
def test_one_rank_group_matches_the_emulation(tmp_path, dispatch, precision) -> None:
    (report,) = run_ranks(_one_rank, 1, tmp_path, dispatch, precision, False, backend="nccl", timeout=300)
    print({n: f"{s:.1f} dB" for n, s in report.items()})
    for name, snr in report.items():
        assert snr >= 40, f"{name}: SNR {snr:.1f} dB against the {precision} emulation"


@DISPATCH
@pytest.mark.parametrize("precision", ["mxfp8", "fp8"])
def test_one_rank_group_captures_in_a_cuda_graph(tmp_path, dispatch, precision) -> None:
    run_ranks(_one_rank, 1, tmp_path, dispatch, precision, True, backend="nccl", timeout=300)
