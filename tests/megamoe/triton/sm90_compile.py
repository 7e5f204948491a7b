"""Compile the one-GPU bf16 Triton kernels (``megamoe.backends.triton``) for sm_90a on the CPU (no GPU)
at the launches the CUDA path makes, and print a JSON report: whether each compiled, its shared memory,
and ptxas's registers and spills.

Run in a process without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` kernels, which
then cannot be compiled), from the repository root: ``python -m tests.megamoe.triton.sm90_compile``.
:func:`compile_kernel` is shared with ``tests/megamoe/triton_mx/sm90_compile.py``.

A launch is described as the launcher calls the kernel: every argument by name, with tensors as their
pointer type (``"*bf16"``, taken 16-byte aligned), TMA descriptors as their ``tensordesc<...>`` type,
``None`` for an absent tensor, and integers by their value at DeepSeek-V3's per-rank bench shape
(``benchmarks.common.MODELS``), specialised as Triton 3.6 does at launch (1 is a constexpr, a multiple of
16 gets the divisibility hint). Tile shapes come from ``configs.gemm_config``/``wgrad_config`` for a
CUDA device; the other constexprs are the launchers' formulas, restated here (the launcher is named).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from benchmarks.common import MODELS
from megamoe.backends.triton import tma_rows
from megamoe.backends.triton.combine import _combine_kernel
from megamoe.backends.triton.configs import TileConfig, gemm_config, wgrad_config
from megamoe.backends.triton.grouped_gemm import _grouped_gemm_kernel
from megamoe.backends.triton.padding import _zero_padding_rows_kernel
from megamoe.backends.triton.routing import (
    OFFSET_COLUMNS,
    ONE_PROGRAM_CELLS,
    _histogram_kernel,
    _offsets_kernel,
    _one_program_kernel,
    _scatter_kernel,
    _totals_kernel,
)
from megamoe.backends.triton.segments import _block_starts_kernel
from megamoe.backends.triton.side_gather import BLOCK_H as GATHER_BLOCK_H
from megamoe.backends.triton.side_gather import BLOCK_R as GATHER_BLOCK_R
from megamoe.backends.triton.side_gather import NUM_WARPS as GATHER_WARPS
from megamoe.backends.triton.side_gather import _gather_rows_kernel
from megamoe.backends.triton.swiglu import _swiglu_backward_kernel, _swiglu_forward_kernel
from megamoe.backends.triton.tma_rows import _tma_gather_rows_kernel
from megamoe.backends.triton.wgrad import _wgrad_kernel

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
CUDA = torch.device("cuda")  # only its type is read: the config functions pick the GPU tiles
NUM_SMS = 132  # an H200's multiprocessors: the persistent kernels' num_programs
LAUNCH_KEYS = ("num_warps", "num_stages")  # TileConfig.launch_kwargs() keys that are launch options


def _argument(value):
    """(signature type, divisible by 16) of a runtime argument, or None for a constexpr value."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):  # Triton 3.6's launch specialisation of integers
        if value == 1:
            return None
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, str):
        return value, value.startswith("*")  # tensors taken 16-byte aligned; descriptors carry no hint
    raise TypeError(f"unsupported argument {value!r}")


def _signature(value, path: tuple[int, ...], constexprs: dict, attrs: dict):
    """The signature entry of the argument at ``path`` (a tuple argument's element by element, a
    named tuple's as its own type), recording its constant or its divisibility."""
    if isinstance(value, tuple):
        if any(isinstance(v, str) and v.startswith("tensordesc") for v in value):
            # compiles, but Triton 3.6's CUDA launcher expands descriptors at the top level only
            raise TypeError(f"a tensor descriptor inside the tuple argument at {path} cannot be launched")
        types = [_signature(v, (*path, j), constexprs, attrs) for j, v in enumerate(value)]
        return type(value)(*types) if hasattr(value, "_fields") else tuple(types)
    arg = _argument(value)
    if arg is None:
        constexprs[path] = value
        return "constexpr"
    if arg[1]:
        attrs[path] = [["tt.divisibility", 16]]
    return arg[0]


def config_constexprs(kernel, config: TileConfig) -> dict:
    """The tile's kernel constexprs: ``config.launch_kwargs()`` less the launch options, each of which
    must be a parameter of ``kernel``."""
    constexprs = {k: v for k, v in config.launch_kwargs().items() if k not in LAUNCH_KEYS}
    stray = sorted(set(constexprs) - set(kernel.arg_names))
    if stray:
        raise KeyError(f"launch keywords {stray} are neither {kernel.__name__} parameters nor launch options")
    return constexprs


