"""The fused multi-GPU expert path: :class:`~megamoe.backends.base.ExpertBackend` over symmetric memory.

Legend: T tokens, H hidden, I intermediate, E experts, G local experts, K top-k, P pool rows (the
static row count of every per-row tensor on the expert side; rows past ``expert_start[G]`` are padding).

Each op starts with :func:`~.launch.begin_op` (epoch + barrier), then (push mode; in pull mode,
``MEGAMOE_SYMM_DISPATCH=pull``, each rank stages its rows before the barrier and the destination's
comm programs read them; in broadcast mode, the default at EP = 2, every op that moves rows copies
x or dy whole to every peer with the copy engines instead and the GEMM tiles gather their rows from
those copies; in backward a 4-warp kernel beside the dgrad fills the pool from them for the wgrad,
:func:`~.launch.dispatch_mode`)::

    stage 1 fwd   [exchange counts] -> layout -> push x rows + weights | GEMM1 tiles (own rows first,
                  they wait for nothing) wait per expert -> h
    stage 2 fwd   SwiGLU -> GEMM2 * weight, rows pushed to their source's combine slots -> wait -> sum over K
    stage 2 bwd   push dy rows | GEMM2-dgrad tiles wait per expert -> SwiGLU bwd -> dW2 on the pool
    stage 1 bwd   push x rows again (dW1 recompute) | GEMM1-dgrad rows + d(weight) pushed to sources
                  -> wait -> dx = sum over K; wait for the pool -> dW1 on the pool

The forward never keeps a dispatched ``x``: backward pushes it again into the pool while the dgrad
GEMM runs. Nothing here reads a device value on the host (debug mode excepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends.symm import launch
from megamoe.backends.symm.layout import SymmLayout, build_layout
from megamoe.backends.symm.workspace import COUNTER_COMBINE, COUNTER_POOL, SymmWorkspace, get_workspace
from megamoe.backends.triton.combine import combine
from megamoe.backends.triton.configs import block_m, num_programs, wgrad_config
from megamoe.backends.triton.routing import RoutingPlan, build_routing_plan
from megamoe.backends.triton.side_gather import GEMM_REGISTER_CAP
from megamoe.backends.triton.swiglu import swiglu_backward, swiglu_forward
from megamoe.backends.triton.wgrad import grouped_wgrad
from megamoe.settings import SymmSettings


@dataclass(slots=True)
class SymmPlan:
    """The send-side sort of one forward; stage 1 adds the workspace and the exchanged layout."""

    group: dist.ProcessGroup
    num_experts: int
    send: RoutingPlan
    """this rank's slots sorted by global expert: send positions, their tokens and slots."""
    ws: SymmWorkspace | None = None
    layout: SymmLayout | None = None
    recv: RoutingPlan | None = None
    """the pool rows as a routing plan over the local experts (for the shared Triton kernels)."""


def recv_plan(ws: SymmWorkspace, layout: SymmLayout, block_m: int) -> RoutingPlan:
    """The pool rows as a routing plan over the local experts (what the shared Triton kernels take)."""
    return RoutingPlan(
        num_tokens=ws.pool_rows,
        topk=1,
        num_experts=ws.num_local_experts,
        block_m=block_m,
        row_slot_R=layout.row_pos_R,
        row_token_R=layout.row_pos_R,
        slot_row_S=layout.row_pos_R,
        expert_start_G1=layout.expert_start_G1,
        tiles_X3=layout.tiles_X3,
        num_tiles_1=layout.num_tiles_1,
    )


def _counts(send: RoutingPlan) -> Tensor:
    start = send.expert_start_G1
    return (start[1:] - start[:-1]).contiguous()


