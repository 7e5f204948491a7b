"""MXFP8 and blockwise FP8 at EP > 1 over symmetric memory on 2, 4 or 8 GPUs of one node (device
machines ``nvidia-h200-x2`` and up): ``pytest -m multigpu tests/megamoe/triton_mx/test_gpu_ep_symm.py``
(both quantised paths use the workspace's unfused transport, ``megamoe/backends/symm/transport.py``).

At each EP size the node has GPUs for, in push and in broadcast mode, for each precision:

* against the precision's emulation (which exchanges rows with NCCL ``all_to_all``), ragged
  tokens and a rank with none: SNR >= 40 dB for y, dx, d_topk_weights, dW1, dW2 (test_gpu_backend.py's
  bar for the kernels on one GPU);
* five layers back to back, against the NCCL transport on the same kernels: SNR >= 40 dB (a pool or
  combine slot reused too early would show);
* CUDA-graph capture of a full forward + backward, replayed on new inputs and routing: eager's bits.
  (The NCCL transport reads split sizes on the host and cannot be captured.)

The last two are test_gpu_symm.py's rank functions with the precision.
"""

from __future__ import annotations

import pytest

from benchmarks.accuracy import snr_db
from tests._dist import run_ranks
from tests.megamoe.symm.test_gpu_symm import (
    GRADS,
    WORLDS,
    _graph_rank,
    _inputs,
    _layers_rank,
    _local,
    _step,
    _weights,
)

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
DISPATCH = pytest.mark.parametrize("dispatch", ["push", "broadcast"])
PRECISION = pytest.mark.parametrize("precision", ["mxfp8", "fp8"])


def _accuracy_rank(
    rank: int, world: int, tokens: tuple[int, ...], dispatch: str, precision: str
) -> dict[str, float]:
    import os

    import torch.distributed as dist

    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch
    os.environ["MEGAMOE_EP_TRANSPORT"] = "symm"
    group = dist.group.WORLD
    x, idx, tw, dy = _inputs(tokens[rank % len(tokens)], seed=rank)
    w1, w2 = (_local(w, rank) for w in _weights(0))
    ours = _step(x, idx, tw, w1, w2, dy, group=group, precision=precision)
    ref = _step(x, idx, tw, w1, w2, dy, group=group, backend="reference", precision=precision)
    return {n: snr_db(ours[n].float(), ref[n].float()) for n in GRADS if ref[n].numel()}


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
@PRECISION
def test_over_symmetric_memory_matches_the_emulation(tmp_path, world, dispatch, precision) -> None:
    tokens = (3000, 0, 2500, 700)
    for rank, report in enumerate(
        run_ranks(_accuracy_rank, world, tmp_path, tokens, dispatch, precision, backend="nccl", timeout=600)
    ):
        print(f"rank {rank}:", {n: f"{s:.1f} dB" for n, s in report.items()})
        for name, snr in report.items():
            assert snr >= 40, f"rank {rank} {name}: SNR {snr:.1f} dB against the {precision} emulation"


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
@PRECISION
def test_layers_back_to_back_match_the_nccl_transport(tmp_path, world, dispatch, precision) -> None:
    for rank, report in enumerate(
        run_ranks(_layers_rank, world, tmp_path, 5, dispatch, precision, backend="nccl", timeout=600)
    ):
        for what, snr in report:
            assert snr >= 40, f"rank {rank} {what}: SNR {snr:.1f} dB against the NCCL transport"


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
@PRECISION
def test_cuda_graph_capture_and_replay_of_a_full_step(tmp_path, world, dispatch, precision) -> None:
    for rank, report in enumerate(
        run_ranks(_graph_rank, world, tmp_path, dispatch, precision, backend="nccl", timeout=600)
    ):
        assert all(report.values()), f"rank {rank}: replay differs from eager: {report}"
