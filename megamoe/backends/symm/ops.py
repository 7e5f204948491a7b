"""The four fused EP steps as ``torch.library`` custom ops: one opaque node each for torch.compile
(eager calls skip the op's dispatch, :mod:`megamoe.backends.opaque`).

Legend: T tokens, H hidden, I intermediate, E experts, G local experts, K top-k, W EP ranks, P pool rows.

Dynamo never traces the steps themselves: their launches carry raw peer addresses, a side stream and
its events. Between the steps the plan travels as tensors (:data:`STATE_FIELDS`: the send side's
routing tables and the layout of stage 1's count exchange), so no step mutates an object that
torch.compile would have to track, and the workspace is found again by its key. Every output has a
static shape; the fake implementations need the workspace's pool rows P before the first step runs,
from the workspace itself or from the settings' ``max_tokens`` (:func:`~.workspace.pool_rows`). Stage 1
takes the :class:`~megamoe.settings.SymmSettings` as text (custom ops take no objects); the later steps
run with the workspace's.

Stage 1's op does the routing sort, the count exchange, the layout and dispatch + GEMM1, as
:class:`~.backend.SymmBackend` does eagerly: the layout needs the exchanged counts, and pull mode stages
``x`` before that exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends.base import StagedBackend
from megamoe.backends.opaque import opaque_op
from megamoe.backends.symm.backend import SymmBackend, SymmPlan, recv_plan
from megamoe.backends.symm.layout import SymmLayout
from megamoe.backends.symm.workspace import WorkspaceKey, find_workspace, pool_rows
from megamoe.backends.triton.configs import block_m
from megamoe.backends.triton.routing import RoutingPlan, tile_table_rows
from megamoe.settings import SymmSettings

SEND_FIELDS = ("row_slot_R", "row_token_R", "slot_row_S", "expert_start_G1", "tiles_X3", "num_tiles_1")
LAYOUT_FIELDS = tuple(SymmLayout.__dataclass_fields__)
STATE_FIELDS = SEND_FIELDS + LAYOUT_FIELDS
"""the plan's tensors, in the order the ops take and return them"""


@lru_cache(maxsize=16)
def backend_for(settings: SymmSettings) -> SymmBackend:
    """The eager steps with ``settings`` (one instance per settings)."""
    return SymmBackend(settings)


def _backend(settings: str) -> SymmBackend:
    return backend_for(SymmSettings.from_json(settings))


def symm_backend(state: SymmState) -> SymmBackend:
    """The eager steps with ``state``'s settings."""
    return _backend(state.settings)


@dataclass(frozen=True, slots=True)
class SymmState:
    """What the autograd functions carry between the steps: the EP group by name, the routing, the
    settings (:meth:`SymmSettings.to_json`), and (after stage 1) the plan's tensors in
    :data:`STATE_FIELDS` order."""

    group_name: str
    num_experts: int
    topk_idx_TK: Tensor
    settings: str
    state: tuple[Tensor, ...] = ()

    def with_state(self, state: tuple[Tensor, ...]) -> SymmState:
        return replace(self, state=tuple(state))


class SymmStatePlans(StagedBackend):
    """The plans of the backends that run over symmetric memory (bf16 fused, MXFP8): a
    :class:`SymmState` carrying ``settings``, completed by the tensors stage 1 returns."""

    def __init__(self, settings: SymmSettings) -> None:
        self.settings = settings.to_json()

    def make_plan(
        self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None
    ) -> SymmState:
        if group is None:
            raise ValueError("the symmetric-memory path needs an EP process group")
        return SymmState(group.group_name, num_experts, topk_idx_TK, self.settings)

    def with_stage1_state(self, plan: SymmState, state: tuple[Tensor, ...]) -> SymmState:
        return plan.with_state(state)


def _group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