def rows_to_move(plan: SymmPlan, src_TH: Tensor, weights_TK: Tensor | None = None) -> launch.Dispatch:
    s, lay = plan.send, plan.layout
    return launch.Dispatch(
        src_TH=src_TH,
        send_token_S=s.row_token_R,
        send_start_E1=s.expert_start_G1,
        send_dest_row_E=lay.send_dest_row_E,
        seg_start_GW=lay.seg_start_GW,
        seg_len_GW=lay.seg_len_GW,
        seg_pos_GW=lay.seg_pos_GW,
        send_slot_S=s.row_slot_R if weights_TK is not None else None,
        weights_TK=weights_TK,
        pull=plan.ws.dispatch == "pull",
    )


def begin(plan: SymmPlan, dispatch: launch.Dispatch | None = None) -> None:
    """Start an op that is not stage 1's forward (epoch + barrier); in pull mode first stage the rows peers will read."""
    if dispatch is not None and dispatch.pull:
        launch.stage_for_pull(plan.ws, dispatch.src_TH, dispatch.send_token_S)
    launch.begin_op(plan.ws)


class SymmBackend:
    """Token exchange fused into the grouped GEMMs over symmetric memory (one node, EP >= 2).

    ``settings`` size and configure the group's workspace when this backend's first op allocates it;
    the ops after that run with the workspace's own.
    """

    name = "triton_symm"

    def __init__(self, settings: SymmSettings) -> None:
        self.settings = settings

    def make_plan(
        self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None
    ) -> SymmPlan:
        if group is None:
            raise ValueError("the symmetric-memory path needs an EP process group")
        send = build_routing_plan(topk_idx_TK, num_experts=num_experts, block_m=block_m(topk_idx_TK.device))
        return SymmPlan(group=group, num_experts=num_experts, send=send)

    def exchange(
        self, plan: SymmPlan, x_TH: Tensor, weights_TK: Tensor, rows_TH: Tensor | None = None
    ) -> None:
        """Stage 1's op start: the workspace, [pull: staging,] the count exchange with the barrier, the layout.
        ``rows_TH``: the rows that will move if not ``x_TH``'s (a narrower form of them, in its dtype)."""
        s = plan.send
        ws = get_workspace(
            plan.group,
            num_tokens=s.num_tokens,
            topk=s.topk,
            num_experts=plan.num_experts,
            hidden=x_TH.shape[1],
            dtype=x_TH.dtype,
            device=x_TH.device,
            settings=self.settings,
        )
        if ws.dispatch == "pull":
            rows = x_TH if rows_TH is None else rows_TH
            launch.stage_for_pull(ws, rows, s.row_token_R, s.row_values_R(weights_TK).float())
        launch.begin_op(ws, _counts(s))
        layout = build_layout(
            ws.view("counts"),  # both banks; the kernel reads this op's (epoch parity)
            rank=ws.rank,
            num_local_experts=ws.num_local_experts,
            pool_rows=ws.pool_rows,
            block_m=s.block_m,
            epoch_1=ws.state[:1],
        )
        ws.note_received(layout.received_rows_1)
        plan.ws, plan.layout, plan.recv = ws, layout, recv_plan(ws, layout, s.block_m)

    def broadcast_dgrad(self, plan: SymmPlan, src_TH: Tensor, *, gather_pool: bool, **gemm) -> None:
        """Broadcast mode's backward op after its barrier: copy ``src_TH`` (``dy`` or ``x``) to every
        peer (copy engines), launch the dgrad kernel ``gemm``, and, for the wgrad, fill the pool from
        the copies beside it (:func:`~.launch.gather_broadcast_rows`); joined before returning."""
        ws, s = plan.ws, plan.send
        launch.broadcast_rows(ws, src_TH, s.row_token_R)
        launch.fused_gemm(ws, max_registers=GEMM_REGISTER_CAP if gather_pool else None, **gemm)
        if gather_pool:
            launch.gather_broadcast_rows(ws, plan.layout, src_TH, s.row_token_R)
        launch.join_broadcast(ws)

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: SymmPlan
    ) -> tuple[Tensor, Tensor, None]:
        x, weights_TK = x_TH.contiguous(), topk_weights_TK.contiguous()
        self.exchange(plan, x, weights_TK)
        h, weights = self.dispatch_gemm1(plan, x, weights_TK, w1_G2IH)
        return h, weights, None  # no activation: stage 2 runs the SwiGLU pass

    def dispatch_gemm1(
        self, plan: SymmPlan, x: Tensor, weights_TK: Tensor, w1_G2IH: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Stage 1 forward once its barrier ran and its layout is known: rows moved | GEMM1 -> ``h``, and
        each pool row's routing weight. (The benchmark also times this alone on a reused plan, as the
        original's benchmark times its op on a reused handle.)"""
        ws, lay, s = plan.ws, plan.layout, plan.send
        h = x.new_empty(ws.pool_rows, w1_G2IH.shape[1])
        broadcast = ws.dispatch == "broadcast"
        send_weight_S = None  # broadcast mode: this rank's routing weights in send order, copied to peers
        if broadcast:
            send_weight_S = s.row_values_R(weights_TK).float()
            launch.broadcast_rows(ws, x, s.row_token_R, send_weight_S)
        launch.fused_gemm(
            ws,
            op="gemm1",
            a_RK=ws.view("pool"),
            b=w1_G2IH.contiguous(),
            b_kn=False,
            tiles_X3=lay.tiles_X3,
            num_tiles_1=lay.num_tiles_1,
            out_RN=h,
            push=None if broadcast else rows_to_move(plan, x, weights_TK),
            wait=True,
            local_rows=lay,
            broadcast=(x, s.row_token_R) if broadcast else None,
            name=f"stage1 fwd, {ws.dispatch}",
        )
        if broadcast:
            launch.join_broadcast(ws)
        weights = launch.pool_weights(ws, lay, send_weight_S, weights_TK.dtype)
        launch.check(ws)
        return h, weights

    def stage2_forward(
        self, h_R2I: Tensor, dispatch_weights_R: Tensor, w2_GHI: Tensor, plan: SymmPlan, act_RI: None = None
    ) -> Tensor:
        ws, lay, s = plan.ws, plan.layout, plan.send
        begin(plan)
        a = h_R2I.new_empty(h_R2I.shape[0], w2_GHI.shape[2])
        swiglu_forward(h_R2I, a, lay.expert_start_G1[-1:])
        launch.fused_gemm(
            ws,
            op="gemm2",
            a_RK=a,
            b=w2_GHI.contiguous(),
            b_kn=False,
            tiles_X3=lay.tiles_X3,
            num_tiles_1=lay.num_tiles_1,
            remote=launch.RemoteOut(lay.row_src_R, lay.row_pos_R, own_tiles_1=lay.num_local_tiles_1),
            row_scale_R=dispatch_weights_R.float().contiguous(),
            name="stage2 fwd",
        )
        y = h_R2I.new_empty(s.num_tokens, w2_GHI.shape[1])
        launch.wait_flags(ws, "combine_ready", COUNTER_COMBINE)
        combine(ws.view("combine"), s.slot_row_S, y, topk=s.topk, weights_R=None)
        launch.check(ws)
        return y

    def stage2_backward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: SymmPlan,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
        overwrite_h: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dh, need_dweights, need_dw2 = needs_grad
        ws, lay, s = plan.ws, plan.layout, plan.send
        dy = dy_TH.to(h_R2I.dtype).contiguous()
        inter = w2_GHI.shape[2]
        P = h_R2I.shape[0]
        dy_pool = ws.view("pool")
        da = h_R2I.new_empty(P, inter)
        w2 = w2_GHI.contiguous()
        gemm = dict(op="dgrad2", a_RK=dy_pool, b=w2, b_kn=True, tiles_X3=lay.tiles_X3,
                    num_tiles_1=lay.num_tiles_1, out_RN=da, wait=True, name=f"stage2 bwd, {ws.dispatch}")  # fmt: skip
        if ws.dispatch == "broadcast":
            begin(plan)
            # every rank copies dy whatever it needs (a peer may wait for it); the pool only for dW2
            self.broadcast_dgrad(
                plan, dy, gather_pool=need_dw2, local_rows=lay, broadcast=(dy, s.row_token_R), **gemm
            )
        else:
            dispatch = rows_to_move(plan, dy)
            begin(plan, dispatch)
            launch.fused_gemm(ws, push=dispatch, **gemm)
        dh = h_R2I.new_empty(P, 2 * inter)
        aw = h_R2I.new_empty(P, inter)
        d_weights = torch.empty(P, dtype=torch.float32, device=h_R2I.device)
        swiglu_backward(
            h_R2I, da, dispatch_weights_R.contiguous(), dh, aw, d_weights, lay.expert_start_G1[-1:]
        )
        dw2 = None
        if need_dw2:
            dw2 = torch.empty_like(w2)
            dev = h_R2I.device
            grouped_wgrad(dy_pool, aw, dw2, plan.recv, config=wgrad_config(dev), num_sms=num_programs(dev))
        launch.check(ws)
        return (
            dh if need_dh else None,
            d_weights.to(dispatch_weights_R.dtype) if need_dweights else None,
            dw2,
        )

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        plan: SymmPlan,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
        grad_h_is_scratch: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_dx, need_dweights, need_dw1 = needs_grad
        ws, lay, s = plan.ws, plan.layout, plan.send
        x = x_TH.contiguous()
        w1 = w1_G2IH.contiguous()
        # (the own-rows tiles are not spread here: at dgrad1's K = 2I the NVLink stores are half as dense
        # as GEMM2's, and spreading them measured 0.6-1.7 % slower on 2 x H200)
        remote = launch.RemoteOut(lay.row_src_R, lay.row_pos_R, grad_dispatch_weights_R.float().contiguous())
        gemm = dict(op="dgrad1", a_RK=grad_h_R2I.contiguous(), b=w1, b_kn=True, tiles_X3=lay.tiles_X3,
                    num_tiles_1=lay.num_tiles_1, remote=remote, name=f"stage1 bwd, {ws.dispatch}")  # fmt: skip
        broadcast = ws.dispatch == "broadcast"
        if broadcast:  # x again, for dW1: copied to every peer, the pool filled beside the dgrad
            begin(plan)
            self.broadcast_dgrad(plan, x, gather_pool=need_dw1, **gemm)
        else:  # x again, for dW1: pushed into the pools by the dgrad kernel's comm role
            dispatch = rows_to_move(plan, x)
            begin(plan, dispatch)
            launch.fused_gemm(ws, push=dispatch, **gemm)
        launch.wait_flags(ws, "combine_ready", COUNTER_COMBINE)
        dx = d_weights = dw1 = None
        scalars = ws.view("combine_scalar")
        if need_dx:
            dx = x.new_empty(x.shape)
            if need_dweights:  # carried to the slots by dx's combine
                d_weights = scalars.new_empty(s.slot_row_S.shape)
            to_slots = None if d_weights is None else (scalars, d_weights)
            combine(ws.view("combine"), s.slot_row_S, dx, topk=s.topk, weights_R=None, to_slots=to_slots)
        if need_dweights:
            d_slots = s.slot_values_TK(scalars) if d_weights is None else d_weights.view(s.num_tokens, s.topk)
            d_weights = d_slots.to(grad_dispatch_weights_R.dtype)
        if need_dw1:
            if not broadcast:  # (broadcast: the pool gather waited and was joined)
                launch.wait_flags(ws, "pool_ready", COUNTER_POOL)
            dw1 = torch.empty_like(w1)
            dev = x.device
            grouped_wgrad(
                grad_h_R2I.contiguous(),
                ws.view("pool"),
                dw1,
                plan.recv,
                config=wgrad_config(dev),
                num_sms=num_programs(dev),
            )
        launch.check(ws)
        return dx, d_weights, dw1
