"""Compile the benchmark scripts' own kernels for sm_90a on the CPU and print a JSON report (the format of
``tests/megamoe/triton/sm90_compile.py``, whose :func:`compile_kernel` this uses): every gather variant of
``benchmarks/profile_side_gather.py`` and the paced writes of ``benchmarks/paced_writes.py``, at DeepSeek-V3's
per-rank shape. Run without ``TRITON_INTERPRET``: ``python -m tests.benchmarks.sm90_compile``."""

from __future__ import annotations

import json
import sys

from benchmarks import paced_writes, profile_side_gather
from megamoe.backends.triton.side_gather import BLOCK_H, BLOCK_R, NUM_WARPS
from tests.megamoe.triton.sm90_compile import NUM_SMS, TOPK, H, R, T, report


def _gather(mode: int, load_cm: str, store_cm: str) -> tuple:
    args = dict(
        src_ptr="*bf16", index_ptr="*i32", out_ptr="*bf16", R=R, H=H, num_programs=NUM_SMS,
        counters_ptr="*i32", interval_ns=40_000, trace_ptr="*i64", slot_row_ptr="*i32", T=T, MODE=mode,
        BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, LOAD_CM=load_cm, STORE_CM=store_cm, K=TOPK,
        SCATTER_T=profile_side_gather.SCATTER_T,
    )  # fmt: skip
    return profile_side_gather._traced_gather_kernel, args, {"num_warps": NUM_WARPS}


_PACED_ARGS = dict(
    dst_ptr="*i32", num_chunks=17_920, interval_ns=279, num_programs=paced_writes.PROGRAMS,
    CHUNK=paced_writes.CHUNK, PACED=True,
)  # fmt: skip
LAUNCHES = {
    **{
        f"side gather variant {name}": _gather(mode, load_cm, store_cm)
        for name, (mode, _, load_cm, store_cm) in profile_side_gather.VARIANTS.items()
        if mode != profile_side_gather.TMA  # the production kernel: tests/megamoe/triton compiles it
    },
    "paced writes": (paced_writes._paced_writes_kernel, _PACED_ARGS, {"num_warps": paced_writes.NUM_WARPS}),
}


if __name__ == "__main__":
    json.dump(report(LAUNCHES), sys.stdout, indent=1)