def _plan(
    state: list[Tensor], group_name: str, num_experts: int, num_tokens: int, topk: int, x_like: Tensor
) -> SymmPlan:
    """The eager plan from the ops' state (``x_like``: ``[*, H]`` in the activations' dtype, which with
    the rest names the workspace)."""
    send = RoutingPlan(num_tokens, topk, num_experts, block_m(x_like.device), *state[: len(SEND_FIELDS)])
    layout = SymmLayout(*state[len(SEND_FIELDS) :])
    key = WorkspaceKey(group_name, topk, num_experts, x_like.shape[1], x_like.dtype)
    ws = find_workspace(key)
    if ws is None:
        raise RuntimeError(f"no symmetric workspace for {key}: stage 1 allocates it before any later step")
    return SymmPlan(_group(group_name), num_experts, send, ws, layout, recv_plan(ws, layout, send.block_m))


def eager_plan(state: SymmState, x_like: Tensor) -> SymmPlan:
    """``state``'s plan for eager steps outside the custom ops: the send side alone before stage 1, the
    whole plan after it (``x_like`` as for :func:`_plan`)."""
    if not state.state:
        return _backend(state.settings).make_plan(
            state.topk_idx_TK, num_experts=state.num_experts, group=_group(state.group_name)
        )
    T, K = state.topk_idx_TK.shape
    return _plan(list(state.state), state.group_name, state.num_experts, T, K, x_like)


def _backend_of(plan: SymmPlan) -> SymmBackend:
    """The steps after stage 1 run with the settings the workspace was allocated with."""
    return backend_for(plan.ws.settings)


def state_of(plan: SymmPlan) -> list[Tensor]:
    return [getattr(plan.send, f) for f in SEND_FIELDS] + [getattr(plan.layout, f) for f in LAYOUT_FIELDS]


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """Custom ops return tensors: an output that was not asked for comes back with no elements."""
    return like.new_empty(0) if t is None else t


@opaque_op("megamoe_symm::stage1_forward")
def stage1_forward(
    x_TH: Tensor,
    topk_idx_TK: Tensor,
    topk_weights_TK: Tensor,
    w1_G2IH: Tensor,
    group_name: str,
    num_experts: int,
    settings: str,
) -> list[Tensor]:
    """``[h [P, 2I], dispatch_weights [P], *state]``: routing, count exchange, layout, dispatch + GEMM1."""
    backend = _backend(settings)
    plan = backend.make_plan(topk_idx_TK, num_experts=num_experts, group=_group(group_name))
    h, weights, _ = backend.stage1_forward(x_TH, topk_weights_TK, w1_G2IH, plan)
    return [h, weights, *state_of(plan)]


@stage1_forward.register_fake
def _(x_TH, topk_idx_TK, topk_weights_TK, w1_G2IH, group_name, num_experts, settings):
    (T, K), H = topk_idx_TK.shape, x_TH.shape[1]
    world = _group(group_name).size()
    G, S, bm = num_experts // world, T * K, block_m(x_TH.device)
    P = pool_rows(
        WorkspaceKey(group_name, K, num_experts, H, x_TH.dtype), world, SymmSettings.from_json(settings)
    )

    def i32(*shape: int) -> Tensor:
        return torch.empty(shape, dtype=torch.int32, device=x_TH.device)

    send = [i32(S), i32(S), i32(S), i32(num_experts + 1), i32(tile_table_rows(S, num_experts, bm), 3), i32(1)]
    layout = [i32(num_experts), i32(G + 1), i32(tile_table_rows(P, G, bm), 3), i32(1), i32(1), i32(P), i32(P)]
    layout += [i32(1), i32(G * world), i32(G * world), i32(G * world)]
    return [x_TH.new_empty(P, w1_G2IH.shape[1]), topk_weights_TK.new_empty(P), *send, *layout]


