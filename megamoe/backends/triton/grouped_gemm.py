"""Persistent M-grouped GEMM over expert-sorted rows: ``C[r] = A[r] @ B[expert(r)]^T``.

Legend: R rows (expert-sorted), G local experts, N output columns, K reduction, X tile-table rows.

One kernel serves every row-grouped GEMM of the expert path (GEMM1, GEMM2 and both dgrads)::

    for tile in range(program_id, num_m_tiles * num_n_tiles, num_programs):    # persistent, GROUP_M swizzle
        expert, r0, r_end = tiles[m_tile]                                 # device tile table
        for k in range(0, K, BLOCK_K):
            A_MODE 0: a = A[r0:r0+BM, k:k+BK]                             # TMA, contiguous rows
            A_MODE 1: a = A[rows[r0:r0+BM], k:k+BK]                       # fused dispatch: row gather
            acc += a @ B[expert, n:n+BN, k:k+BK]^T   (B_KN: B[expert, k:k+BK, n:n+BN])  # TMA
        C[r0:r_end, n:n+BN] = acc

GEMM1 with the SwiGLU epilogue (``act`` given; B = W1 ``[G, 2I, K]``, gate rows 0:I, up rows I:2I): a
tile covers the BN/2 gate columns ``[n, n+BN/2)`` and the same BN/2 up columns, B read through a
rank-4 TMA descriptor over the view ``W1[G, 2, I, K]`` (block ``[1, 2, BN/2, BK]``: no copy of the
weights), so the MMA is still one ``BM x BN`` dot and the epilogue holds both halves::

        gate, up = split(acc.to(C.dtype))                                 # [BM, BN/2] each
        C[.., n:n+BN/2] = gate;  C[.., I+n:I+n+BN/2] = up;  act[.., n:n+BN/2] = silu(gate) * up

SwiGLU is computed in fp32 from the gate/up values rounded to C's dtype, by the formula of the
separate pass (``swiglu.swiglu_tile``), so ``act`` has the bits that pass would give from ``C``.

Rows past a tile's segment end are never stored (they belong to the next expert's tile), so no
expert is padded in memory. With the SwiGLU epilogue the programs, once out of tiles, also zero the
rows past the routed ones (dropped slots) in ``h`` and ``act`` and may pick each row's routing weight
from its slot: no separate launch for either. B is read through a rank-3 TMA descriptor ``[G, N, K]``
whose bounds zero-fill ragged K and N. The row gather (A_MODE 1, GEMM1's fused dispatch) measured
faster than TMA loads of a pre-gathered copy (docs/kernels.md#measurements-that-chose-the-design), so
the forward never materialises the dispatched ``x``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.grid import cdiv
from megamoe.backends.triton.padding import zero_rows
from megamoe.backends.triton.routing import RoutingPlan, pick_row_values
from megamoe.backends.triton.swiglu import swiglu_tile


@triton.jit
def _swizzle(tile_id, num_m, num_n, GROUP_M: tl.constexpr):
    width = GROUP_M * num_n
    group = tile_id // width
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile_id % width) % size, (tile_id % width) // size


@triton.jit
def tile_product(
    a_ptrs,
    a_desc,
    r0,
    mask_m,
    b_desc,
    expert,
    n0,
    K,
    A_TMA: tl.constexpr,
    B_KN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATE_UP: tl.constexpr = False,
):
    """``A[tile rows] @ B[expert][n0:n0+BLOCK_N]^T`` in fp32: A by TMA from row ``r0`` (``A_TMA``) or through
    the row pointers ``a_ptrs`` (rows outside ``mask_m`` read as zero); B by TMA, ``[K, N]`` if ``B_KN``.
    ``GATE_UP``: ``b_desc`` is rank 4 over ``[G, 2, N/2, K]`` and the tile's B rows are the BLOCK_N/2 gate rows
    from ``n0`` then the same up rows (accumulator columns ``0:BLOCK_N/2`` gate, the rest up)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k0 = ki * BLOCK_K
        if A_TMA:
            a = a_desc.load([r0, k0])
        else:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            a_ptrs += BLOCK_K
        if GATE_UP:
            b = b_desc.load([expert, 0, n0, k0]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b.T, acc)
        elif B_KN:
            b = b_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc)
        else:
            b = b_desc.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _store_swiglu_tile(
    gate,
    up,
    c_ptr,
    act_ptr,
    r0,
    r_end,
    n0,
    inter,
    stride_c,
    stride_act,
    BLOCK_M: tl.constexpr,
    HALF: tl.constexpr,
):
    """Masked pointer stores of the tile's rows ``r < r_end`` (``r_end``: the expert's segment end), columns
    ``< I``: ``h[:, n0:n0+HALF] = gate``, ``h[:, I+n0:I+n0+HALF] = up`` and ``act = silu(gate) * up`` (gate
    and up already in h's dtype)."""
    act = swiglu_tile(gate, up).to(act_ptr.dtype.element_ty)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    rows64 = offs_m.to(tl.int64)[:, None]
    offs_n = n0 + tl.arange(0, HALF)
    mask = (offs_m < r_end)[:, None] & (offs_n < inter)[None, :]
    c_ptrs = c_ptr + rows64 * stride_c + offs_n[None, :]
    tl.store(c_ptrs, gate, mask=mask)
    tl.store(c_ptrs + inter, up, mask=mask)
    tl.store(act_ptr + rows64 * stride_act + offs_n[None, :], act, mask=mask)


