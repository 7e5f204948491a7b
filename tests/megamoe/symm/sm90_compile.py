"""Compile every launch shape of the fused EP kernel for sm_90a on the CPU (no GPU) and print a JSON
report: whether it compiled, its shared memory, and ptxas's registers and spills.

Run as a script in a process without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit``
kernels, which then cannot be compiled): ``python tests/megamoe/symm/sm90_compile.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megamoe.backends.symm.kernels import _fused_kernel

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

_TYPES = {
    "src_ptr": "*bf16", "send_token_ptr": "*i32", "send_slot_ptr": "*i32", "send_weight_ptr": "*fp32",
    "send_start_ptr": "*i32", "send_dest_row_ptr": "*i32", "seg_start_ptr": "*i32", "seg_len_ptr": "*i32",
    "seg_pos_ptr": "*i32", "a_ptr": "*bf16", "c_ptr": "*bf16", "row_scale_ptr": "*fp32",
    "scalar_ptr": "*fp32", "row_src_ptr": "*i32", "row_pos_ptr": "*i32", "tiles_ptr": "*i32",
    "num_tiles_ptr": "*i32", "ptrs_dev": "i64", "state_ptr": "*i32", "pool_ready_ptr": "*i32",
    "rank": "i32", "world": "i32", "G": "i32", "pool_rows": "i32", "pool_ptr": "*bf16",
    "pool_w_ptr": "*fp32", "comb_ptr": "*bf16", "comb_scalar_ptr": "*fp32", "comb_ready_ptr": "*i32",
    "stage_x_ptr": "*bf16", "stage_tok_ptr": "*i32", "stage_w_ptr": "*fp32", "task_done_ptr": "*i32",
    "H": "i32", "stage_rows": "i32", "stage_slots": "i32", "N": "i32", "K": "i32", "stride_a": "i32",
    "stride_c": "i32", "num_programs": "i32", "num_comm": "i32", "tail_pct": "i32", "max_spins": "i32",
}  # fmt: skip
_ALIGNED = ("src_ptr", "a_ptr", "c_ptr", "pool_ptr", "comb_ptr", "H", "N", "K", "stride_a", "stride_c")
_BASE = dict(
    COMM=True, PULL=False, PUSH_WEIGHT=False, WAIT=True, OUT_REMOTE=False, ROW_SCALE=False,
    PUSH_SCALAR=False, SIGNAL=False, SKIP_MMA=False, LOCAL_A=False, B_KN=False, BLOCK_M=128,
    BLOCK_N=256, BLOCK_K=64, GROUP_M=8, COPY_ROWS=32, COPY_COLS=512, FLAT=True, IN_PTX=True,
)  # fmt: skip
# the launches of megamoe.backends.symm.backend and the benchmark's legs (arguments that are None
# there are compile-time None here too)
LAUNCHES = {
    "stage1 fwd: push x + GEMM1": dict(PUSH_WEIGHT=True, LOCAL_A=True, none=("row_scale_ptr", "scalar_ptr")),
    "stage1 fwd: pull x + GEMM1": dict(PULL=True, PUSH_WEIGHT=True, none=("row_scale_ptr", "scalar_ptr")),
    "stage1 fwd: comm only (bench)": dict(PUSH_WEIGHT=True, LOCAL_A=True, SKIP_MMA=True),
    "stage2 bwd: push dy + dgrad2": dict(B_KN=True, none=("row_scale_ptr", "scalar_ptr", "row_src_ptr", "row_pos_ptr")),
    "stage1 bwd: push x | dgrad1 + dx to sources": dict(
        WAIT=False, B_KN=True, OUT_REMOTE=True, PUSH_SCALAR=True, SIGNAL=True, none=("row_scale_ptr", "c_ptr")
    ),
    "stage2 fwd: GEMM2 to sources (no comm)": dict(
        COMM=False, WAIT=False, OUT_REMOTE=True, ROW_SCALE=True, SIGNAL=True, none=("c_ptr", "scalar_ptr")
    ),
    "stage1 fwd: push x + GEMM1, counter only": dict(PUSH_WEIGHT=True, LOCAL_A=True, FLAT=False),
}  # fmt: skip


def compile_launch(options: dict) -> dict:
    options = dict(options)
    none = set(options.pop("none", ()))
    meta = {**_BASE, **options}
    kn = meta["B_KN"]
    box = f"[1,{meta['BLOCK_K']},{meta['BLOCK_N']}]" if kn else f"[1,{meta['BLOCK_N']},{meta['BLOCK_K']}]"
    constexprs = dict(meta) | {name: None for name in none}
    signature = {
        name: "constexpr"
        if name in constexprs
        else (f"tensordesc<bf16{box}>" if name == "b_desc" else _TYPES[name])
        for name in _fused_kernel.arg_names
    }
    args = _fused_kernel.arg_names
    attrs = {(args.index(n),): [["tt.divisibility", 16]] for n in _ALIGNED if signature[n] != "constexpr"}
    try:
        kernel = triton.compile(
            ASTSource(_fused_kernel, signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 8, "num_stages": 3},
        )
    except Exception as error:  # report it: the test names the launch that failed
        return {"compiled": False, "error": f"{type(error).__name__}: {error}"[:500]}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    ptxas = subprocess.run(
        [_PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True
    )
    os.unlink(f.name)
    info = ptxas.stdout + ptxas.stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", info))
    registers = int(m.group(1)) if (m := re.search(r"Used (\d+) registers", info)) else -1
    return {"compiled": True, "shared": kernel.metadata.shared, "registers": registers, "spill_bytes": spills}


if __name__ == "__main__":
    json.dump({name: compile_launch(options) for name, options in LAUNCHES.items()}, sys.stdout, indent=1)
