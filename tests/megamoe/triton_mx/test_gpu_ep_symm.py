"""MXFP8 at EP > 1 over symmetric memory on 2, 4 or 8 GPUs of one node (device machines ``nvidia-h200-x2``
and up): ``pytest -m multigpu tests/megamoe/triton_mx/test_gpu_ep_symm.py``.

At each EP size the node has GPUs for, in push and in broadcast mode:

* against the MX emulation (which exchanges rows with NCCL ``all_to_all``), ragged
  tokens and a rank with none: SNR >= 40 dB for y, dx, d_topk_weights, dW1, dW2 (test_gpu_backend.py's
  bar for the kernels on one GPU);
* five layers back to back, against the NCCL transport on the same MX kernels: SNR >= 40 dB (a pool or
  combine slot reused too early would show);
* CUDA-graph capture of a full forward + backward, replayed on new inputs and routing: eager's bits.
  (The NCCL transport reads split sizes on the host and cannot be captured.)
"""

from __future__ import annotations

import pytest
import torch

from megamoe.quant.accuracy import snr_db
from tests._dist import run_ranks
from tests.megamoe.cuda_graphs import capture
from tests.megamoe.symm.test_gpu_symm import GRADS, WORLDS, _inputs, _local, _weights

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
DISPATCH = pytest.mark.parametrize("dispatch", ["push", "broadcast"])


def _step(x, idx, tw, w1, w2, dy, *, group, backend="triton") -> dict[str, torch.Tensor]:
    from megamoe import fused_mega_moe

    leaves = [t.detach().clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(leaves[0], idx, *leaves[1:], group=group, backend=backend, precision="mxfp8")
    grads = torch.autograd.grad(y, leaves, dy)
    return dict(zip(GRADS, (y.detach(), *grads), strict=True))


def _setup(dispatch: str, transport: str = "symm"):
    import os

    import torch.distributed as dist

    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch
    os.environ["MEGAMOE_EP_TRANSPORT"] = transport
    return dist.group.WORLD


def _accuracy_rank(rank: int, world: int, tokens: tuple[int, ...], dispatch: str) -> dict[str, float]:
    group = _setup(dispatch)
    x, idx, tw, dy = _inputs(tokens[rank % len(tokens)], seed=rank)
    w1, w2 = (_local(w, rank) for w in _weights(0))
    ours = _step(x, idx, tw, w1, w2, dy, group=group)
    ref = _step(x, idx, tw, w1, w2, dy, group=group, backend="reference")
    return {n: snr_db(ours[n].float(), ref[n].float()) for n in GRADS if ref[n].numel()}


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
def test_mxfp8_over_symmetric_memory_matches_the_emulation(tmp_path, world, dispatch) -> None:
    tokens = (3000, 0, 2500, 700)
    for rank, report in enumerate(
        run_ranks(_accuracy_rank, world, tmp_path, tokens, dispatch, backend="nccl", timeout=600)
    ):
        print(f"rank {rank}:", {n: f"{s:.1f} dB" for n, s in report.items()})
        for name, snr in report.items():
            assert snr >= 40, f"rank {rank} {name}: SNR {snr:.1f} dB against the MX emulation"


def _layers_rank(rank: int, world: int, layers: int, dispatch: str) -> list[tuple[str, float]]:
    outs = {}
    for transport in ("symm", "nccl"):
        group = _setup(dispatch, transport)
        steps = []
        for layer in range(layers):
            x, idx, tw, dy = _inputs(1500 + 300 * rank - 40 * layer, seed=100 * layer + rank)
            w1, w2 = (_local(w, rank) for w in _weights(layer))
            steps.append(_step(x, idx, tw, w1, w2, dy, group=group))
        outs[transport] = steps
    return [
        (f"layer {i} {name}", snr_db(a[name].float(), b[name].float()))
        for i, (a, b) in enumerate(zip(outs["symm"], outs["nccl"], strict=True))
        for name in GRADS
    ]


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
def test_layers_back_to_back_match_the_nccl_transport(tmp_path, world, dispatch) -> None:
    for rank, report in enumerate(
        run_ranks(_layers_rank, world, tmp_path, 5, dispatch, backend="nccl", timeout=600)
    ):
        for what, snr in report:
            assert snr >= 40, f"rank {rank} {what}: SNR {snr:.1f} dB against the NCCL transport"


def _graph_rank(rank: int, world: int, dispatch: str) -> dict[str, bool]:
    from megamoe import fused_mega_moe

    group = _setup(dispatch)
    w1, w2 = (_local(w, rank).detach().requires_grad_() for w in _weights(0))
    static = [t.clone() for t in _inputs(1024 + 256 * rank, seed=rank)]
    x_s, idx_s, tw_s, dy_s = static
    x_s.requires_grad_()
    tw_s.requires_grad_()

    def step():
        y = fused_mega_moe(x_s, idx_s, tw_s, w1, w2, group=group, backend="triton", precision="mxfp8")
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
        eager = _step(*fresh[:3], w1, w2, fresh[3], group=group)
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