@triton.jit
def _store_tile(c, c_ptr, r0, r_end, n0, N, stride_c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Masked pointer store of a tile: rows ``< r_end``, columns ``< N``."""
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    tl.store(c_ptrs, c, mask=(offs_m < r_end)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _grouped_gemm_kernel(
    # pointers / descriptors
    a_ptr,
    a_desc,
    a_rows_ptr,
    b_desc,
    c_ptr,
    act_ptr,
    tiles_ptr,
    num_tiles_ptr,
    valid_rows_ptr,
    slot_values_ptr,
    row_slot_ptr,
    row_values_ptr,
    # sizes and strides
    R,
    N,
    K,
    stride_a,
    stride_c,
    stride_act,
    num_programs,
    # meta-parameters
    A_MODE: tl.constexpr,
    B_KN: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_m = tl.load(num_tiles_ptr)
    HALF: tl.constexpr = BLOCK_N // 2
    inter = N // 2  # SWIGLU: C is [R, 2I] and a tile owns HALF columns of each half
    num_n = tl.cdiv(inter, HALF) if SWIGLU else tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # flattened: the persistent loop fused with the K loop, so the next tile's loads start during this
    # one's epilogue
    for tile_id in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=True):
        pid_m, pid_n = _swizzle(tile_id, num_m, num_n, GROUP_M)
        expert = tl.load(tiles_ptr + 3 * pid_m)
        r0 = tl.load(tiles_ptr + 3 * pid_m + 1)
        r_end = tl.load(tiles_ptr + 3 * pid_m + 2)
        n0 = pid_n * (HALF if SWIGLU else BLOCK_N)
        offs_m = r0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < r_end
        if A_MODE == 1:
            a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
            a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
        else:
            a_ptrs = a_ptr
        acc = tile_product(
            a_ptrs,
            a_desc,
            r0,
            mask_m,
            b_desc,
            expert,
            n0,
            K,
            A_MODE == 0,
            B_KN,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GATE_UP=SWIGLU,
        )
        if SWIGLU:
            h = acc.to(c_ptr.dtype.element_ty)
            gate, up = tl.split(tl.permute(tl.reshape(h, (BLOCK_M, 2, HALF)), (0, 2, 1)))
            _store_swiglu_tile(
                gate, up, c_ptr, act_ptr, r0, r_end, n0, inter, stride_c, stride_act, BLOCK_M, HALF
            )
        else:
            _store_tile(acc.to(c_ptr.dtype.element_ty), c_ptr, r0, r_end, n0, N, stride_c, BLOCK_M, BLOCK_N)
    if SWIGLU:
        valid = tl.load(valid_rows_ptr)
        # rows past the routed ones (dropped slots) are no tile's: zeros in h and act, shared by all programs
        for p0 in range(valid + tl.program_id(0) * BLOCK_M, R, num_programs * BLOCK_M):
            rows = p0 + tl.arange(0, BLOCK_M)
            zero_rows(c_ptr, rows, rows < R, N, BLOCK_M, BLOCK_N)
            zero_rows(act_ptr, rows, rows < R, inter, BLOCK_M, HALF)
        if row_values_ptr is not None:
            for p0 in range(tl.program_id(0) * BLOCK_M, R, num_programs * BLOCK_M):
                rows = p0 + tl.arange(0, BLOCK_M)
                pick_row_values(slot_values_ptr, row_slot_ptr, row_values_ptr, rows, valid, R)


def grouped_gemm(
    a: Tensor,
    b_GNK: Tensor,
    out: Tensor,
    plan: RoutingPlan,
    *,
    a_mode: int,
    b_kn: bool,
    config: TileConfig,
    num_sms: int,
    a_rows: Tensor | None = None,
    act: Tensor | None = None,
    row_values: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Launch :func:`_grouped_gemm_kernel` writing ``out`` (rows of the plan's tiles only).

    ``b_GNK`` is ``[G, N, K]`` (``b_kn=False``) or ``[G, K, N]`` (``b_kn=True``), contiguous.
    ``a`` is ``[R, K]`` expert-sorted (``a_mode=0``) or ``[T, K]`` gathered through ``a_rows`` (``a_mode=1``).
    ``act [R, N/2]`` (GEMM1 only, ``b_kn=False``): also write ``silu(out[:, :N/2]) * out[:, N/2:]`` there,
    and zero the padding rows (past the plan's routed rows) of both, contiguous, in the same launch.
    ``row_values = (values_S, row_slot_R, out_R)`` (with ``act`` only): also write what
    :func:`~.routing.pick_rows` would, ``out_R[r] = values_S[row_slot_R[r]]``, 0 on padding rows.
    ``config``: the tile shape and launch options.
    """
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if bm != plan.block_m:
        raise ValueError(f"BLOCK_M={bm} must equal the plan's block_m={plan.block_m}")
    if row_values is not None and act is None:
        raise ValueError("row_values are picked by the SwiGLU epilogue's programs: pass act too")
    if act is not None:
        if not (out.is_contiguous() and act.is_contiguous()):
            raise ValueError("the SwiGLU epilogue zeroes padding rows of a contiguous out and act")
        if b_kn:
            raise ValueError("the SwiGLU epilogue (act given) needs b_kn=False: B is W1 [G, 2I, K]")
        G, N, K = b_GNK.shape
        if N % 2 or tuple(act.shape) != (out.shape[0], N // 2):
            raise ValueError(
                f"act must be [R={out.shape[0]}, {N // 2}] for B [G, {N}, K], got {tuple(act.shape)}"
            )
        b_desc = TensorDescriptor.from_tensor(b_GNK.view(G, 2, N // 2, K), [1, 2, bn // 2, bk])
        num_n = cdiv(N // 2, bn // 2)
    elif b_kn:
        K, N = b_GNK.shape[1], b_GNK.shape[2]
        b_desc = TensorDescriptor.from_tensor(b_GNK, [1, bk, bn])
    else:
        N, K = b_GNK.shape[1], b_GNK.shape[2]
        b_desc = TensorDescriptor.from_tensor(b_GNK, [1, bn, bk])
    if act is None:
        num_n = cdiv(N, bn)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk]) if a_mode == 0 else None
    grid_size = min(num_sms, plan.max_tiles * num_n)
    _grouped_gemm_kernel[(grid_size,)](
        a,
        a_desc,
        a_rows,
        b_desc,
        out,
        act,
        plan.tiles_X3,
        plan.num_tiles_1,
        plan.expert_start_G1[-1:],
        *(row_values or (None, None, None)),
        out.shape[0],
        N,
        K,
        a.stride(0),
        out.stride(0),
        act.stride(0) if act is not None else 0,
        grid_size,
        A_MODE=a_mode,
        B_KN=b_kn,
        SWIGLU=act is not None,
        **config.launch_kwargs(),
    )
