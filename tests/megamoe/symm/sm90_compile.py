"""Compile every launch shape of the fused EP kernel (``megamoe.backends.symm``) for sm_90a on the CPU
(no GPU) and print a JSON report: whether it compiled, its shared memory, and ptxas's registers and
spills. Run in a process without ``TRITON_INTERPRET``, from the repository root:
``python -m tests.megamoe.symm.sm90_compile``.

Launches are described as in ``tests/megamoe/triton/sm90_compile.py`` (whose compiler this uses):
every argument by name, tensors by pointer type, ``None`` where the launcher passes none. Integers the
kernel does not specialise (``do_not_specialize``) are given as plain ``"i32"``; the others by their
value at DeepSeek-V3's per-rank shape.
"""

from __future__ import annotations

import json
import sys

from megamoe.backends.symm.kernels import (
    _barrier_kernel,
    _fused_kernel,
    _gather_broadcast_rows_kernel,
    _pool_tokens_kernel,
    _pool_weights_kernel,
)
from megamoe.backends.symm.layout import _layout_kernel
from megamoe.backends.triton.configs import gemm_config
from megamoe.backends.triton.side_gather import BLOCK_H as GATHER_BLOCK_H
from megamoe.backends.triton.side_gather import BLOCK_R as GATHER_BLOCK_R
from megamoe.backends.triton.side_gather import GEMM_REGISTER_CAP
from megamoe.backends.triton.side_gather import NUM_WARPS as GATHER_WARPS
from tests.megamoe.triton.sm90_compile import CUDA, H, I, report

_POINTERS = dict(
    src_ptr="*bf16", send_token_ptr="*i32", send_slot_ptr="*i32", send_weight_ptr="*fp32",
    send_start_ptr="*i32", send_dest_row_ptr="*i32", seg_start_ptr="*i32", seg_len_ptr="*i32",
    seg_pos_ptr="*i32", a_ptr="*bf16", c_ptr="*bf16", row_scale_ptr="*fp32", scalar_ptr="*fp32",
    row_src_ptr="*i32", row_pos_ptr="*i32", tiles_ptr="*i32", num_tiles_ptr="*i32",
    num_local_tiles_ptr="*i32", ptrs_dev="i64",
    state_ptr="*i32", pool_ready_ptr="*i32", pool_ptr="*bf16", pool_w_ptr="*fp32", comb_ptr="*bf16",
    comb_scalar_ptr="*fp32", comb_ready_ptr="*i32", stage_x_ptr="*bf16", stage_tok_ptr="*i32",
    stage_w_ptr="*fp32", task_done_ptr="*i32", trace_ptr=None, bcast_x_ptr=None, bcast_tok_ptr=None,
)  # fmt: skip
_UNSPECIALISED = ("rank", "world", "G", "pool_rows", "stage_rows", "stage_slots", "num_programs")
_UNSPECIALISED += ("num_comm", "tail_pct", "max_spins")
# launch.fused_gemm's constexprs for push mode with nothing optional; each launch below overrides some
_DEFAULTS = dict(
    COMM=True, PULL=False, PUSH_WEIGHT=False, WAIT=True, OUT_REMOTE=False, ROW_SCALE=False,
    PUSH_SCALAR=False, SIGNAL=False, SKIP_MMA=False, LOCAL_A=False, B_KN=False,
    COPY_ROWS=32, COPY_COLS=512, FLAT=True, IN_PTX=True, TRACE=False, BCAST_A=False, SPREAD=False,
)  # fmt: skip


