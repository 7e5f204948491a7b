"""Host-side launchers of :mod:`megamoe.backends.symm.kernels` (static shapes only: no host sync)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.symm.comm import (
    gather_broadcast_rows_kernel,
    pool_tokens_kernel,
    pool_weights_kernel,
    return_rows_kernel,
)
from megamoe.backends.symm.gemm_tile import MAX_FLAT_WORLD
from megamoe.backends.symm.kernels import (
    COMM_ONLY,
    PRODUCTION,
    TRACE_SLOTS,
    TRACED,
    GemmOperands,
    SendTables,
    WorkspaceViews,
    fused_kernel,
)
from megamoe.backends.symm.layout import SymmLayout
from megamoe.backends.symm.signals import barrier_kernel, wait_kernel
from megamoe.backends.symm.workspace import STATE_DONE, STATE_EPOCH, SymmWorkspace
from megamoe.backends.triton.configs import gemm_config, num_programs
from megamoe.backends.triton.grid import cdiv, next_power_of_2
from megamoe.backends.triton.side_gather import BLOCK_H as GATHER_BLOCK_H
from megamoe.backends.triton.side_gather import BLOCK_R as GATHER_BLOCK_R
from megamoe.backends.triton.side_gather import NUM_WARPS as GATHER_WARPS
from megamoe.errors import InvalidConfigError


def comm_programs(ws: SymmWorkspace, device: torch.device) -> int:
    """Programs that push rows before joining the GEMM (the workspace's ``comm_programs``).

    One in the CPU interpreter: it runs programs one after another, so a second comm program would
    start only after the first had waited for its rows.
    """
    return ws.settings.comm_programs if device.type == "cuda" else 1


def begin_op(ws: SymmWorkspace, counts_E: Tensor | None = None) -> None:
    """Bump the epoch and barrier with every EP rank; with ``counts_E``, also publish this rank's counts."""
    E = ws.key.num_experts
    barrier_kernel[(1,)](
        ws.ptrs_dev,
        ws.state,
        counts_E,
        ws.signal_G,
        ws.rank,
        ws.world,
        E,
        ws.num_local_experts,
        ws.view("arrive"),
        ws.view("counts"),
        ws.settings.max_spins(),
        HAS_COUNTS=counts_E is not None,
        BLOCK_E=min(next_power_of_2(max(E, 1)), 1024),
        num_warps=4,
    )


def wait_flags(ws: SymmWorkspace, region: str, counter_id: int) -> None:
    """Wait until every flag of ``region`` (``pool_ready`` or ``combine_ready``) reached this op's epoch."""
    flags = ws.view(region).reshape(-1)
    wait_kernel[(1,)](
        flags, flags.numel(), ws.state, ws.rank, counter_id, ws.settings.max_spins(), num_warps=1
    )


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Rows of a local ``[T, H]`` tensor to move to their experts' pools (with their routing weights).

    Push mode uses the send side (``send_*``, ``dest_row``); pull mode the receive segments
    (``seg_*``) and what :func:`stage_for_pull` staged before the op's barrier.
    """

    src_TH: Tensor
    send_token_S: Tensor
    send_start_E1: Tensor
    send_dest_row_E: Tensor
    seg_start_GW: Tensor
    seg_len_GW: Tensor
    seg_pos_GW: Tensor
    send_slot_S: Tensor | None = None
    weights_TK: Tensor | None = None
    pull: bool = False


def stage_for_pull(
    ws: SymmWorkspace,
    src_TH: Tensor,
    send_token_S: Tensor,
    send_weight_S: Tensor | None = None,
) -> None:
    """Pull mode, before the op's barrier: copy the rows, their tokens and (float32, in send order) routing
    weights into the staging bank of the coming epoch (two banks, so peers may still read the previous
    op's while this one is written)."""
    T, S = src_TH.shape[0], send_token_S.numel()
    bank = (ws.state[:1].long() + 1) % 2
    rows = bank * ws.max_tokens + torch.arange(T, device=bank.device)
    ws.view("stage_x", src_TH.shape[1]).index_copy_(0, rows, src_TH)
    slots = bank * ws.max_tokens * ws.key.topk + torch.arange(S, device=bank.device)
    ws.view("stage_token").index_copy_(0, slots, send_token_S)
    if send_weight_S is not None:
        ws.view("stage_weight").index_copy_(0, slots, send_weight_S)


def broadcast_rows(
    ws: SymmWorkspace, x_TH: Tensor, send_token_S: Tensor, send_weight_S: Tensor | None = None
) -> None:
    """Broadcast mode, after the op's barrier: copy this rank's ``x`` (or ``dy``, or rows of another width
    up to H: :func:`~megamoe.backends.symm.workspace.narrow_rows`), send-order tokens [and routing weights]
    into every peer's workspace, then set the flags ``pool_ready[me, *]`` there.

    Everything is ``copy_`` between device buffers mapped by symmetric memory: the copy engines, no SM.
    The flags are the barrier's ``signal_G`` (this op's epoch per expert), copied right after the rows
    on the same stream, so a peer that sees them sees the rows, and the GEMM keeps every SM. On CUDA
    the copies run on a side stream while the GEMM runs; :func:`join_broadcast` joins it back after
    the GEMM's launch.
    """
    if not ws.shapes["bcast_x"][0][0]:
        raise InvalidConfigError(
            "symm.dispatch (MEGAMOE_SYMM_DISPATCH)",
            "broadcast",
            "this EP group's workspace was allocated in another mode, without the broadcast regions",
            "Use one dispatch mode on every rank from the first MegaMoE op on",
        )
    T, S, me = x_TH.shape[0], send_token_S.numel(), ws.rank
    rows = slice(me * ws.max_tokens, me * ws.max_tokens + T)
    slots = slice(me * ws.max_tokens * ws.key.topk, me * ws.max_tokens * ws.key.topk + S)

    def copies_then_signal() -> None:
        for d in range(ws.world):
            if d != me:
                ws.peer_view(d, "bcast_x", x_TH.shape[1])[rows].copy_(x_TH)
                ws.peer_view(d, "bcast_token")[slots].copy_(send_token_S)
                if send_weight_S is not None:
                    ws.peer_view(d, "bcast_weight")[slots].copy_(send_weight_S)
                ws.peer_view(d, "pool_ready")[me].copy_(ws.signal_G)

    if not x_TH.is_cuda:
        copies_then_signal()
        return
    if ws.side_stream is None:
        ws.side_stream = torch.cuda.Stream(device=x_TH.device)
    side = ws.side_stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        copies_then_signal()
    if not torch.cuda.is_current_stream_capturing():  # a captured graph keeps its memory anyway
        for t in (x_TH, send_token_S, send_weight_S):
            if t is not None:
                t.record_stream(side)


def gather_broadcast_rows(
    ws: SymmWorkspace, layout: SymmLayout, src_TH: Tensor, send_token_S: Tensor
) -> None:
    """Broadcast mode's backward: fill this rank's pool with its rows in pool order (the wgrad's
    operand, read by TMA) from its own ``src_TH`` and the peers' copies, once they are released.

    Call it right after the dgrad kernel's launch: on CUDA it runs on :func:`broadcast_rows`' side
    stream, after this rank's own copies, in the SM room the persistent GEMM leaves (one 4-warp
    program per SM, as :mod:`megamoe.backends.triton.side_gather`); :func:`join_broadcast` joins it.
    """
    G = ws.num_local_experts

    def gather() -> None:
        pool = ws.view("pool")
        grid = num_programs(pool.device)
        gather_broadcast_rows_kernel[(grid,)](
            src_TH, send_token_S, ws.view("bcast_x"), ws.view("bcast_token"), layout.row_src_R,
            layout.row_pos_R, layout.expert_start_G1, pool, ws.state, ws.view("pool_ready"), ws.rank,
            ws.world, G, src_TH.shape[1], ws.max_tokens, ws.max_tokens * ws.key.topk, grid, ws.settings.max_spins(),
            BLOCK_R=GATHER_BLOCK_R, BLOCK_H=GATHER_BLOCK_H, num_warps=GATHER_WARPS,
        )  # fmt: skip

    if ws.side_stream is None:  # the CPU: in order, after the GEMM
        gather()
        return
    with torch.cuda.stream(ws.side_stream):
        gather()
    if not torch.cuda.is_current_stream_capturing():
        for t in (src_TH, send_token_S):
            t.record_stream(ws.side_stream)


def pool_weights(
    ws: SymmWorkspace, layout: SymmLayout, send_weight_S: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """Stage 1 forward, after the GEMM: each pool row's routing weight (``[P]``, ``dtype``, 0 past the
    valid rows), in one kernel. ``send_weight_S`` (broadcast mode): this rank's weights in send order;
    the peers' come from their copies. Else the comm role's ``pool_weight``."""
    P, broadcast = ws.pool_rows, send_weight_S is not None
    out = torch.empty(P, dtype=dtype, device=ws.state.device)
    if P == 0:
        return out
    block = 1024
    pool_weights_kernel[(cdiv(P, block),)](
        layout.row_src_R, layout.row_pos_R, layout.expert_start_G1, send_weight_S if broadcast else None,
        ws.view("bcast_weight") if broadcast else ws.view("pool_weight"), out, ws.rank,
        ws.num_local_experts, P, ws.max_tokens * ws.key.topk, BROADCAST=broadcast, BLOCK=block,
    )  # fmt: skip
    return out


def pool_tokens(ws: SymmWorkspace, layout: SymmLayout, send_token_S: Tensor) -> Tensor:
    """Broadcast mode, once every peer's copy arrived: each pool row's row in ``bcast_x`` (``[W * T_max,
    H]``; ``[P]`` int32, 0 past the valid rows), for a GEMM that gathers its rows there instead of from a
    filled pool. The caller copies this rank's own rows into its own slot."""
    P = ws.pool_rows
    out = torch.empty(P, dtype=torch.int32, device=ws.state.device)
    block = 1024
    pool_tokens_kernel[(cdiv(P, block),)](
        layout.row_src_R, layout.row_pos_R, layout.expert_start_G1, send_token_S, ws.view("bcast_token"),
        out, ws.rank, ws.num_local_experts, P, ws.max_tokens, ws.max_tokens * ws.key.topk, BLOCK=block,
    )  # fmt: skip
    return out


def return_rows(
    ws: SymmWorkspace,
    layout: SymmLayout,
    rows_PN: Tensor,
    *,
    first_column: int = 0,
    row_scale_P: Tensor | None = None,
    scalar_P: Tensor | None = None,
    signal: bool = True,
) -> None:
    """Send the valid pool rows of ``rows_PN`` (columns ``first_column`` on of each source's combine slot)
    home, in one launch (:func:`~megamoe.backends.symm.comm.return_rows_kernel`); ``signal`` on the last
    call of an op, which every rank makes, also one without rows (its peers wait for its flag)."""
    P, N = rows_PN.shape
    if rows_PN.stride(1) != 1 and N > 1:
        raise ValueError(f"rows to return need unit column stride, got strides {rows_PN.stride()}")
    cuda = rows_PN.device.type == "cuda"
    block_n = min(next_power_of_2(max(N, 1)), 256 if cuda else 32)
    block_r = max(1, 4096 // block_n) if cuda else 4
    grid = max(1, min(num_programs(rows_PN.device), cdiv(P, block_r)))
    return_rows_kernel[(grid,)](
        rows_PN, layout.expert_start_G1[-1:], row_scale_P, scalar_P, layout.row_src_R, layout.row_pos_R,
        ws.view("combine"), ws.view("combine_scalar"), ws.view("combine_ready"), ws.state[STATE_EPOCH:],
        ws.state[STATE_DONE:], ws.ptrs_dev, ws.rank, ws.world, ws.key.hidden, N, first_column,
        rows_PN.stride(0), grid, ROW_SCALE=row_scale_P is not None, PUSH_SCALAR=scalar_P is not None,
        SIGNAL=signal, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4 if cuda else 1,
    )  # fmt: skip


def join_broadcast(ws: SymmWorkspace) -> None:
    """The current stream waits for :func:`broadcast_rows`' side stream (CUDA; nothing on the CPU)."""
    if ws.side_stream is not None:
        torch.cuda.current_stream().wait_stream(ws.side_stream)


def push_rows(ws: SymmWorkspace, dispatch: Dispatch) -> None:
    """Push or pull mode without a GEMM: only the fused kernel's comm role runs (no tiles, every program
    moves rows), filling every destination's pool [and routing weights] in pool order and releasing
    its ``pool_ready`` flags; :func:`wait_flags` on ``pool_ready`` then waits for this rank's pool."""
    pool = ws.view("pool")
    table = torch.zeros(4, dtype=torch.int32, device=pool.device)  # zero tiles, and one empty table row
    grid = ws.programs or num_programs(pool.device)
    fused_gemm(  # B and C are the pool itself: valid descriptors, never read or written without tiles
        ws, op="gemm1", a_RK=pool, b=pool.unsqueeze(0), b_kn=False, tiles_X3=table[1:].view(1, 3),
        num_tiles_1=table[:1], out_RN=pool, push=dispatch, num_comm=grid,
        name=f"rows, {'pull' if dispatch.pull else 'push'}{' + weights' if dispatch.weights_TK is not None else ''}",
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RemoteOut:
    """Send each output row to its source rank's combine slot (and a per-row scalar with it)."""

    row_src_R: Tensor
    row_pos_R: Tensor
    scalar_R: Tensor | None = None
    own_tiles_1: Tensor | None = None
    """the layout's ``num_local_tiles_1``: the tile table's leading tiles of this rank's own rows, whose
    outputs stay local; the kernel then takes them in even proportion with the tiles that store to
    peers, so the NVLink stores run through the whole GEMM instead of its second half (stage 2's
    GEMM2: 1.3-2 % faster on 2 x H200; GEMM1-dgrad, whose stores are half as dense, passes None)."""


VARIANTS = {"production": PRODUCTION, "comm_only": COMM_ONLY, "traced": TRACED}
"""The fused kernel's variants: what the layer runs, the K loop left out (tiles store zeros: the
benchmark's communication-only leg), and every program's timeline recorded
(:func:`program_timeline`; ``SymmSettings.trace`` picks it for every launch)."""


@dataclass(frozen=True, slots=True)
class LaunchFlags:
    """What one fused launch does, as the kernel's constexpr switches (tile sizes, ``FLAT`` and
    ``IN_PTX`` aside: those follow the settings and the device)."""

    COMM: bool = False
    """a comm role moves rows into the pools (push, or pull with ``PULL``)"""
    PULL: bool = False
    PUSH_WEIGHT: bool = False
    """the comm role moves each row's routing weight too"""
    WAIT: bool = False
    """tiles wait for their rows' ``pool_ready`` flags"""
    OUT_REMOTE: bool = False
    """each output row goes to its source rank's combine slot"""
    ROW_SCALE: bool = False
    PUSH_SCALAR: bool = False
    SIGNAL: bool = False
    """the last program releases ``combine_ready`` on every rank"""
    LOCAL_A: bool = False
    """this rank's own rows are read from ``x`` by token, never copied to its pool"""
    BCAST_A: bool = False
    """a peer's rows are read from its broadcast copy of ``x``"""
    SPREAD: bool = False
    B_KN: bool = False

    def as_constexprs(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


_IN_FWD = LaunchFlags(WAIT=True, LOCAL_A=True)  # own rows from x, tiles wait for the peers'
_TO_SOURCES = LaunchFlags(OUT_REMOTE=True, PUSH_SCALAR=True, SIGNAL=True, B_KN=True)  # dx and d(weight) home
FUSED_LAUNCHES: dict[str, tuple[str, LaunchFlags]] = {
    # stage 1 forward: rows of x moved (comm role | copy engines) while GEMM1's tiles wait for them
    "stage1 fwd, push": ("gemm1", replace(_IN_FWD, COMM=True, PUSH_WEIGHT=True)),
    "stage1 fwd, pull": ("gemm1", LaunchFlags(COMM=True, PULL=True, PUSH_WEIGHT=True, WAIT=True)),
    "stage1 fwd, broadcast": ("gemm1", replace(_IN_FWD, BCAST_A=True)),
    # stage 2 forward: GEMM2 * routing weight, each row stored at its source's combine slot
    "stage2 fwd": ("gemm2", LaunchFlags(OUT_REMOTE=True, ROW_SCALE=True, SIGNAL=True, SPREAD=True)),
    # stage 2 backward: dy rows moved while the dgrad2 tiles wait for them
    "stage2 bwd, push": ("dgrad2", LaunchFlags(COMM=True, WAIT=True, B_KN=True)),
    "stage2 bwd, pull": ("dgrad2", LaunchFlags(COMM=True, PULL=True, WAIT=True, B_KN=True)),
    "stage2 bwd, broadcast": ("dgrad2", replace(_IN_FWD, BCAST_A=True, B_KN=True)),
    # stage 1 backward: x rows moved again (for dW1) while dgrad1 sends dx and d(weight) home
    "stage1 bwd, push": ("dgrad1", replace(_TO_SOURCES, COMM=True)),
    "stage1 bwd, pull": ("dgrad1", replace(_TO_SOURCES, COMM=True, PULL=True)),
    "stage1 bwd, broadcast": ("dgrad1", _TO_SOURCES),
    # rows moved by the comm role alone, no tiles (the MXFP8 path's transport, :func:`push_rows`)
    "rows, push": ("gemm1", LaunchFlags(COMM=True)),
    "rows, push + weights": ("gemm1", LaunchFlags(COMM=True, PUSH_WEIGHT=True)),
    "rows, pull": ("gemm1", LaunchFlags(COMM=True, PULL=True)),
    "rows, pull + weights": ("gemm1", LaunchFlags(COMM=True, PULL=True, PUSH_WEIGHT=True)),
}
"""Every launch the EP path makes, by name: the backend names each of its launches and
:func:`fused_gemm` checks it against this table, and the sm90 compile test compiles every entry
(tests/megamoe/symm/sm90_compile.py), so the two cannot drift. Unnamed launches (the benchmark's
partial legs, tests) are free."""


def fused_gemm(
    ws: SymmWorkspace,
    *,
    op: str,
    a_RK: Tensor,
    b: Tensor,
    b_kn: bool,
    tiles_X3: Tensor,
    num_tiles_1: Tensor,
    out_RN: Tensor | None = None,
    push: Dispatch | None = None,
    wait: bool = False,
    remote: RemoteOut | None = None,
    row_scale_R: Tensor | None = None,
    variant: str | None = None,
    name: str | None = None,
    num_comm: int | None = None,
    local_rows: SymmLayout | None = None,
    broadcast: tuple[Tensor, Tensor] | None = None,
    max_registers: int | None = None,
) -> None:
    """One launch of the fused kernel: optional row push, grouped GEMM ``A @ B[expert]``, local or remote out.

    ``variant``: one of :data:`VARIANTS` (None: ``traced`` with ``settings.trace``, else ``production``).
    ``name``: the :data:`FUSED_LAUNCHES` entry this launch is; its flags must be that entry's.
    ``num_comm`` overrides :func:`comm_programs` (tests of the comm role alone, with no tiles).
    ``local_rows`` (push mode): the op's layout; this rank's own rows are then not copied into its pool,
    GEMM tiles read them from ``push.src_TH`` by token (the pool rows' source rank and send position),
    and the layout's first ``num_local_tiles`` tiles, which hold only those, wait for nothing.
    ``broadcast`` (broadcast mode, with ``local_rows`` and ``wait``): ``(x, send tokens)``; own rows from
    ``x``, a peer's from its copy in the workspace (:func:`broadcast_rows`), no comm role.
    ``max_registers``: ptxas's cap per thread (``maxnreg``), to leave room for a kernel beside it.
    """
    if wait and push is None and broadcast is None:
        raise ValueError("wait=True waits for rows a comm role pushes or a broadcast copies: pass push=")
    local_a = local_rows is not None and ((push is not None and not push.pull) or broadcast is not None)
    src_TH, send_token_S = broadcast or ((push.src_TH, push.send_token_S) if push else (None, None))
    if remote:
        row_src, row_pos = remote.row_src_R, remote.row_pos_R
    else:
        row_src, row_pos = (local_rows.row_src_R, local_rows.row_pos_R) if local_a else (None, None)
    spread = remote is not None and remote.own_tiles_1 is not None
    own_tiles = local_rows.num_local_tiles_1 if local_a else (remote.own_tiles_1 if spread else None)
    cfg = gemm_config(op, a_RK.device)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if b_kn:
        K, N = b.shape[1], b.shape[2]
        b_desc = TensorDescriptor.from_tensor(b, [1, bk, bn])
    else:
        N, K = b.shape[1], b.shape[2]
        b_desc = TensorDescriptor.from_tensor(b, [1, bn, bk])
    grid = ws.programs or num_programs(a_RK.device)
    H = src_TH.shape[1] if src_TH is not None else 0
    variant = variant or ("traced" if ws.settings.trace else "production")
    flags = LaunchFlags(
        COMM=push is not None,
        PULL=push is not None and push.pull,
        PUSH_WEIGHT=push is not None and push.weights_TK is not None,
        WAIT=wait,
        OUT_REMOTE=remote is not None,
        ROW_SCALE=row_scale_R is not None,
        PUSH_SCALAR=remote is not None and remote.scalar_R is not None,
        SIGNAL=remote is not None,
        LOCAL_A=local_a,
        BCAST_A=broadcast is not None,
        SPREAD=spread,
        B_KN=b_kn,
    )
    if name is not None and FUSED_LAUNCHES[name] != (op, flags):
        raise RuntimeError(f"fused launch {name!r} is {FUSED_LAUNCHES[name]}, launched as {op} {flags}")
    bcast = broadcast is not None
    fused_kernel[(grid,)](
        SendTables(
            src_TH,
            send_token_S,
            push.send_slot_S if push else None,
            push.weights_TK if push else None,
            push.send_start_E1 if push else None,
            push.send_dest_row_E if push else None,
            push.seg_start_GW if push else None,
            push.seg_len_GW if push else None,
            push.seg_pos_GW if push else None,
        ),
        GemmOperands(
            a_RK,
            out_RN,
            row_scale_R,
            remote.scalar_R if remote else None,
            row_src,
            row_pos,
            tiles_X3,
            num_tiles_1,
            own_tiles,
        ),
        b_desc,
        WorkspaceViews(
            ws.ptrs_dev,
            ws.state,
            ws.view("pool_ready"),
            ws.view("pool"),
            ws.view("pool_weight"),
            ws.view("combine"),
            ws.view("combine_scalar"),
            ws.view("combine_ready"),
            ws.view("stage_x"),
            ws.view("stage_token"),
            ws.view("stage_weight"),
            ws.task_done,
            ws.view("bcast_x") if bcast else None,
            ws.view("bcast_token") if bcast else None,
        ),
        ws.rank,
        ws.world,
        ws.num_local_experts,
        ws.pool_rows,
        H,
        ws.max_tokens,
        ws.max_tokens * ws.key.topk,
        N,
        K,
        a_RK.stride(0),
        out_RN.stride(0) if out_RN is not None else 0,
        grid,
        min(num_comm or comm_programs(ws, a_RK.device), grid),
        ws.settings.tail_percent,
        ws.settings.max_spins(),
        # without a comm role every tile is in the flattened loop, whose waits must be the flat ones
        FLAT=(ws.settings.flat_wait or (wait and push is None)) and ws.world <= MAX_FLAT_WORLD,
        IN_PTX=a_RK.is_cuda,
        **flags.as_constexprs(),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=cfg.group_m,
        COPY_ROWS=32,
        COPY_COLS=512,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=max_registers,
        trace_ptr=_trace_buffer(ws, grid) if variant == "traced" else None,
        VARIANT=VARIANTS[variant],
    )


def _trace_buffer(ws: SymmWorkspace, grid: int) -> Tensor:
    if ws.trace is None or ws.trace.shape[0] != grid:
        ws.trace = torch.zeros(grid, TRACE_SLOTS, dtype=torch.int64, device=ws.state.device)
    return ws.trace


def program_timeline(ws: SymmWorkspace) -> Tensor:
    """The last traced fused launch, one row per program: start, comm role done, fixed-stride tiles
    done, end (GPU global timer, ns; 0 on the CPU), tiles claimed from the counter."""
    if ws.trace is None:
        raise RuntimeError("no traced launch: build the workspace with symm.trace on (MEGAMOE_SYMM_TRACE=1)")
    return ws.trace.clone()


def check(ws: SymmWorkspace) -> None:
    """Debug mode: synchronise and raise if a wait gave up (skipped while a CUDA graph is captured)."""
    if not ws.settings.debug:
        return
    if ws.state.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.current_stream().synchronize()
    ws.check()
