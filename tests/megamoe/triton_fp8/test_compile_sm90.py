"""The blockwise-FP8 Triton kernels compile for Hopper (sm_90a) at the launches the CUDA path makes, on
the CPU, without spills.

The CPU tests run these kernels in the interpreter, which accepts what the GPU compiler can refuse and
says nothing about registers; this test compiles every distinct launch (``sm90_compile.py``) with the
ptxas Triton ships and checks spills and shared memory, in a fresh process (``TRITON_INTERPRET=1``,
set for the other CPU tests, replaces the kernels). Compiled, the quantisers round with the hardware
conversion (:mod:`megamoe.backends.triton_fp8.fp8_math`); that is checked in their PTX. The Gluon kernels
(:mod:`megamoe.backends.triton_fp8.wgmma_gemm`, :mod:`~megamoe.backends.triton_fp8.wgmma_wgrad`) must keep
their MMAs asynchronous: ptxas reports when it serialises them.
"""

from __future__ import annotations

import torch

from megamoe.backends.triton_fp8.configs import gemm_config, wgrad_config
from tests.megamoe.sm90 import SMEM_LIMIT, assert_compiles_for_sm90

_CUDA = torch.device("cuda")
_PERSISTENT = {  # launch: its tile, whose programs_per_sm programs must be resident on one SM together
    "gemm: row gather, bf16 out (fc1 fwd)": gemm_config(_CUDA, gather=True),
    "gemm: row gather, fp32 out (fc2 dgrad)": gemm_config(_CUDA, gather=True),
    "gemm: A by TMA, bf16 out (fc2 fwd, fc1 dgrad)": gemm_config(_CUDA, gather=False),
    "wgrad (K-grouped)": wgrad_config(_CUDA),
}


# The M-grouped Gluon GEMM with a bf16 output keeps two values that every partition reads in local
# memory (read once, as each partition starts) and one staging-buffer address of its second consumer
# (read once per tile): none in the step loop, whose MMAs and promotions run in registers.
_GLUON_GEMM_SPILLS = {
    "wgmma gemm, bf16 out (fc1 fwd)": 44,
    "wgmma gemm, bf16 out (fc2 fwd)": 44,
    "wgmma gemm, bf16 out (fc1 dgrad)": 44,
    "wgmma gemm, bf16 out (fc1 dgrad, half its columns)": 44,
}


def test_every_launch_compiles_for_sm90_without_spills() -> None:
    report = assert_compiles_for_sm90(
        "tests.megamoe.triton_fp8.sm90_compile", known_spills=_GLUON_GEMM_SPILLS
    )
    for name, config in _PERSISTENT.items():
        result, programs = report[name], config.programs_per_sm
        registers = programs * 32 * config.num_warps * -(-result["registers"] // 8) * 8
        assert registers <= 65536, f"{name}: {programs} programs need {registers} registers of 65536"
        assert programs * (result["shared"] + 1024) <= SMEM_LIMIT + 1024, f"{name}: {result}"
    wgmma = [name for name in report if name.startswith("wgmma")]
    assert len(wgmma) > 4
    for name in wgmma:  # the point of the Gluon kernels: MMAs overlap promotions
        assert not report[name]["wgmma_serialized"], f"{name}: ptxas serialised its wgmma ({report[name]})"
    quantisers = [name for name in report if "quantize" in name]
    assert quantisers
    for name in quantisers:
        assert report[name]["e4m3_conversions"] > 0, f"{name}: no cvt.rn.satfinite.e4m3x2.f32 in its PTX"
