"""Blockwise FP8 at EP > 1 over symmetric memory on 2, 4 or 8 GPUs of one node (device machines
``nvidia-h200-x2`` and up): ``pytest -m multigpu tests/megamoe/triton_fp8/test_gpu_ep_symm.py``.

The checks of the MXFP8 path's twin (tests/megamoe/triton_mx/test_gpu_ep_symm.py, whose rank functions
these run with ``precision="fp8"``), at each EP size the node has GPUs for, in push and in broadcast
mode: against the FP8 emulation (ragged tokens, a rank with none; SNR >= 40 dB, the kernels' bar on
one GPU); five layers back to back against the NCCL transport, which moves the rows as E4M3 bytes
(the same bits); and CUDA-graph capture of a full forward + backward, replayed on new inputs: eager's
bits.
"""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.megamoe.symm.test_gpu_symm import WORLDS, _graph_rank, _layers_rank
from tests.megamoe.triton_mx.test_gpu_ep_symm import accuracy_rank

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
DISPATCH = pytest.mark.parametrize("dispatch", ["push", "broadcast"])


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
def test_fp8_over_symmetric_memory_matches_the_emulation(tmp_path, world, dispatch) -> None:
    tokens = (3000, 0, 2500, 700)
    for rank, report in enumerate(
        run_ranks(accuracy_rank, world, tmp_path, tokens, dispatch, "fp8", backend="nccl", timeout=600)
    ):
        for name, snr in report.items():
            assert snr >= 40, f"rank {rank} {name}: SNR {snr:.1f} dB against the FP8 emulation"


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
def test_layers_back_to_back_match_the_nccl_transport(tmp_path, world, dispatch) -> None:
    for rank, report in enumerate(
        run_ranks(_layers_rank, world, tmp_path, 5, dispatch, "fp8", backend="nccl", timeout=600)
    ):
        for what, snr in report:
            assert snr >= 40, f"rank {rank} {what}: SNR {snr:.1f} dB against the NCCL transport"


@pytest.mark.parametrize("world", WORLDS)
@DISPATCH
def test_cuda_graph_capture_and_replay_of_a_full_step(tmp_path, world, dispatch) -> None:
    for rank, report in enumerate(
        run_ranks(_graph_rank, world, tmp_path, dispatch, "fp8", backend="nccl", timeout=600)
    ):
        assert all(report.values()), f"rank {rank}: replay differs from eager: {report}"