@opaque_op("megamoe_symm::stage2_forward")
def stage2_forward(
    h_P2I: Tensor,
    dispatch_weights_P: Tensor,
    w2_GHI: Tensor,
    state: list[Tensor],
    group_name: str,
    num_experts: int,
    num_tokens: int,
    topk: int,
) -> Tensor:
    """``y [T, H]``: SwiGLU, GEMM2 with the rows sent back to their sources, the sum over K."""
    hidden = h_P2I.new_empty(0, w2_GHI.shape[1])
    plan = _plan(state, group_name, num_experts, num_tokens, topk, hidden)
    return _backend_of(plan).stage2_forward(h_P2I, dispatch_weights_P, w2_GHI, plan)


@stage2_forward.register_fake
def _(h_P2I, dispatch_weights_P, w2_GHI, state, group_name, num_experts, num_tokens, topk):
    return h_P2I.new_empty(num_tokens, w2_GHI.shape[1])


@opaque_op("megamoe_symm::stage2_backward")
def stage2_backward(
    h_P2I: Tensor,
    dispatch_weights_P: Tensor,
    w2_GHI: Tensor,
    dy_TH: Tensor,
    state: list[Tensor],
    group_name: str,
    num_experts: int,
    topk: int,
    need_dh: bool,
    need_dweights: bool,
    need_dw2: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dh, d_dispatch_weights, dW2)``; the ones not asked for have no elements."""
    hidden = h_P2I.new_empty(0, dy_TH.shape[1])
    plan = _plan(state, group_name, num_experts, dy_TH.shape[0], topk, hidden)
    dh, d_weights, dw2 = _backend_of(plan).stage2_backward(
        h_P2I, dispatch_weights_P, w2_GHI, plan, dy_TH, (need_dh, need_dweights, need_dw2)
    )
    return _or_empty(dh, h_P2I), _or_empty(d_weights, dispatch_weights_P), _or_empty(dw2, w2_GHI)


@stage2_backward.register_fake
def _(
    h_P2I,
    dispatch_weights_P,
    w2_GHI,
    dy_TH,
    state,
    group_name,
    num_experts,
    topk,
    need_dh,
    need_dweights,
    need_dw2,
):
    return (
        torch.empty_like(h_P2I) if need_dh else h_P2I.new_empty(0),
        torch.empty_like(dispatch_weights_P) if need_dweights else dispatch_weights_P.new_empty(0),
        torch.empty_like(w2_GHI) if need_dw2 else w2_GHI.new_empty(0),
    )


@opaque_op("megamoe_symm::stage1_backward")
def stage1_backward(
    x_TH: Tensor,
    w1_G2IH: Tensor,
    grad_h_P2I: Tensor,
    grad_dispatch_weights_P: Tensor,
    state: list[Tensor],
    group_name: str,
    num_experts: int,
    topk: int,
    need_dx: bool,
    need_dweights: bool,
    need_dw1: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, d_topk_weights, dW1)``, the dispatched ``x`` recomputed; those not asked for have no elements."""
    plan = _plan(state, group_name, num_experts, x_TH.shape[0], topk, x_TH)
    dx, d_weights, dw1 = _backend_of(plan).stage1_backward(
        x_TH, w1_G2IH, plan, grad_h_P2I, grad_dispatch_weights_P, (need_dx, need_dweights, need_dw1)
    )
    return _or_empty(dx, x_TH), _or_empty(d_weights, grad_dispatch_weights_P), _or_empty(dw1, w1_G2IH)


@stage1_backward.register_fake
def _(
    x_TH,
    w1_G2IH,
    grad_h_P2I,
    grad_dispatch_weights_P,
    state,
    group_name,
    num_experts,
    topk,
    need_dx,
    need_dweights,
    need_dw1,
):
    T = x_TH.shape[0]
    return (
        torch.empty_like(x_TH) if need_dx else x_TH.new_empty(0),
        grad_dispatch_weights_P.new_empty(T, topk) if need_dweights else grad_dispatch_weights_P.new_empty(0),
        torch.empty_like(w1_G2IH) if need_dw1 else w1_G2IH.new_empty(0),
    )
