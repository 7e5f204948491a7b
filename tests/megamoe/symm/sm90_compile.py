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

from megamoe.backends.symm.comm import (
    gather_broadcast_rows_kernel,
    pool_tokens_kernel,
    pool_weights_kernel,
    return_rows_kernel,
)
from megamoe.backends.symm.kernels import GemmOperands, SendTables, WorkspaceViews, fused_kernel
from megamoe.backends.symm.launch import FUSED_LAUNCHES, VARIANTS, LaunchFlags
from megamoe.backends.symm.layout import _layout_kernel
from megamoe.backends.symm.signals import barrier_kernel
from megamoe.backends.triton.configs import gemm_config
from megamoe.backends.triton.side_gather import BLOCK_H as GATHER_BLOCK_H
from megamoe.backends.triton.side_gather import BLOCK_R as GATHER_BLOCK_R
from megamoe.backends.triton.side_gather import GEMM_REGISTER_CAP
from megamoe.backends.triton.side_gather import NUM_WARPS as GATHER_WARPS
from tests.megamoe.triton.sm90_compile import CUDA, H, I, report

_SEND = SendTables(
    src="*bf16", send_token="*i32", send_slot="*i32", send_weight="*fp32", send_start="*i32",
    send_dest_row="*i32", seg_start="*i32", seg_len="*i32", seg_pos="*i32",
)  # fmt: skip
_GEMM = GemmOperands(
    a="*bf16", c="*bf16", row_scale="*fp32", scalar="*fp32", row_src="*i32", row_pos="*i32",
    tiles="*i32", num_tiles="*i32", num_local_tiles="*i32",
)  # fmt: skip
_VIEWS = WorkspaceViews(
    ptrs_dev="i64", state="*i32", pool_ready="*i32", pool="*bf16", pool_weight="*fp32", combine="*bf16",
    combine_scalar="*fp32", combine_ready="*i32", stage_x="*bf16", stage_token="*i32",
    stage_weight="*fp32", task_done="*i32", bcast_x="*bf16", bcast_token="*i32",
)  # fmt: skip
_UNSPECIALISED = ("rank", "world", "G", "pool_rows", "stage_rows", "stage_slots", "num_programs")
_UNSPECIALISED += ("num_comm", "tail_pct", "max_spins")
_SHAPES = {"gemm1": (2 * I, H), "gemm2": (H, I), "dgrad1": (H, 2 * I), "dgrad2": (I, H)}
"""(N, K) of each op at DeepSeek-V3's per-rank shape"""


def _absent(flags: LaunchFlags) -> dict[str, tuple[str, ...]]:
    """The fields of each argument table that ``launch.fused_gemm`` passes as None for ``flags``."""
    rows_by_source = flags.OUT_REMOTE or flags.LOCAL_A
    send = {
        "src": not (flags.COMM or flags.BCAST_A),
        "send_token": not (flags.COMM or flags.BCAST_A),
        **dict.fromkeys(("send_start", "send_dest_row", "seg_start", "seg_len", "seg_pos"), not flags.COMM),
        "send_slot": not flags.PUSH_WEIGHT,
        "send_weight": not flags.PUSH_WEIGHT,
    }
    gemm = {
        "c": flags.OUT_REMOTE,
        "row_scale": not flags.ROW_SCALE,
        "scalar": not flags.PUSH_SCALAR,
        "row_src": not rows_by_source,
        "row_pos": not rows_by_source,
        "num_local_tiles": not (flags.LOCAL_A or flags.SPREAD),
    }
    views = {"bcast_x": not flags.BCAST_A, "bcast_token": not flags.BCAST_A}
    return {
        table: tuple(name for name, none in fields.items() if none)
        for table, fields in (("send", send), ("gemm", gemm), ("views", views))
    }


def _launch(
    name: str, *, variant: str = "production", flat: bool = True, maxnreg: int | None = None
) -> tuple:
    """The fused launch ``name`` of ``launch.FUSED_LAUNCHES``: its arguments as ``launch.fused_gemm``
    passes them (``maxnreg``: its ``max_registers``)."""
    op, flags = FUSED_LAUNCHES[name]
    N, K = _SHAPES[op]
    cfg = gemm_config(op, CUDA)
    meta = flags.as_constexprs() | {"FLAT": flat, "IN_PTX": True, "VARIANT": VARIANTS[variant]}
    meta |= {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}
    meta |= {"COPY_ROWS": 32, "COPY_COLS": 512}
    box = [1, cfg.block_k, cfg.block_n] if flags.B_KN else [1, cfg.block_n, cfg.block_k]
    none = _absent(flags)
    args = {n: "i32" for n in _UNSPECIALISED} | meta | {"H": H, "N": N, "K": K, "stride_a": K, "stride_c": N}
    args["b_desc"] = f"tensordesc<bf16[{','.join(map(str, box))}]>"
    args["send"] = _SEND._replace(**dict.fromkeys(none["send"]))
    args["gemm"] = _GEMM._replace(**dict.fromkeys(none["gemm"]))
    args["views"] = _VIEWS._replace(**dict.fromkeys(none["views"]))
    args["trace_ptr"] = "*i64" if variant == "traced" else None
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return fused_kernel, args, options | ({"maxnreg": maxnreg} if maxnreg else {})


BESIDE_GATHER = ("stage2 bwd, broadcast", "stage1 bwd, broadcast")
"""the launches a pool gather runs beside (broadcast mode's backward), capped at GEMM_REGISTER_CAP"""
GATHER = "bwd: pool rows from the broadcast copies, beside the dgrad"

