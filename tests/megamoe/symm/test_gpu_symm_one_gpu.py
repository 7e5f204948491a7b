"""The fused multi-GPU path's kernels on ONE GPU (device machine ``nvidia-h200``).

Two checks that need a GPU but not two:

* a one-rank EP group drives the whole symmetric-memory path (push to itself, epochs, waits,
  remote-out epilogue) in bf16 against the float32 reference, and captures in a CUDA graph;
* two EP ranks in one process share the GPU, each on its own stream with half the SMs: the
  cross-rank protocol (pushes into the peer's pool, epochs, combine slots) on real GPU memory with
  both ranks' kernels running at once, against the float32 reference, over 20 layers back to back.
  (PyTorch's symmetric memory refuses two processes on one device, so the buffers are plain device
  memory here; the 2-GPU tests in test_gpu_symm.py use the real thing.)
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.accuracy import cosine, snr_db
from benchmarks.common import capture
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
    from megamoe.settings import SymmSettings

    backend = SymmBackend(SymmSettings.from_env())
    leaves = [t.detach().requires_grad_() for t in (x, tw, w1, w2)]
    plan = backend.make_plan(idx, num_experts=w1.shape[0], group=group)
    handle = MegaMoEHandle(backend, plan, x.shape[0])
    h, weights, _ = _DispatchGroupedGemm.apply(leaves[0], leaves[1], leaves[2], handle)
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
    graph, captured = capture(lambda: _symm_step(*static, dist.group.WORLD), warmup=2)
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


def _ranks_on_one_gpu(
    world: int, *, topk: int, num_experts: int, hidden: int, max_tokens: int, name: str = "one-gpu"
) -> list:
    """``world`` EP ranks in this process on one GPU: one workspace each over plain device buffers,
    each rank's ops on its own stream, the fused kernel's grid split between them so that all spinning
    programs are resident at once. Returns the stand-in groups the backend finds the workspaces by."""
    from types import SimpleNamespace

    from megamoe.backends.symm import workspace as wsm
    from megamoe.settings import SymmSettings

    settings = SymmSettings.from_env()
    key_of = lambda name: wsm.WorkspaceKey(name, topk, num_experts, hidden, torch.bfloat16)  # noqa: E731
    layout = wsm.BufferLayout.build(key_of(""), world, max_tokens, settings.capacity_factor)
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device="cuda") for _ in range(world)]
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    groups = []
    for rank in range(world):
        group = SimpleNamespace(group_name=f"{name}-rank-{rank}", stream=torch.cuda.Stream())
        key = key_of(group.group_name)
        ws = layout.workspace(group, key, rank, buffers[rank], table.data_ptr(), (buffers, table), settings)
        ws.programs = sms // world - 2
        group.workspace = wsm._LIVE[key] = ws  # the group owns it; the ops find it by key
        groups.append(group)
    return groups


def _emulated_ranks(rank: int, world: int, layers: int, tokens: tuple[int, ...]) -> list[str]:
    """``len(tokens)`` ranks on one GPU, ``layers`` layers forward then backward, new routing each."""
    from megamoe.backends.symm.backend import SymmBackend
    from megamoe.backends.symm.layout import build_layout
    from megamoe.backends.triton.configs import block_m
    from megamoe.ops import MegaMoEHandle, _DispatchGroupedGemm, _GroupedGemmCombine
    from megamoe.settings import SymmSettings

    W, H, I, E, K = len(tokens), 512, 256, 8, 4
    G = E // W
    # compile and load every kernel first: loading a module waits for the GPU, so it must not happen
    # between two ranks' launches while one of them spins there
    os.environ["MEGAMOE_SYMM_WAIT_SPINS"] = "20000000"  # a stuck wait gives up (recorded) rather than hangs
    os.environ["MEGAMOE_SYMM_DISPATCH"] = "push"  # the protocol checked here (no broadcast regions below)
    # one rank with the pool of W ranks: every row count the kernels see is the same as below
    warm = _ranks_on_one_gpu(1, topk=K, num_experts=E, hidden=H, max_tokens=W * max(tokens), name="warm-up")
    with torch.cuda.stream(warm[0].stream):
        for T in sorted(set(tokens)):  # the same sizes, so that no kernel specialises differently later
            _symm_step(*_inputs(T, H, I, E, K, E, seed=0), warm[0])
    # the layout kernel specialises on the group's size and local experts: compile the W-rank one too
    i32 = dict(dtype=torch.int32, device="cuda")
    build_layout(
        torch.zeros(2, W, E, **i32), rank=0, num_local_experts=G, pool_rows=1024,
        block_m=block_m(torch.device("cuda")), epoch_1=torch.zeros(1, **i32),
    )  # fmt: skip
    torch.cuda.synchronize()
    groups = _ranks_on_one_gpu(W, topk=K, num_experts=E, hidden=H, max_tokens=max(tokens))
    backend = SymmBackend(SymmSettings.from_env())
    failures = []
    for layer in range(layers):
        cases = [_inputs(T, H, I, G, K, E, seed=100 * layer + r) for r, T in enumerate(tokens)]
        w1, w2 = _inputs(1, H, I, G, K, E, seed=7 + layer)[3:5]  # the same experts on every rank
        runs = []
        for r, group in enumerate(groups):  # forward of every rank, launched without waiting
            x, idx, tw, _, _, dy = cases[r]
            with torch.cuda.stream(group.stream):
                leaves = [
                    t.detach().requires_grad_()
                    for t in (x, tw, w1[r * G : (r + 1) * G], w2[r * G : (r + 1) * G])
                ]
                handle = MegaMoEHandle(
                    backend, backend.make_plan(idx, num_experts=E, group=group), x.shape[0]
                )
                h, weights, _ = _DispatchGroupedGemm.apply(leaves[0], leaves[1], leaves[2], handle)
                runs.append((leaves, _GroupedGemmCombine.apply(h, weights, leaves[3], handle), dy))
        grads = []
        for (leaves, y, dy), group in zip(runs, groups, strict=True):
            with torch.cuda.stream(group.stream):
                grads.append((y, *torch.autograd.grad(y, leaves, dy)))
        torch.cuda.synchronize()
        states = [g.workspace.state for g in groups]
        if any(int(st[3]) for st in states):
            head = f"layer {layer}: a wait gave up; per rank (epoch, tile, done, error, rank, counter, index, seen, expected):"
            return [head] + [str(st[:9].tolist()) for st in states]
        refs = [_reference(*(t.cpu() for t in (c[0], c[1], c[2], w1, w2, c[5]))) for c in cases]
        for r in range(W):
            for name in ("y", "dx", "d_topk_weights"):
                got, ref = grads[r][GRADS.index(name)].float().cpu(), refs[r][name]
                if ref.numel() and (cosine(got, ref) < 0.999 or snr_db(got, ref) < 35):
                    failures.append(f"layer {layer} rank {r} {name}: SNR {snr_db(got, ref):.1f} dB")
        for name in ("dw1", "dw2"):
            ref = sum(refs[r][name] for r in range(W))
            got = torch.cat([grads[r][GRADS.index(name)].float().cpu() for r in range(W)])
            if cosine(got, ref) < 0.999 or snr_db(got, ref) < 35:
                failures.append(f"layer {layer} {name}: SNR {snr_db(got, ref):.1f} dB")
    return failures


@pytest.mark.parametrize(
    ("layers", "tokens"),
    [(1, (700, 300)), (1, (512, 0)), (20, (400, 650))],
    ids=["ragged", "one-rank-no-tokens", "twenty-layers-back-to-back"],
)
def test_two_ranks_on_one_gpu_match_the_reference(tmp_path, layers, tokens) -> None:
    """The cross-rank protocol on real GPU memory: two ranks' kernels run concurrently on one GPU."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # each rank's stream on its own hardware queue
    # a kernel loaded lazily on first launch waits for the whole GPU, so with both ranks in one
    # context the first new kernel of rank 1 would wait for rank 0's spinning barrier: load all upfront
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    (failures,) = run_ranks(_emulated_ranks, 1, tmp_path, layers, tokens, backend="nccl", timeout=300)
    assert not failures, failures
