"""The four expert-path steps as ``torch.library`` custom ops over the Triton kernels.

GEMM1 emits ``h`` (saved by stage 2 for the SwiGLU backward) and, from its epilogue, the activation
``act = silu(gate) * up``; stage 2 takes ``act`` and runs the SwiGLU pass itself only when it is empty.

Legend: T tokens, H hidden, I intermediate, G local experts, K top-k, R = T*K expert-sorted rows.

Custom ops make each step one opaque node for torch.compile (dynamo never traces a Triton launch or
its TMA descriptors; eager calls skip the op's dispatch, :mod:`megamoe.backends.opaque`) and keep
every shape static, so the steps also capture in a CUDA graph. The routing plan travels as its
tensors; the launch configuration is chosen from static shapes only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megamoe.backends.opaque import opaque_op
from megamoe.backends.triton.combine import combine
from megamoe.backends.triton.configs import column_chunks, gemm_config, num_programs, wgrad_config
from megamoe.backends.triton.grouped_gemm import grouped_gemm
from megamoe.backends.triton.routing import RoutingPlan, pick_rows
from megamoe.backends.triton.side_gather import RowGather
from megamoe.backends.triton.swiglu import swiglu_backward, swiglu_forward
from megamoe.backends.triton.wgrad import grouped_wgrad


def _plan(
    T: int,
    K: int,
    G: int,
    block_m: int,
    row_token_R: Tensor,
    slot_row_S: Tensor,
    expert_start_G1: Tensor,
    tiles_X3: Tensor,
    num_tiles_1: Tensor,
) -> RoutingPlan:
    return RoutingPlan(
        num_tokens=T,
        topk=K,
        num_experts=G,
        block_m=block_m,
        row_slot_R=row_token_R,  # not read through the plan (GEMM1 is handed the real one beside it)
        row_token_R=row_token_R,
        slot_row_S=slot_row_S,
        expert_start_G1=expert_start_G1,
        tiles_X3=tiles_X3,
        num_tiles_1=num_tiles_1,
    )


@opaque_op("megamoe_triton::gemm1_forward")
def gemm1_forward(
    x_TH: Tensor,
    w1_G2IH: Tensor,
    weights_S: Tensor,
    row_slot_R: Tensor,
    topk: int,
    block_m: int,
    row_token_R: Tensor,
    slot_row_S: Tensor,
    expert_start_G1: Tensor,
    tiles_X3: Tensor,
    num_tiles_1: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``h [R, 2I] = x[row_token] @ W1[expert]^T`` (dispatch fused as a row gather) and, from the same
    kernel, ``act [R, I] = silu(h[:, :I]) * h[:, I:]`` and each row's routing weight ``weights_S[row_slot]``
    ``[R]``; padding rows of all three are zero."""
    T, G, two_i = x_TH.shape[0], w1_G2IH.shape[0], w1_G2IH.shape[1]
    plan = _plan(T, topk, G, block_m, row_token_R, slot_row_S, expert_start_G1, tiles_X3, num_tiles_1)
    h = x_TH.new_empty(T * topk, two_i)
    act = x_TH.new_empty(T * topk, two_i // 2)
    if not act.numel():  # no rows (or no columns: nothing for the GEMM's programs to do)
        return h, act, pick_rows(weights_S, row_slot_R, expert_start_G1)
    weights_R = weights_S.new_empty(T * topk)
    grouped_gemm(
        x_TH,
        w1_G2IH,
        h,
        plan,
        a_mode=1,
        b_kn=False,
        config=gemm_config("gemm1", x_TH.device),
        num_sms=num_programs(x_TH.device),
        a_rows=row_token_R,
        act=act,
        row_values=(weights_S, row_slot_R, weights_R),
    )
    return h, act, weights_R


@gemm1_forward.register_fake
def _(
    x_TH,
    w1_G2IH,
    weights_S,
    row_slot_R,
    topk,
    block_m,
    row_token_R,
    slot_row_S,
    expert_start_G1,
    tiles_X3,
    num_tiles_1,
):
    R, two_i = x_TH.shape[0] * topk, w1_G2IH.shape[1]
    return x_TH.new_empty(R, two_i), x_TH.new_empty(R, two_i // 2), weights_S.new_empty(R)


@opaque_op("megamoe_triton::gemm2_combine_forward")
def gemm2_combine_forward(
    h_R2I: Tensor,
    act_RI: Tensor,
    dispatch_weights_R: Tensor,
    w2_GHI: Tensor,
    num_tokens: int,
    topk: int,
    block_m: int,
    row_token_R: Tensor,
    slot_row_S: Tensor,
    expert_start_G1: Tensor,
    tiles_X3: Tensor,
    num_tiles_1: Tensor,
) -> Tensor:
    """``y [T, H] = sum_k w * act @ W2^T``: GEMM2, weighted combine; ``act = silu(gate) * up`` from
    GEMM1's epilogue, or, when ``act_RI`` is empty (0 elements), from a SwiGLU pass over ``h``."""
    G, H, inter = w2_GHI.shape
    plan = _plan(
        num_tokens, topk, G, block_m, row_token_R, slot_row_S, expert_start_G1, tiles_X3, num_tiles_1
    )
    y = h_R2I.new_empty(num_tokens, H)
    R = h_R2I.shape[0]
    if R == 0:
        return y.zero_()
    a = act_RI
    if a.numel() == 0:
        a = h_R2I.new_empty(R, inter)
        swiglu_forward(h_R2I, a, expert_start_G1[-1:])
    o = h_R2I.new_empty(R, H)
    cfg = gemm_config("gemm2", h_R2I.device)
    grouped_gemm(a, w2_GHI, o, plan, a_mode=0, b_kn=False, config=cfg, num_sms=num_programs(h_R2I.device))
    combine(o, slot_row_S, y, topk=topk, weights_R=dispatch_weights_R)
    return y


@gemm2_combine_forward.register_fake
def _(
    h_R2I,
    act_RI,
    dispatch_weights_R,
    w2_GHI,
    num_tokens,
    topk,
    block_m,
    row_token_R,
    slot_row_S,
    expert_start_G1,
    tiles_X3,
    num_tiles_1,
):
    return h_R2I.new_empty(num_tokens, w2_GHI.shape[1])


@opaque_op("megamoe_triton::gemm2_backward")
def gemm2_backward(
    h_R2I: Tensor,
    dispatch_weights_R: Tensor,
    w2_GHI: Tensor,
    dy_TH: Tensor,
    need_dw2: bool,
    dh_over_h: bool,
    topk: int,
    block_m: int,
    row_token_R: Tensor,
    slot_row_S: Tensor,
    expert_start_G1: Tensor,
    tiles_X3: Tensor,
    num_tiles_1: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(dh [R, 2I], d_dispatch_weights [R], dW2 [G, H, I])`` (dW2 empty unless asked for).

    ``da = dy[row_token] W2`` by the grouped GEMM, ``dy`` rows gathered in its loads; one
    SwiGLU-backward pass gives ``dh``, ``w * a`` and the routing-weight gradient ``<da, a>``; then the
    K-grouped ``dW2 = dy_sorted^T (w * a)``, its TMA-fed ``dy_sorted`` gathered beside the dgrad.
    ``dh_over_h``: ``dh`` is written over ``h`` (the SwiGLU backward reads each element before writing
    it), so ``h`` is not alive beside the gathered ``dy`` and dW2; eager calls only, since the op itself
    declares no mutation.
    """
    G, _, inter = w2_GHI.shape
    T = dy_TH.shape[0]
    plan = _plan(T, topk, G, block_m, row_token_R, slot_row_S, expert_start_G1, tiles_X3, num_tiles_1)
    R = h_R2I.shape[0]
    dh = h_R2I if dh_over_h else h_R2I.new_empty(R, 2 * inter)
    d_weights = torch.empty(R, dtype=torch.float32, device=h_R2I.device)
    dw2 = w2_GHI.new_empty(0)
    if R == 0:
        return dh, d_weights.to(dispatch_weights_R.dtype), torch.zeros_like(w2_GHI) if need_dw2 else dw2
    dy_gather = RowGather(dy_TH, row_token_R) if need_dw2 else None
    da = h_R2I.new_empty(R, inter)
    cfg = gemm_config("dgrad2", h_R2I.device)
    grouped_gemm(
        dy_TH,
        w2_GHI,
        da,
        plan,
        a_mode=1,
        b_kn=True,
        config=cfg,
        num_sms=num_programs(h_R2I.device),
        a_rows=row_token_R,
    )
    if dy_gather is not None:
        dy_gather.start()  # dW2's operand, gathered while the dgrad runs
    aw = h_R2I.new_empty(R, inter)
    swiglu_backward(h_R2I, da, dispatch_weights_R, dh, aw, d_weights, expert_start_G1[-1:])
    del da
    if dy_gather is not None:
        dw2 = torch.empty_like(w2_GHI)  # allocated once da is free: less at the peak
        grouped_wgrad(
            dy_gather.rows(),
            aw,
            dw2,
            plan,
            config=wgrad_config(h_R2I.device),
            num_sms=num_programs(h_R2I.device),
        )
    return dh, d_weights.to(dispatch_weights_R.dtype), dw2


@gemm2_backward.register_fake
def _(
    h_R2I,
    dispatch_weights_R,
    w2_GHI,
    dy_TH,
    need_dw2,
    dh_over_h,
    topk,
    block_m,
    row_token_R,
    slot_row_S,
    expert_start_G1,
    tiles_X3,
    num_tiles_1,
):
    R, two_i = h_R2I.shape
    dw2 = w2_GHI.new_empty(w2_GHI.shape) if need_dw2 else w2_GHI.new_empty(0)
    return h_R2I.new_empty(R, two_i), dispatch_weights_R.new_empty(R), dw2


@opaque_op("megamoe_triton::gemm1_backward")
def gemm1_backward(
    x_TH: Tensor,
    w1_G2IH: Tensor,
    grad_h_R2I: Tensor,
    grad_weights_R: Tensor,
    need_dx: bool,
    need_dw1: bool,
    dweights_with_dx: bool,
    topk: int,
    block_m: int,
    row_token_R: Tensor,
    slot_row_S: Tensor,
    expert_start_G1: Tensor,
    tiles_X3: Tensor,
    num_tiles_1: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(dx [T, H], dW1 [G, 2I, H], d_weights [S])``: the dgrad ``dh @ W1`` reduced over the K
    slots, the K-grouped ``dW1 = dh^T x_sorted`` (the dispatch of ``x`` recomputed as transient gathers
    that run beside the GEMMs, :mod:`~megamoe.backends.triton.side_gather`), and, with
    ``dweights_with_dx`` (which needs ``need_dx``), the rows' ``grad_weights_R`` back at their slots (0
    for dropped ones), carried by ``dx``'s combine.

    ``x_sorted [R, H]`` is gathered and used in column chunks (:func:`~.configs.column_chunks`): the first beside
    the dgrad, each next one beside the wgrad of the one before, so at most two chunks are alive at a
    time, not all of it beside ``dx_rows`` and dW1. Each chunk's wgrad sums every element in the same
    row order as one wgrad over all columns would: the same bits."""
    T, H = x_TH.shape
    G = w1_G2IH.shape[0]
    plan = _plan(T, topk, G, block_m, row_token_R, slot_row_S, expert_start_G1, tiles_X3, num_tiles_1)
    R = grad_h_R2I.shape[0]
    dx = x_TH.new_empty(T, H) if need_dx else x_TH.new_empty(0)
    dw1 = w1_G2IH.new_empty(0)
    if dweights_with_dx and not need_dx:
        raise ValueError("dweights_with_dx: the weight gradient is carried by dx's combine; need_dx too")
    d_weights = grad_weights_R.new_empty(slot_row_S.shape[0] if dweights_with_dx else 0)
    if R == 0:  # every output is written by a kernel below; with no rows they are all zero
        return dx.zero_(), torch.zeros_like(w1_G2IH) if need_dw1 else dw1, d_weights.zero_()
    wgrad_cfg = wgrad_config(x_TH.device)
    chunks = column_chunks(R, H, x_TH.element_size(), wgrad_cfg.block_n) if need_dw1 else []
    x_gather = RowGather(x_TH[:, slice(*chunks[0])], row_token_R) if need_dw1 else None
    if need_dx:
        dx_rows = x_TH.new_empty(R, H)
        cfg = gemm_config("dgrad1", x_TH.device)
        grouped_gemm(
            grad_h_R2I,
            w1_G2IH,
            dx_rows,
            plan,
            a_mode=0,
            b_kn=True,
            config=cfg,
            num_sms=num_programs(x_TH.device),
        )
    if x_gather is not None:
        x_gather.start()  # dW1's operand (the dispatch recomputed), gathered while the dgrad runs
    if need_dx:
        to_slots = (grad_weights_R, d_weights) if dweights_with_dx else None
        combine(dx_rows, slot_row_S, dx, topk=topk, weights_R=None, to_slots=to_slots)
        del dx_rows
    if x_gather is not None:
        dw1 = torch.empty_like(w1_G2IH)  # allocated once dx_rows is free: less at the peak
        for i, columns in enumerate(chunks):
            x_rows = x_gather.rows()
            x_gather = RowGather(x_TH[:, slice(*chunks[i + 1])], row_token_R) if i + 1 < len(chunks) else None
            grouped_wgrad(
                grad_h_R2I,
                x_rows,
                dw1[:, :, slice(*columns)],
                plan,
                config=wgrad_cfg,
                num_sms=num_programs(x_TH.device),
            )
            if x_gather is not None:
                x_gather.start()  # the next chunk, gathered while this chunk's wgrad runs
            del x_rows
    return dx, dw1, d_weights


@gemm1_backward.register_fake
def _(
    x_TH,
    w1_G2IH,
    grad_h_R2I,
    grad_weights_R,
    need_dx,
    need_dw1,
    dweights_with_dx,
    topk,
    block_m,
    row_token_R,
    slot_row_S,
    expert_start_G1,
    tiles_X3,
    num_tiles_1,
):
    dx = x_TH.new_empty(x_TH.shape) if need_dx else x_TH.new_empty(0)
    dw1 = w1_G2IH.new_empty(w1_G2IH.shape) if need_dw1 else w1_G2IH.new_empty(0)
    return dx, dw1, grad_weights_R.new_empty(slot_row_S.shape[0] if dweights_with_dx else 0)
