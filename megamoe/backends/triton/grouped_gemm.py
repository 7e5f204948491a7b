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
expert is padded in memory. B is read through a rank-3 TMA descriptor ``[G, N, K]`` whose bounds
zero-fill ragged K and N. The row gather (A_MODE 1, GEMM1's fused dispatch) measured faster on an
H200 than TMA loads of a pre-gathered copy (782 against 681 TFLOP/s at DeepSeek-V3's GEMM1, one
sweep), so the
forward never materialises the dispatched ``x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.routing import RoutingPlan
from megamoe.backends.triton.swiglu import swiglu_tile


def _alloc_scratch(size: int, alignment: int, stream) -> Tensor:
    """Global scratch for device-side TMA descriptors (``STORE_TMA=2``), from torch's allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


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
def gate_up_product(
    a_ptrs,
    mask_m,
    b_desc,
    expert,
    n0,
    K,
    BLOCK_M: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """GEMM1's tile as two accumulators, ``(A @ gate^T, A @ up^T)`` in fp32, each ``[BLOCK_M, HALF]``: A through
    the row pointers ``a_ptrs`` (rows outside ``mask_m`` read as zero), B by TMA from the rank-4 descriptor
    over ``W1[G, 2, I, K]`` with block ``[1, 1, HALF, BLOCK_K]`` (gate rows ``n0:n0+HALF``, then the same up
    rows): two ``BLOCK_M x HALF`` dots per K step, so the epilogue needs no split of one accumulator."""
    offs_k = tl.arange(0, BLOCK_K)
    gate = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k0 = ki * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
        a_ptrs += BLOCK_K
        b_gate = b_desc.load([expert, 0, n0, k0]).reshape(HALF, BLOCK_K)
        b_up = b_desc.load([expert, 1, n0, k0]).reshape(HALF, BLOCK_K)
        gate = tl.dot(a, b_gate.T, gate)
        up = tl.dot(a, b_up.T, up)
    return gate, up


@triton.jit
def _store_swiglu_rows(
    gate,
    up,
    act,
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
    """Masked pointer stores of a SwiGLU tile: rows ``< r_end``, columns ``< I``."""
    offs_m = r0 + tl.arange(0, BLOCK_M)
    rows64 = offs_m.to(tl.int64)[:, None]
    offs_n = n0 + tl.arange(0, HALF)
    mask = (offs_m < r_end)[:, None] & (offs_n < inter)[None, :]
    c_ptrs = c_ptr + rows64 * stride_c + offs_n[None, :]
    tl.store(c_ptrs, gate, mask=mask)
    tl.store(c_ptrs + inter, up, mask=mask)
    tl.store(act_ptr + rows64 * stride_act + offs_n[None, :], act, mask=mask)


@triton.jit
def _store_rows(c, c_ptr, r0, r_end, n0, N, stride_c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Masked pointer store of a tile: rows ``< r_end``, columns ``< N``."""
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    tl.store(c_ptrs, c, mask=(offs_m < r_end)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _store_swiglu_tile(
    gate,
    up,
    c_ptr,
    act_ptr,
    c_desc,
    act_desc,
    r0,
    r_end,
    n0,
    inter,
    stride_c,
    stride_act,
    STORE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HALF: tl.constexpr,
):
    """Write the tile's rows ``r < r_end`` (``r_end``: the expert's segment end) of ``h[:, n0:n0+HALF] = gate``,
    ``h[:, I+n0:I+n0+HALF] = up`` and ``act = silu(gate) * up`` (gate and up already in h's dtype).

    STORE_TMA 0: masked pointer stores. 1: TMA stores through the host descriptors when the tile is full
    (``r0 + BLOCK_M <= r_end``: a TMA box clips only at the tensor's end, and the rows past the segment
    end are the next expert's), masked pointer stores for an expert's ragged last tile. 2: TMA stores
    through descriptors made here whose row bound is ``r_end``, so TMA clips the ragged tile itself.
    3: TMA stores through the host descriptors only, without a branch (a runtime ``if`` in the
    epilogue breaks triton's nested-loop fusion): the kernel has shifted an expert's ragged last tile
    back to end at ``r_end`` (:func:`_shift_ragged_tile`), so every tile is full except the one tile of
    an expert with fewer than BLOCK_M rows; that one goes to the tensor's end (a box wholly out of
    bounds writes nothing) and a second launch (``SMALL_ONLY``) writes it with pointer stores."""
    act = swiglu_tile(gate, up).to(act_ptr.dtype.element_ty)
    if STORE_TMA == 3:
        full = r0 + BLOCK_M <= r_end
        row = tl.where(full, r0, c_desc.shape[0])
        c_desc.store([row, 0, n0], gate.reshape(BLOCK_M, 1, HALF))
        c_desc.store([row, 1, n0], up.reshape(BLOCK_M, 1, HALF))
        act_desc.store([tl.where(full, r0, act_desc.shape[0]), n0], act)
    elif STORE_TMA == 2:
        h_rows = tl.make_tensor_descriptor(
            c_ptr, shape=[r_end, 2, inter], strides=[stride_c, inter, 1], block_shape=[BLOCK_M, 1, HALF]
        )
        act_rows = tl.make_tensor_descriptor(
            act_ptr, shape=[r_end, inter], strides=[stride_act, 1], block_shape=[BLOCK_M, HALF]
        )
        h_rows.store([r0, 0, n0], gate.reshape(BLOCK_M, 1, HALF))
        h_rows.store([r0, 1, n0], up.reshape(BLOCK_M, 1, HALF))
        act_rows.store([r0, n0], act)
    elif STORE_TMA == 1:
        if r0 + BLOCK_M <= r_end:
            c_desc.store([r0, 0, n0], gate.reshape(BLOCK_M, 1, HALF))
            c_desc.store([r0, 1, n0], up.reshape(BLOCK_M, 1, HALF))
            act_desc.store([r0, n0], act)
        else:
            _store_swiglu_rows(
                gate, up, act, c_ptr, act_ptr, r0, r_end, n0, inter, stride_c, stride_act, BLOCK_M, HALF
            )
    else:
        _store_swiglu_rows(
            gate, up, act, c_ptr, act_ptr, r0, r_end, n0, inter, stride_c, stride_act, BLOCK_M, HALF
        )


@triton.jit
def _store_tile(
    c,
    c_ptr,
    c_desc,
    r0,
    r_end,
    n0,
    N,
    stride_c,
    STORE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Write ``C[r0:r_end, n0:n0+BLOCK_N] = c``; STORE_TMA as in :func:`_store_swiglu_tile`."""
    if STORE_TMA == 3:
        c_desc.store([tl.where(r0 + BLOCK_M <= r_end, r0, c_desc.shape[0]), n0], c)
    elif STORE_TMA == 2:
        c_rows = tl.make_tensor_descriptor(
            c_ptr, shape=[r_end, N], strides=[stride_c, 1], block_shape=[BLOCK_M, BLOCK_N]
        )
        c_rows.store([r0, n0], c)
    elif STORE_TMA == 1:
        if r0 + BLOCK_M <= r_end:
            c_desc.store([r0, n0], c)
        else:
            _store_rows(c, c_ptr, r0, r_end, n0, N, stride_c, BLOCK_M, BLOCK_N)
    else:
        _store_rows(c, c_ptr, r0, r_end, n0, N, stride_c, BLOCK_M, BLOCK_N)


@triton.jit
def _shift_ragged_tile(tiles_ptr, pid_m, expert, r0, r_end, BLOCK_M: tl.constexpr):
    """``(first row, small)`` of the tile to compute with ``STORE_TMA=3``: ``r0``, but ``r_end - BLOCK_M``
    for an expert's ragged last tile when the tile before it is the same expert's, so the tile is full
    and ends at the segment end. Its first rows are the previous tile's last ones, recomputed from the
    same A rows, B columns and K order: both tiles write the same bits there. ``small``: the ragged
    tile of an expert with fewer than BLOCK_M rows, which cannot shift (TMA cannot store it without
    writing the next expert's rows; the ``SMALL_ONLY`` launch does). No branch (scalar selects)."""
    prev_expert = tl.load(tiles_ptr + 3 * pid_m - 3, mask=pid_m > 0, other=-1)
    ragged = r0 + BLOCK_M > r_end
    shift = ragged & (prev_expert == expert)
    return tl.where(shift, r_end - BLOCK_M, r0), ragged & (prev_expert != expert)


@triton.jit
def _grouped_gemm_kernel(
    # pointers / descriptors
    a_ptr,
    a_desc,
    a_rows_ptr,
    b_desc,
    c_ptr,
    act_ptr,
    c_desc,
    act_desc,
    tiles_ptr,
    num_tiles_ptr,
    # sizes and strides
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
    SPLIT_GATE_UP: tl.constexpr,
    STORE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SMALL_ONLY: tl.constexpr = False,
):
    num_m = tl.load(num_tiles_ptr)
    HALF: tl.constexpr = BLOCK_N // 2
    inter = N // 2  # SWIGLU: C is [R, 2I] and a tile owns HALF columns of each half
    num_n = tl.cdiv(inter, HALF) if SWIGLU else tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=FLATTEN):
        pid_m, pid_n = _swizzle(tile_id, num_m, num_n, GROUP_M)
        expert = tl.load(tiles_ptr + 3 * pid_m)
        r0 = tl.load(tiles_ptr + 3 * pid_m + 1)
        r_end = tl.load(tiles_ptr + 3 * pid_m + 2)
        small = False
        if STORE_TMA == 3 or SMALL_ONLY:
            r0_shifted, small = _shift_ragged_tile(tiles_ptr, pid_m, expert, r0, r_end, BLOCK_M)
            if STORE_TMA == 3:
                r0 = r0_shifted
        if SMALL_ONLY:  # the second launch of STORE_TMA=3: only the tiles it could not store
            run = small
        else:
            run = True
        if run:
            n0 = pid_n * (HALF if SWIGLU else BLOCK_N)
            offs_m = r0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < r_end
            if A_MODE == 1:
                a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
                a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
            else:
                a_ptrs = a_ptr
            if SWIGLU and SPLIT_GATE_UP:
                gate32, up32 = gate_up_product(a_ptrs, mask_m, b_desc, expert, n0, K, BLOCK_M, HALF, BLOCK_K)
                gate = gate32.to(c_ptr.dtype.element_ty)
                up = up32.to(c_ptr.dtype.element_ty)
                _store_swiglu_tile(
                    gate,
                    up,
                    c_ptr,
                    act_ptr,
                    c_desc,
                    act_desc,
                    r0,
                    r_end,
                    n0,
                    inter,
                    stride_c,
                    stride_act,
                    STORE_TMA,
                    BLOCK_M,
                    HALF,
                )
            else:
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
                        gate,
                        up,
                        c_ptr,
                        act_ptr,
                        c_desc,
                        act_desc,
                        r0,
                        r_end,
                        n0,
                        inter,
                        stride_c,
                        stride_act,
                        STORE_TMA,
                        BLOCK_M,
                        HALF,
                    )
                else:
                    _store_tile(
                        acc.to(c_ptr.dtype.element_ty),
                        c_ptr,
                        c_desc,
                        r0,
                        r_end,
                        n0,
                        N,
                        stride_c,
                        STORE_TMA,
                        BLOCK_M,
                        BLOCK_N,
                    )


def grouped_gemm(
    a: Tensor,
    b_GNK: Tensor,
    out: Tensor,
    plan: RoutingPlan,
    *,
    a_mode: int,
    b_kn: bool,
    config: dict,
    num_sms: int,
    a_rows: Tensor | None = None,
    act: Tensor | None = None,
) -> None:
    """Launch :func:`_grouped_gemm_kernel` writing ``out`` (rows of the plan's tiles only).

    ``b_GNK`` is ``[G, N, K]`` (``b_kn=False``) or ``[G, K, N]`` (``b_kn=True``), contiguous.
    ``a`` is ``[R, K]`` expert-sorted (``a_mode=0``) or ``[T, K]`` gathered through ``a_rows`` (``a_mode=1``).
    ``act [R, N/2]`` (GEMM1 only, ``b_kn=False``): also write ``silu(out[:, :N/2]) * out[:, N/2:]`` there.

    ``config`` holds the tile shape (``BLOCK_M/N/K``, ``GROUP_M``, ``num_warps``, ``num_stages``) and the
    kernel's variant knobs, all off by default: ``STORE_TMA`` (0 pointer stores, 1 TMA stores of full
    tiles through host descriptors, 2 TMA stores through per-tile device descriptors bounded at the
    segment end, 3 branch-free host-descriptor TMA stores with each expert's ragged last tile shifted
    back to end at the segment end, pointer stores only for experts of fewer than BLOCK_M rows), ``SPLIT_GATE_UP`` (SwiGLU epilogue with ``a_mode=1``: gate and up as two
    accumulators and two dots), ``FLATTEN`` (default on: the persistent loop fused with the K loop, so the next tile's loads start during this one's epilogue).
    """
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    store_tma = int(config.get("STORE_TMA", 0))
    split = bool(config.get("SPLIT_GATE_UP", False)) and act is not None
    if bm != plan.block_m:
        raise ValueError(f"BLOCK_M={bm} must equal the plan's block_m={plan.block_m}")
    if store_tma not in (0, 1, 2, 3):
        raise ValueError(f"STORE_TMA must be 0, 1, 2 or 3, got {store_tma}")
    if split and a_mode != 1:
        raise ValueError("SPLIT_GATE_UP reads A through row pointers: it needs a_mode=1")
    c_desc = act_desc = None
    if act is not None:
        if b_kn:
            raise ValueError("the SwiGLU epilogue (act given) needs b_kn=False: B is W1 [G, 2I, K]")
        G, N, K = b_GNK.shape
        if N % 2 or tuple(act.shape) != (out.shape[0], N // 2):
            raise ValueError(
                f"act must be [R={out.shape[0]}, {N // 2}] for B [G, {N}, K], got {tuple(act.shape)}"
            )
        half = bn // 2
        b_desc = TensorDescriptor.from_tensor(b_GNK.view(G, 2, N // 2, K), [1, 1 if split else 2, half, bk])
        num_n = triton.cdiv(N // 2, half)
        if store_tma in (1, 3):  # h as [R, 2, I]: a box clips at I, never spills gate columns into up's
            c_desc = TensorDescriptor(
                out, [out.shape[0], 2, N // 2], [out.stride(0), N // 2, 1], [bm, 1, half]
            )
            act_desc = TensorDescriptor.from_tensor(act, [bm, half])
    elif b_kn:
        K, N = b_GNK.shape[1], b_GNK.shape[2]
        b_desc = TensorDescriptor.from_tensor(b_GNK, [1, bk, bn])
    else:
        N, K = b_GNK.shape[1], b_GNK.shape[2]
        b_desc = TensorDescriptor.from_tensor(b_GNK, [1, bn, bk])
    if act is None:
        num_n = triton.cdiv(N, bn)
        if store_tma in (1, 3):
            c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    if store_tma == 2 and out.is_cuda:
        triton.set_allocator(_alloc_scratch)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk]) if a_mode == 0 else None
    grid_size = min(num_sms, plan.max_tiles * num_n)
    # STORE_TMA=3: a second, unflattened launch writes the tiles of experts with fewer than BLOCK_M rows
    # (the first computes them too, but its TMA boxes for them lie out of bounds: nothing written)
    launches = [(store_tma, bool(config.get("FLATTEN", True)), False)]
    if store_tma == 3:
        launches.append((0, False, True))
    for launch_store_tma, flatten, small_only in launches:
        tma = launch_store_tma in (1, 3)
        _grouped_gemm_kernel[(grid_size,)](
            a,
            a_desc,
            a_rows,
            b_desc,
            out,
            act,
            c_desc if tma else None,
            act_desc if tma else None,
            plan.tiles_X3,
            plan.num_tiles_1,
            N,
            K,
            a.stride(0),
            out.stride(0),
            act.stride(0) if act is not None else 0,
            grid_size,
            A_MODE=a_mode,
            B_KN=b_kn,
            SWIGLU=act is not None,
            SPLIT_GATE_UP=split,
            STORE_TMA=launch_store_tma,
            FLATTEN=flatten,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            GROUP_M=config.get("GROUP_M", 8),
            SMALL_ONLY=small_only,
            num_warps=config.get("num_warps", 8),
            num_stages=config.get("num_stages", 3),
        )