LAUNCHES = {
    name: _launch(name, maxnreg=GEMM_REGISTER_CAP if name in BESIDE_GATHER else None)
    for name in FUSED_LAUNCHES
}
LAUNCHES |= {
    "stage1 fwd, push: comm only (bench)": _launch("stage1 fwd, push", variant="comm_only"),
    "stage1 fwd, push: traced": _launch("stage1 fwd, push", variant="traced"),
    "stage1 fwd, push: counter only (flat_wait off)": _launch("stage1 fwd, push", flat=False),
}


PIPELINED = [
    name
    for name, (kernel, args, _) in LAUNCHES.items()
    if kernel is fused_kernel and args["VARIANT"] != VARIANTS["comm_only"]
]
"""launches whose gathered A loads must stay in flight across MMAs (``cp_async_in_flight >= 1``)"""


def _layout(world: int) -> tuple:
    """layout.build_layout at DeepSeek-V3's per-rank shape (32 local experts) in an EP group of ``world``."""
    args = dict(
        counts_ptr="*i32", epoch_ptr="*i32", rank="i32", W=world, E=32 * world, G=32, P="i32",
        max_tiles="i32", send_dest_row_ptr="*i32", expert_start_ptr="*i32", tiles_ptr="*i32",
        num_tiles_ptr="*i32", num_local_tiles_ptr="*i32", row_src_ptr="*i32", row_pos_ptr="*i32", received_ptr="*i32",
        seg_start_ptr="*i32", seg_len_ptr="*i32", seg_pos_ptr="*i32", BANKED=True, W_PAD=world, G_PAD=32,
        BLOCK_R=32, BLOCK_T=32, BLOCK_M=gemm_config("gemm1", CUDA).block_m,
    )  # fmt: skip
    return _layout_kernel, args, {"num_warps": 4}


LAUNCHES |= {f"stage1 fwd: layout, EP = {w}": _layout(w) for w in (2, 8)}
LAUNCHES["op barrier with the counts"] = (
    barrier_kernel,
    dict(
        ptrs_dev="i64", state_ptr="*i32", counts_ptr="*i32", signal_ptr="*i32", rank="i32", world="i32",
        E="i32", G="i32", arrive_ptr="*i32", counts_all_ptr="*i32", max_spins="i32", HAS_COUNTS=True,
        BLOCK_E=64,
    ),
    {"num_warps": 4},
)  # fmt: skip

LAUNCHES[GATHER] = (
    gather_broadcast_rows_kernel,
    dict(
        src_ptr="*bf16", send_token_ptr="*i32", bcast_x_ptr="*bf16", bcast_tok_ptr="*i32", row_src_ptr="*i32",
        row_pos_ptr="*i32", expert_start_ptr="*i32", pool_ptr="*bf16", state_ptr="*i32", pool_ready_ptr="*i32",
        rank="i32", world="i32", G="i32", H=H, stage_rows="i32", stage_slots="i32", num_programs="i32",
        max_spins="i32", BLOCK_R=GATHER_BLOCK_R, BLOCK_H=GATHER_BLOCK_H,
    ),
    {"num_warps": GATHER_WARPS},
)  # fmt: skip

LAUNCHES["unfused transport (MXFP8), broadcast: pool rows' rows in the copies"] = (
    pool_tokens_kernel,
    dict(
        row_src_ptr="*i32", row_pos_ptr="*i32", expert_start_ptr="*i32", send_token_ptr="*i32",
        bcast_tok_ptr="*i32", out_ptr="*i32", rank="i32", G="i32", P="i32", stage_rows="i32",
        stage_slots="i32", BLOCK=1024,
    ),
    {"num_warps": 4},
)  # fmt: skip

for _broadcast in (False, True):
    LAUNCHES[f"stage1 fwd: pool weights, {'broadcast' if _broadcast else 'push/pull'}"] = (
        pool_weights_kernel,
        dict(
            row_src_ptr="*i32", row_pos_ptr="*i32", expert_start_ptr="*i32",
            own_weight_ptr="*fp32" if _broadcast else None, copied_weight_ptr="*fp32", out_ptr="*bf16",
            rank="i32", G="i32", P="i32", stage_slots="i32", BROADCAST=_broadcast, BLOCK=1024,
        ),
        {"num_warps": 4},
    )  # fmt: skip

# the FP8 path's rows home after its GEMMs (launch.return_rows): fc2's rows * weight, fc1-dgrad's with d(weight)
for _name, _flags in (("fc2 rows * weight", (True, False)), ("fc1 dgrad rows + d(weight)", (False, True))):
    LAUNCHES[f"unfused transport (FP8): {_name} home"] = (
        return_rows_kernel,
        dict(
            rows_ptr="*bf16", valid_ptr="*i32", row_scale_ptr="*bf16" if _flags[0] else None,
            scalar_ptr="*fp32" if _flags[1] else None, row_src_ptr="*i32", row_pos_ptr="*i32",
            combine_ptr="*bf16", combine_scalar_ptr="*fp32", combine_ready_ptr="*i32", epoch_ptr="*i32",
            done_ptr="*i32", ptrs_dev="i64", rank="i32", world="i32", H=H, N=H, col0=0, stride_rows=H,
            num_programs="i32", ROW_SCALE=_flags[0], PUSH_SCALAR=_flags[1], SIGNAL=True,
            BLOCK_R=16, BLOCK_N=256,
        ),
        {"num_warps": 4},
    )  # fmt: skip


if __name__ == "__main__":
    json.dump(report(LAUNCHES), sys.stdout, indent=1)