def compile_kernel(kernel, args: dict, *, num_warps: int = 4, num_stages: int = 3, **options) -> dict:
    """Compile ``kernel`` for sm_90a with ``args`` (every parameter by name, see the module docstring) and
    the launch options (defaults: Triton's); run the bundled ptxas on its PTX."""
    names = kernel.arg_names
    if set(args) != set(names):
        missing, extra = sorted(set(names) - set(args)), sorted(set(args) - set(names))
        return {"compiled": False, "error": f"arguments do not match: missing {missing}, unknown {extra}"}
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params, strict=True)):
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = args[name]
        else:
            signature[name] = _signature(args[name], (i,), constexprs, attrs)
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    try:
        compiled = triton.compile(
            source(kernel, signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps, "num_stages": num_stages, **options},
        )
    except Exception as error:  # report it: the test names the launch that failed
        return {"compiled": False, "error": f"{type(error).__name__}: {error}"[:800]}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    ptxas = subprocess.run(
        [_PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True
    )
    os.unlink(f.name)
    info = ptxas.stdout + ptxas.stderr
    if ptxas.returncode:
        return {"compiled": False, "error": f"ptxas: {info}"[:800]}
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", info))
    registers = int(m.group(1)) if (m := re.search(r"Used (\d+) registers", info)) else -1
    # cp.async groups a pointer-load pipeline leaves in flight at its deepest wait: 0 means every
    # gathered load is waited for before its MMA (no overlap); -1: no cp.async pipeline at all
    waits = [int(n) for n in re.findall(r"ttg\.async_wait.*\{num = (\d+)", compiled.asm["ttgir"])]
    return {
        "compiled": True,
        "shared": compiled.metadata.shared,
        "registers": registers,
        "spill_bytes": spills,
        "cp_async_in_flight": max(waits, default=-1),
        "e4m3_conversions": compiled.asm["ptx"].count("cvt.rn.satfinite.e4m3x2.f32"),
        # ptxas's C7514: it made every wgmma wait for the previous one (an in-flight accumulator read)
        "wgmma_serialized": "C7514" in info,
    }


_PENDING: list[tuple] = []  # the launches of report(), inherited by its forked workers


def _run(index: int) -> dict:
    kernel, args, options = _PENDING[index]
    return compile_kernel(kernel, args, **options)


def report(launches: dict) -> dict:
    """Compile every launch (``name: (kernel, args, launch options)``), spread over the machine's cores."""
    _PENDING[:] = launches.values()
    workers = min(len(launches), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(zip(launches, pool.map(_run, range(len(launches))), strict=True))


# ---- launches of megamoe.backends.triton (ops.py, the symm and MXFP8 backends share the small kernels)

_SHAPE = MODELS["DeepSeek-V3"]
T, TOPK, G, H, I = _SHAPE.tokens, _SHAPE.topk, _SHAPE.experts, _SHAPE.hidden, _SHAPE.inter
R = T * TOPK


def _gemm(op: str, *, a_mode: int, b_kn: bool, swiglu: bool, N: int, K: int) -> tuple:
    """grouped_gemm.grouped_gemm: ``a`` [rows, K] by TMA (a_mode 0) or gathered through ``a_rows``."""
    cfg = gemm_config(op, CUDA)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if swiglu:
        b_box = f"[1,2,{bn // 2},{bk}]"
    else:
        b_box = f"[1,{bk},{bn}]" if b_kn else f"[1,{bn},{bk}]"
    args = dict(
        a_ptr="*bf16", a_desc=f"tensordesc<bf16[{bm},{bk}]>" if a_mode == 0 else None,
        a_rows_ptr="*i32" if a_mode == 1 else None, b_desc=f"tensordesc<bf16{b_box}>", c_ptr="*bf16",
        act_ptr="*bf16" if swiglu else None, tiles_ptr="*i32", num_tiles_ptr="*i32", valid_rows_ptr="*i32",
        slot_values_ptr="*fp32" if swiglu else None, row_slot_ptr="*i32" if swiglu else None,
        row_values_ptr="*fp32" if swiglu else None, R=R, N=N, K=K, stride_a=K,
        stride_c=N, stride_act=N // 2 if swiglu else 0, num_programs=NUM_SMS, A_MODE=a_mode, B_KN=b_kn,
        SWIGLU=swiglu, **config_constexprs(_grouped_gemm_kernel, cfg),
    )  # fmt: skip
    return _grouped_gemm_kernel, args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _wgrad(M: int, N: int) -> tuple:
    """wgrad.grouped_wgrad: ``dW [G, M, N]`` from contiguous expert-sorted ``P [R, M]``, ``Q [R, N]``."""
    cfg = wgrad_config(CUDA)
    per_expert = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    grid = min(NUM_SMS, G * per_expert)
    args = dict(
        p_ptr="*bf16", q_ptr="*bf16", out_ptr="*bf16", expert_start_ptr="*i32", G=G, M=M, N=N,
        stride_out_g=M * N, stride_out_m=N, num_programs=grid, REUSE_DESCRIPTORS=per_expert > grid,
        **config_constexprs(_wgrad_kernel, cfg),
    )  # fmt: skip
    return _wgrad_kernel, args, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _swiglu_blocks(inter: int) -> tuple[int, int]:
    """swiglu._blocks on CUDA: (BLOCK_R, BLOCK_I)."""
    block_i = min(triton.next_power_of_2(inter), 256)
    return max(1, 4096 // block_i), block_i


def _routing(experts: int) -> dict:
    """routing.build_routing_plan on CUDA (BINS, BLOCK_S and CHUNK depend on the local expert count): the
    four launches at the bench shape, and the one-program plan at the most slots it takes."""
    bins = triton.next_power_of_2(experts + 2)
    block_s = max(16, min(1024, 16384 // bins))
    chunk = max(16, min(256, 8192 // bins))
    S = T * TOPK
    blocks = triton.cdiv(S, block_s)
    warps = {"num_warps": 8}
    hist = dict(idx_ptr="*i64", counts_ptr="*i32", S=S, G=experts, BLOCK_S=block_s, BINS=bins)
    cols = min(bins, OFFSET_COLUMNS)
    totals = dict(counts_ptr="*i32", totals_ptr="*i32", num_blocks=blocks, BINS=bins, COLS=cols, CHUNK=chunk)
    tables = dict(expert_start_ptr="*i32", tiles_ptr="*i32", num_tiles_ptr="*i32", ids_ok_ptr="*i32")
    offsets = dict(
        counts_ptr="*i32", totals_ptr="*i32", base_ptr="*i32", **tables, num_blocks=blocks, G=experts,
        max_tiles=triton.cdiv(S, 128) + experts, BLOCK_M=128, BINS=bins, COLS=cols, CHUNK=chunk,
    )  # fmt: skip
    scatter = dict(
        idx_ptr="*i64", base_ptr="*i32", row_slot_ptr="*i32", row_token_ptr="*i32", slot_row_ptr="*i32",
        S=S, G=experts, K=TOPK, BLOCK_S=block_s, BINS=bins,
    )  # fmt: skip
    few = ONE_PROGRAM_CELLS // bins
    one_program = dict(
        idx_ptr="*i64", row_slot_ptr="*i32", row_token_ptr="*i32", slot_row_ptr="*i32", **tables, S=few,
        G=experts, K=TOPK, max_tiles=triton.cdiv(few, 128) + experts, BLOCK_M=128, BLOCK_S=block_s,
        BINS=bins, CHUNK=chunk,
    )  # fmt: skip
    return {
        f"routing histogram, BINS={bins}": (_histogram_kernel, hist, warps),
        f"routing totals, BINS={bins}": (_totals_kernel, totals, warps),
        f"routing offsets, BINS={bins}": (_offsets_kernel, offsets, warps),
        f"routing scatter, BINS={bins}": (_scatter_kernel, scatter, warps),
        f"routing in one program, BINS={bins}": (_one_program_kernel, one_program, warps),
    }


def _small_kernels() -> dict:
    """side_gather.gather_rows, swiglu.swiglu_forward/backward, combine.combine (weighted: GEMM2; not:
    the dgrad's dx) and padding.zero_padding_rows (also picking the quantised GEMM1's routing weights), as
    they launch on CUDA."""
    block_r, block_i = _swiglu_blocks(I)
    block_h = min(triton.next_power_of_2(H), 2048)
    forward = dict(h_ptr="*bf16", a_ptr="*bf16", valid_ptr="*i32", I=I, BLOCK_R=block_r, BLOCK_I=block_i)
    backward = dict(
        h_ptr="*bf16", da_ptr="*bf16", weight_ptr="*fp32", dh_ptr="*bf16", aw_ptr="*bf16",
        d_weight_ptr="*fp32", valid_ptr="*i32", R=R, I=I, BLOCK_R=min(block_r, 16), BLOCK_I=block_i,
    )  # fmt: skip
    padding = dict(
        a_ptr="*bf16", b_ptr="*bf16", valid_rows_ptr="*i32", slot_values_ptr=None, row_slot_ptr=None,
        row_values_ptr=None, R=R, NA=2 * I, NB=I, BLOCK_R=32, BLOCK_N=min(triton.next_power_of_2(2 * I), 256),
    )  # fmt: skip
    picking = dict(padding, slot_values_ptr="*fp32", row_slot_ptr="*i32", row_values_ptr="*fp32")
    gather = dict(
        src_ptr="*bf16", index_ptr="*i32", out_ptr="*bf16", next_block_ptr="*i32", R=R, H=H, stride_src=H,
        BLOCK_R=GATHER_BLOCK_R, BLOCK_H=GATHER_BLOCK_H,
    )  # fmt: skip
    nvmma = "NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)"
    tma_gather = dict(
        src_desc=f"tensordesc<bf16[1,{tma_rows.BOX}],{nvmma}>",
        out_desc=f"tensordesc<bf16[{tma_rows.ROWS},{tma_rows.BOX}],{nvmma}>", index_ptr="*i32", R=R, H=H,
        next_block_ptr="*i32", ROWS=tma_rows.ROWS, BOX=tma_rows.BOX, STAGES=tma_rows.STAGES, AHEAD=tma_rows.AHEAD,
    )  # fmt: skip
    launches = {
        "row gather beside a GEMM": (_gather_rows_kernel, gather, {"num_warps": GATHER_WARPS}),
        "TMA row gather beside a GEMM": (
            _tma_gather_rows_kernel,
            tma_gather,
            {"num_warps": tma_rows.NUM_WARPS},
        ),
        "swiglu forward": (_swiglu_forward_kernel, forward, {}),
        "swiglu backward": (_swiglu_backward_kernel, backward, {}),
        "zero padding rows": (_zero_padding_rows_kernel, padding, {}),
        "zero padding rows, picking each row's routing weight": (_zero_padding_rows_kernel, picking, {}),
    }
    for name, weighted, to_slots in (
        ("combine, weighted", True, False),
        ("combine, unweighted", False, False),
        ("combine, unweighted, d(weights) to the slots", False, True),
    ):
        combine = dict(
            rows_ptr="*bf16", slot_row_ptr="*i32", weight_ptr="*fp32" if weighted else None, out_ptr="*bf16",
            row_values_ptr="*fp32" if to_slots else None, slot_values_ptr="*fp32" if to_slots else None,
            H=H, stride_rows=H, stride_out=H, K=TOPK, WEIGHTED=weighted, BLOCK_H=block_h,
        )  # fmt: skip
        launches[name] = (_combine_kernel, combine, {"num_warps": 4 if block_h <= 1024 else 8})
    return launches


LAUNCHES = {
    "gemm1: row gather + SwiGLU epilogue": _gemm("gemm1", a_mode=1, b_kn=False, swiglu=True, N=2 * I, K=H),
    "gemm1: plain row gather": _gemm("gemm1", a_mode=1, b_kn=False, swiglu=False, N=2 * I, K=H),
    "gemm2: A by TMA": _gemm("gemm2", a_mode=0, b_kn=False, swiglu=False, N=H, K=I),
    "dgrad1: A by TMA, B [K, N]": _gemm("dgrad1", a_mode=0, b_kn=True, swiglu=False, N=H, K=2 * I),
    "dgrad2: row gather, B [K, N]": _gemm("dgrad2", a_mode=1, b_kn=True, swiglu=False, N=I, K=H),
    "wgrad (K-grouped)": _wgrad(H, I),
    # Qwen3-30B-A3B's dW2: fewer tiles per expert than programs, descriptors built for every tile
    "wgrad (K-grouped), 48 tiles per expert": _wgrad(2048, 768),
    **_small_kernels(),
    # the FP8 and MX wgrad operands' row-block starts, at 256 experts (DeepSeek-V3's at EP = 1)
    **{
        f"row-block starts, BLOCK={block} ALIGN={align}": (
            _block_starts_kernel,
            dict(row_start_ptr="*i32", block_start_ptr="*i32", G=256, BLOCK=block, ALIGN=align, BINS=256),
            {"num_warps": 1},
        )
        for block, align in ((128, 1), (32, 4))
    },
    # the routing tables at each bench model's local expert count (their tiles depend on it), and at the
    # fused EP path's send side for DeepSeek-V3 at EP = 2 and 8 (all 64 / 256 experts: 128 bins once
    # compiled to a 17 KB spill, 77 us a call on an H200)
    **{
        k: v
        for e in sorted({m.experts for m in MODELS.values()} | {2 * G, 8 * G})
        for k, v in _routing(e).items()
    },
}


if __name__ == "__main__":
    json.dump(report(LAUNCHES), sys.stdout, indent=1)
