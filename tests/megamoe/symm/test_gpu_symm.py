"""The fused multi-GPU path on 2, 4 or 8 GPUs of one node (device machines ``nvidia-h200-x2`` and up).

Every test runs at each EP size in ``WORLDS`` that the node has GPUs for (EP = 2 on the 2-GPU machine,
EP = 2 and 4 on the 4-GPU one):

* bf16 accuracy against the float32 reference at EP = 2 with ragged tokens (one rank with none):
  cosine >= 0.999 and SNR >= 35 dB for y, dx, d(topk_weights), dW1, dW2;
* 20 layers back to back, forward then backward, with new routing each, against the NCCL transport
  on the same kernels (a pool or combine slot reused too early would show here);
* CUDA-graph capture of a full forward + backward, replayed on new inputs and new routing;
* determinism: the same step twice gives the same bits;
* ``torch.compile(fullgraph=True)`` of a block around the layer (inductor; the four steps are custom
  ops): the same bits as eager, forward and backward;

the first three in push mode and in broadcast mode (``MEGAMOE_SYMM_DISPATCH=broadcast``).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy import cosine, snr_db
from benchmarks.common import capture
from tests._dist import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

GRADS = ("y", "dx", "d_topk_weights", "dw1", "dw2")
H, I, G, K = 1024, 512, 8, 4  # per rank: 8 local experts of 8 * EP
WORLDS = [
    pytest.param(
        w, marks=pytest.mark.skipif(torch.cuda.device_count() < w, reason=f"needs {w} GPUs"), id=f"ep{w}"
    )
    for w in (2, 4, 8)
]


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _inputs(T: int, seed: int, *, drop: float = 0.05):
    g = torch.Generator(device="cuda").manual_seed(seed)
    world = _world()
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    scores = torch.rand(T, G * world, device="cuda", generator=g)
    idx = scores.topk(K, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, device="cuda", generator=g) < drop, -1, idx)
    tw = torch.rand(T, K, device="cuda", generator=g)
    dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    return x, idx, tw, dy


def _weights(seed: int):
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    E = G * _world()
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
    return w1, w2


def _step(x, idx, tw, w1, w2, dy, *, group, backend="triton", dtype=None, precision="bf16"):
    from megamoe import fused_mega_moe

    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(
        leaves[0], idx, leaves[1], leaves[2], leaves[3], group=group, backend=backend, precision=precision
    )
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return dict(zip(GRADS, (y.detach(), *grads), strict=True))


def _local(w, rank):
    return w[rank * G : (rank + 1) * G]


DISPATCH = pytest.mark.parametrize("dispatch", ["push", "broadcast"])


def _accuracy_rank(rank: int, world: int, tokens: tuple[int, ...], dispatch: str) -> dict:
    import os

    import torch.distributed as dist

    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch

    x, idx, tw, dy = _inputs(tokens[rank % len(tokens)], seed=rank)
    w1, w2 = _weights(0)
    ours = _step(x, idx, tw, _local(w1, rank), _local(w2, rank), dy, group=dist.group.WORLD)
    ref = _step(
        x,
        idx,
        tw,
        _local(w1, rank),
        _local(w2, rank),
        dy,
        group=dist.group.WORLD,
        backend="reference",
        dtype=torch.float32,
    )
    return {
        name: (cosine(ours[name].float(), ref[name]), snr_db(ours[name].float(), ref[name]))
        for name in GRADS
        if ref[name].numel()
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "tokens", [(3000, 1100, 2500, 700), (2048, 0, 1500, 0)], ids=["ragged", "ranks-with-no-tokens"]
)
@DISPATCH
def test_bf16_accuracy(tmp_path, world, tokens, dispatch) -> None:
    for rank, report in enumerate(
        run_ranks(_accuracy_rank, world, tmp_path, tokens, dispatch, backend="nccl", timeout=600)
    ):
        for name, (cos, snr) in report.items():
            assert cos >= 0.999 and snr >= 35, f"rank {rank} {name}: cosine {cos:.5f}, SNR {snr:.1f} dB"


def _layers_rank(
    rank: int, world: int, layers: int, dispatch: str, precision: str = "bf16"
) -> list[tuple[str, float]]:
    """Layers back to back over symmetric memory and over NCCL; the SNR of each output between them
    (shared with tests/megamoe/triton_mx/test_gpu_ep_symm.py, which passes ``mxfp8`` and ``fp8``)."""
    import os

    import torch.distributed as dist

    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch

    outs = {}
    for transport in ("symm", "nccl"):
        os.environ["MEGAMOE_EP_TRANSPORT"] = transport
        torch.manual_seed(0)
        xs = []
        for layer in range(layers):
            x, idx, tw, dy = _inputs(1500 + 300 * rank - 40 * layer, seed=100 * layer + rank)
            w1, w2 = _weights(layer)
            local = (_local(w1, rank), _local(w2, rank))
            xs.append(_step(x, idx, tw, *local, dy, group=dist.group.WORLD, precision=precision))
        outs[transport] = xs
    return [
        (f"layer {i} {name}", snr_db(a[name].float(), b[name].float()))
        for i, (a, b) in enumerate(zip(outs["symm"], outs["nccl"], strict=True))
        for name in GRADS
    ]


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
def test_twenty_layers_back_to_back_match_the_nccl_transport(tmp_path, world, dispatch) -> None:
    for rank, report in enumerate(
        run_ranks(_layers_rank, world, tmp_path, 20, dispatch, backend="nccl", timeout=600)
    ):
        for what, snr in report:
            assert snr >= 40, f"rank {rank} {what}: SNR {snr:.1f} dB against the NCCL transport"


def _graph_rank(rank: int, world: int, dispatch: str, precision: str = "bf16") -> dict:
    """A captured forward + backward replayed on new inputs and routing, against eager (shared with
    tests/megamoe/triton_mx/test_gpu_ep_symm.py, which passes ``mxfp8`` and ``fp8``)."""
    import os

    import torch.distributed as dist

    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch
    os.environ["MEGAMOE_EP_TRANSPORT"] = "symm"  # FP8's default is NCCL, which cannot be captured

    from megamoe import fused_mega_moe

    group = dist.group.WORLD
    w1, w2 = (_local(w, rank).detach().requires_grad_() for w in _weights(0))
    static = [t.clone() for t in _inputs(1024 + 256 * rank, seed=rank)]
    x_s, idx_s, tw_s, dy_s = static
    x_s.requires_grad_()
    tw_s.requires_grad_()

    def step():
        y = fused_mega_moe(x_s, idx_s, tw_s, w1, w2, group=group, backend="triton", precision=precision)
        return (y, *torch.autograd.grad(y, (x_s, tw_s, w1, w2), dy_s))

    graph, captured = capture(step, warmup=3)
    results = {}
    for trial in range(3):
        fresh = _inputs(1024 + 256 * rank, seed=50 + 10 * trial + rank)
        with torch.no_grad():
            for dst, src in zip(static, fresh, strict=True):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = _step(*fresh[:3], w1, w2, fresh[3], group=group, precision=precision)
        for name, got in zip(GRADS, captured, strict=True):
            results[f"replay {trial} {name}"] = torch.equal(got, eager[name])
    return results


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
def test_cuda_graph_capture_and_replay_of_a_full_step(tmp_path, world, dispatch) -> None:
    for rank, report in enumerate(
        run_ranks(_graph_rank, world, tmp_path, dispatch, backend="nccl", timeout=600)
    ):
        assert all(report.values()), f"rank {rank}: replay differs from eager: {report}"


def _determinism_rank(rank: int, world: int) -> bool:
    import torch.distributed as dist

    x, idx, tw, dy = _inputs(2000 - 500 * (rank % 4), seed=rank)
    w1, w2 = _weights(0)
    runs = [
        _step(x, idx, tw, _local(w1, rank), _local(w2, rank), dy, group=dist.group.WORLD) for _ in range(3)
    ]
    return all(torch.equal(runs[0][n], r[n]) for r in runs[1:] for n in GRADS)


@pytest.mark.parametrize("world", WORLDS)
def test_same_bits_every_run(tmp_path, world) -> None:
    assert all(run_ranks(_determinism_rank, world, tmp_path, backend="nccl", timeout=600))


def _compile_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megamoe import fused_mega_moe

    torch._dynamo.config.disable = False  # the rank workers start with dynamo off (tests/_dist.py)
    group = dist.group.WORLD
    w1, w2 = (_local(w, rank) for w in _weights(0))

    def block(x, idx, tw, w1, w2):  # torch ops around the layer for inductor, exact in bf16 either way
        return x + fused_mega_moe(x * 0.5, idx, tw * 2.0, w1, w2, group=group, backend="triton")

    compiled = torch.compile(block, fullgraph=True)
    results = {}
    for trial in range(2):  # new routing, fewer tokens (the workspace holds the first call's count)
        x, idx, tw, dy = _inputs(1500 - 700 * rank - 100 * trial, seed=10 * trial + rank)
        outs = []
        for fn in (block, compiled):
            leaves = [t.detach().clone().requires_grad_() for t in (x, tw, w1, w2)]
            y = fn(leaves[0], idx, *leaves[1:])
            outs.append((y, *torch.autograd.grad(y, leaves, dy)))
        for name, eager, got in zip(GRADS, *outs, strict=True):
            results[f"trial {trial} {name}"] = torch.equal(eager, got)
    return results


@pytest.mark.parametrize("world", WORLDS)
def test_a_fullgraph_compiled_block_around_the_layer_gives_eager_bits(tmp_path, world) -> None:
    for rank, report in enumerate(run_ranks(_compile_rank, world, tmp_path, backend="nccl", timeout=600)):
        assert all(report.values()), f"rank {rank}: torch.compile differs from eager: {report}"