def _launch(
    op: str, *, N: int, K: int, none: tuple[str, ...] = (), maxnreg: int | None = None, **constexprs
) -> tuple:
    """One ``launch.fused_gemm`` call: its arguments, with ``none`` absent (``maxnreg``: its ``max_registers``)."""
    cfg = gemm_config(op, CUDA)
    meta = _DEFAULTS | constexprs | {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    box = [1, cfg["BLOCK_K"], cfg["BLOCK_N"]] if meta["B_KN"] else [1, cfg["BLOCK_N"], cfg["BLOCK_K"]]
    args = dict(_POINTERS) | {name: "i32" for name in _UNSPECIALISED} | meta
    args |= {"b_desc": f"tensordesc<bf16[{','.join(map(str, box))}]>", "H": H, "N": N, "K": K}
    args |= {"stride_a": K, "stride_c": N, **{name: None for name in none}}
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    return _fused_kernel, args, options | ({"maxnreg": maxnreg} if maxnreg else {})


BESIDE_GATHER = (
    "stage2 bwd: broadcast dy (copy engines) | dgrad2 gathers peers' copies",
    "stage1 bwd: dgrad1 + dx to sources (broadcast x: no comm role)",
)
"""the launches a pool gather runs beside (broadcast mode's backward), capped at GEMM_REGISTER_CAP"""
GATHER = "bwd: pool rows from the broadcast copies, beside the dgrad"

LAUNCHES = {
    "stage1 fwd: push x + GEMM1": _launch(
        "gemm1", N=2 * I, K=H, PUSH_WEIGHT=True, LOCAL_A=True, none=("row_scale_ptr", "scalar_ptr")
    ),
    "stage1 fwd: pull x + GEMM1": _launch(
        "gemm1", N=2 * I, K=H, PULL=True, PUSH_WEIGHT=True, none=("row_scale_ptr", "scalar_ptr")
    ),
    "stage1 fwd: comm only (bench)": _launch("gemm1", N=2 * I, K=H, PUSH_WEIGHT=True, LOCAL_A=True, SKIP_MMA=True),
    "stage1 fwd: push x + GEMM1, traced (MEGAMOE_SYMM_TRACE=1)": _launch(
        "gemm1", N=2 * I, K=H, PUSH_WEIGHT=True, LOCAL_A=True, TRACE=True, trace_ptr="*i64",
        none=("row_scale_ptr", "scalar_ptr"),
    ),
    "stage1 fwd: broadcast x (copy engines) | GEMM1 gathers peers' copies": _launch(
        "gemm1", N=2 * I, K=H, COMM=False, LOCAL_A=True, BCAST_A=True, bcast_x_ptr="*bf16",
        bcast_tok_ptr="*i32", none=("row_scale_ptr", "scalar_ptr"),
    ),
    "stage1 fwd: push x + GEMM1, counter only": _launch(
        "gemm1", N=2 * I, K=H, PUSH_WEIGHT=True, LOCAL_A=True, FLAT=False, none=("row_scale_ptr", "scalar_ptr")
    ),
    "stage2 fwd: GEMM2 to sources (no comm)": _launch(
        "gemm2", N=H, K=I, COMM=False, WAIT=False, OUT_REMOTE=True, SPREAD=True, ROW_SCALE=True, SIGNAL=True,
        none=("c_ptr", "scalar_ptr"),
    ),
    "stage2 bwd: push dy + dgrad2": _launch(
        "dgrad2", N=I, K=H, B_KN=True, none=("row_scale_ptr", "scalar_ptr", "row_src_ptr", "row_pos_ptr")
    ),
    BESIDE_GATHER[0]: _launch(
        "dgrad2", N=I, K=H, B_KN=True, COMM=False, LOCAL_A=True, BCAST_A=True, bcast_x_ptr="*bf16",
        bcast_tok_ptr="*i32", none=("row_scale_ptr", "scalar_ptr"), maxnreg=GEMM_REGISTER_CAP,
    ),
    BESIDE_GATHER[1]: _launch(
        "dgrad1", N=H, K=2 * I, COMM=False, WAIT=False, B_KN=True, OUT_REMOTE=True, PUSH_SCALAR=True,
        SIGNAL=True, none=("row_scale_ptr", "c_ptr"), maxnreg=GEMM_REGISTER_CAP,
    ),
    "unfused transport (MXFP8): push rows, no tiles": _launch(
        "gemm1", N=2 * I, K=H, WAIT=False, PUSH_WEIGHT=True, none=("row_scale_ptr", "scalar_ptr")
    ),
    "unfused transport (MXFP8): pull rows, no tiles": _launch(
        "gemm1", N=2 * I, K=H, WAIT=False, PULL=True, none=("row_scale_ptr", "scalar_ptr")
    ),
    "stage1 bwd: push x | dgrad1 + dx to sources": _launch(
        "dgrad1", N=H, K=2 * I, WAIT=False, B_KN=True, OUT_REMOTE=True, PUSH_SCALAR=True, SIGNAL=True,
        none=("row_scale_ptr", "c_ptr"),
    ),
}  # fmt: skip


PIPELINED = [
    name for name, (kernel, args, _) in LAUNCHES.items() if kernel is _fused_kernel and not args["SKIP_MMA"]
]
"""launches whose gathered A loads must stay in flight across MMAs (``cp_async_in_flight >= 1``)"""


def _layout(world: int) -> tuple:
    """layout.build_layout at DeepSeek-V3's per-rank shape (32 local experts) in an EP group of ``world``."""
    args = dict(
        counts_ptr="*i32", epoch_ptr="*i32", rank="i32", W=world, E=32 * world, G=32, P="i32",
        max_tiles="i32", send_dest_row_ptr="*i32", expert_start_ptr="*i32", tiles_ptr="*i32",
        num_tiles_ptr="*i32", num_local_tiles_ptr="*i32", row_src_ptr="*i32", row_pos_ptr="*i32", received_ptr="*i32",
        seg_start_ptr="*i32", seg_len_ptr="*i32", seg_pos_ptr="*i32", BANKED=True, W_PAD=world, G_PAD=32,
        BLOCK_R=32, BLOCK_T=32, BLOCK_M=gemm_config("gemm1", CUDA)["BLOCK_M"],
    )  # fmt: skip
    return _layout_kernel, args, {"num_warps": 4}


LAUNCHES |= {f"stage1 fwd: layout, EP = {w}": _layout(w) for w in (2, 8)}
LAUNCHES["op barrier with the counts"] = (
    _barrier_kernel,
    dict(
        ptrs_dev="i64", state_ptr="*i32", counts_ptr="*i32", signal_ptr="*i32", rank="i32", world="i32",
        E="i32", G="i32", arrive_ptr="*i32", counts_all_ptr="*i32", max_spins="i32", HAS_COUNTS=True,
        BLOCK_E=64,
    ),
    {"num_warps": 4},
)  # fmt: skip

LAUNCHES[GATHER] = (
    _gather_broadcast_rows_kernel,
    dict(
        src_ptr="*bf16", send_token_ptr="*i32", bcast_x_ptr="*bf16", bcast_tok_ptr="*i32", row_src_ptr="*i32",
        row_pos_ptr="*i32", expert_start_ptr="*i32", pool_ptr="*bf16", state_ptr="*i32", pool_ready_ptr="*i32",
        rank="i32", world="i32", G="i32", H=H, stage_rows="i32", stage_slots="i32", num_programs="i32",
        max_spins="i32", BLOCK_R=GATHER_BLOCK_R, BLOCK_H=GATHER_BLOCK_H,
    ),
    {"num_warps": GATHER_WARPS},
)  # fmt: skip

LAUNCHES["unfused transport (MXFP8), broadcast: pool rows' rows in the copies"] = (
    _pool_tokens_kernel,
    dict(
        row_src_ptr="*i32", row_pos_ptr="*i32", expert_start_ptr="*i32", send_token_ptr="*i32",
        bcast_tok_ptr="*i32", out_ptr="*i32", rank="i32", G="i32", P="i32", stage_rows="i32",
        stage_slots="i32", BLOCK=1024,
    ),
    {"num_warps": 4},
)  # fmt: skip

for _broadcast in (False, True):
    LAUNCHES[f"stage1 fwd: pool weights, {'broadcast' if _broadcast else 'push/pull'}"] = (
        _pool_weights_kernel,
        dict(
            row_src_ptr="*i32", row_pos_ptr="*i32", expert_start_ptr="*i32",
            own_weight_ptr="*fp32" if _broadcast else None, copied_weight_ptr="*fp32", out_ptr="*bf16",
            rank="i32", G="i32", P="i32", stage_slots="i32", BROADCAST=_broadcast, BLOCK=1024,
        ),
        {"num_warps": 4},
    )  # fmt: skip


if __name__ == "__main__":
    json.dump(report(LAUNCHES), sys.stdout, indent=1)
