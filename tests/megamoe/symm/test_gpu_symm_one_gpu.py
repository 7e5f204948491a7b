"""The fused multi-GPU path's kernels on ONE GPU (device machine ``nvidia-h200``).

Two checks that need a GPU but not two:

* a one-rank EP group drives the whole symmetric-memory path (push to itself, epochs, waits,
  remote-out epilogue) in bf16 against the float32 reference, and captures in a CUDA graph;
* two processes share the GPU over a gloo group: real CUDA symmetric memory between processes
  (IPC-mapped peer buffers) and the cross-rank protocol, against the float32 reference on the CPU.
  Kernels of two processes time-slice on one GPU, so this checks correctness, never speed.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.quant.accuracy import cosine, snr_db
from tests._dist import run_ranks

pytestmark = pytest.mark.gpu

GRADS = ("y", "dx", "d_topk_weights", "dw1", "dw2")


def _inputs(T: int, H: int, I: int, G: int, K: int, E: int, seed: int, device: str = "cuda"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.05, -1, idx)
    tw = torch.rand(T, K, generator=g)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    return [t.to(device) for t in (x, idx, tw, w1, w2, dy)]


def _symm_step(x, idx, tw, w1, w2, dy, group):
    from megamoe.backends.symm.backend import SymmBackend
    from megamoe.ops import MegaMoEHandle, _DispatchGroupedGemm, _GroupedGemmCombine

    backend = SymmBackend()
    leaves = [t.detach().requires_grad_() for t in (x, tw, w1, w2)]
    plan = backend.make_plan(idx, num_experts=w1.shape[0], group=group)
    handle = MegaMoEHandle(backend, plan, x.shape[0])
    h, weights = _DispatchGroupedGemm.apply(leaves[0], leaves[1], leaves[2], handle)
    y = _GroupedGemmCombine.apply(h, weights, leaves[3], handle)
    return (y, *torch.autograd.grad(y, leaves, dy))


def _reference(x, idx, tw, w1, w2, dy, group=None):
    from megamoe import fused_mega_moe

    leaves = [t.detach().float().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], group=group, backend="reference")
    return dict(zip(GRADS, (y.detach(), *torch.autograd.grad(y, leaves, dy.float())), strict=True))


def _check(ours, ref, where: str) -> None:
    for name, got in zip(GRADS, ours, strict=True):
        if ref[name].numel():
            cos, snr = cosine(got.float().cpu(), ref[name].cpu()), snr_db(got.float().cpu(), ref[name].cpu())
            assert cos >= 0.999 and snr >= 35, f"{where} {name}: cosine {cos:.5f}, SNR {snr:.1f} dB"


def _one_rank(rank: int, world: int) -> None:
    import torch.distributed as dist

    case = _inputs(3000, 1024, 512, 16, 4, 16, seed=0)
    ours = _symm_step(*case, dist.group.WORLD)
    _check(ours, _reference(*case), "one rank")
    static = [t.clone() for t in case]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _symm_step(*static, dist.group.WORLD)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _symm_step(*static, dist.group.WORLD)
    for seed in (1, 2):
        fresh = _inputs(3000, 1024, 512, 16, 4, 16, seed=seed)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        eager = _symm_step(*fresh, dist.group.WORLD)
        for name, a, b in zip(GRADS, captured, eager, strict=True):
            assert torch.equal(a, b), f"graph replay {seed}: {name} differs from eager"


def test_one_rank_group_drives_the_fused_path_and_captures(tmp_path) -> None:
    run_ranks(_one_rank, 1, tmp_path, backend="nccl", timeout=300)


def _two_processes(rank: int, world: int, tokens: tuple[int, int]) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0", MEGAMOE_SYMM_DEBUG="1")
    torch.cuda.set_device(0)
    x, idx, tw, w1, w2, dy = _inputs(tokens[rank], 512, 256, 8, 4, 8, seed=rank)
    _, _, _, w1, w2, _ = _inputs(1, 512, 256, 8, 4, 8, seed=99)  # the same weights on both ranks
    local = [w[rank * 4 : (rank + 1) * 4] for w in (w1, w2)]
    from megamoe import fused_mega_moe

    leaves = [t.detach().requires_grad_() for t in (x, tw, *local)]
    y = fused_mega_moe(
        leaves[0], idx, leaves[1], leaves[2], leaves[3], group=dist.group.WORLD, backend="triton"
    )
    ours = (y, *torch.autograd.grad(y, leaves, dy))
    cpu = [t.cpu() for t in (x, idx, tw, *local, dy)]
    _check(ours, _reference(*cpu, group=dist.group.WORLD), f"rank {rank}")


@pytest.mark.parametrize("tokens", [(700, 300), (512, 0)], ids=["ragged", "one-rank-no-tokens"])
def test_two_processes_on_one_gpu_exchange_through_symmetric_memory(tmp_path, tokens) -> None:
    run_ranks(_two_processes, 2, tmp_path, tokens, backend="gloo", timeout=300)
