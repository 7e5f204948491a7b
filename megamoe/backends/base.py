"""The one small interface every expert backend implements (reference, triton, primus_turbo).

Legend: T local tokens, H hidden, I expert intermediate, G local experts, K top-k, R rows this rank
computes (the (token, k) pairs routed to its experts, from every EP rank, sorted by local expert).

The autograd functions in :mod:`megamoe.ops` own the graph; a backend only computes. The split is
Primus-Turbo's: stage 1 = dispatch + GEMM1 (``h = x W1^T``, pre-SwiGLU), stage 2 = SwiGLU + GEMM2 +
combine with the routing weights. The routing weight of each dispatched row travels with stage 1
(``dispatch_weights [R]``) so that its gradient flows back through stage 1's backward. A backend may
also compute the activation ``act = swiglu(h)`` in stage 1 (the Triton backend does, in GEMM1's
epilogue) and hand it over; stage 2 then skips its SwiGLU. ``h`` stays the differentiable output
(stage 2's backward needs it), ``act`` is a forward-only side channel that :mod:`megamoe.ops` passes
on only for the unmodified ``h`` it belongs to.

A backend's ``plan`` is opaque to :mod:`megamoe.ops`: it is built once per forward from ``topk_idx``
and handed back to every other call (forward and backward), so a backend can keep its routing tables,
all-to-all splits or device-side tile tables there. The plan must not hold the dispatched ``x``:
backward recomputes it (the contract says the forward keeps only the original ``x``). A plan that is
complete only after stage 1 (the symmetric-memory EP path learns its layout in stage 1's count
exchange) is never mutated: stage 1 returns the extra tensors after ``act`` and the backend's
``with_stage1_state(plan, state)`` gives the plan every later call gets, so torch.compile sees dataflow.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class ExpertBackend(Protocol):
    """Compute kernels of the two expert stages, forward and backward."""

    name: str
    native_autograd: bool
    """True for a backend that owns its autograd graph (:class:`NativeAutogradBackend`): the ops call
    its ``stage1``/``stage2``/``fused`` instead of the stage methods below."""
    checks_expert_ids: bool
    """True for a backend whose plan fails on expert ids outside ``[-1, E)`` itself (on the device, as
    part of building it); the ops check the others' ids with torch ops of their own."""

    def with_stage1_state(self, plan: Any, state: tuple[Tensor, ...]) -> Any:
        """The plan with the tensors stage 1 returned after ``act`` (most backends return none)."""
        ...

    def make_plan(self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None) -> Any:
        """Routing tables for one forward: which rows go where, per-expert counts, ..."""
        ...

    def stage1_forward(
        self, x_TH: Tensor, topk_weights_TK: Tensor, w1_G2IH: Tensor, plan: Any
    ) -> tuple[Tensor | None, ...]:
        """Dispatch + GEMM1: return ``h_R2I`` (pre-SwiGLU), ``dispatch_weights_R`` and ``act_RI``:
        ``swiglu(h_R2I)`` when the backend computed it alongside ``h`` (same bits), else None; then,
        only for a backend with ``with_stage1_state``, the tensors its plan gains in stage 1."""
        ...

    def stage1_backward(
        self,
        x_TH: Tensor,
        w1_G2IH: Tensor,
        plan: Any,
        grad_h_R2I: Tensor,
        grad_dispatch_weights_R: Tensor,
        needs_grad: tuple[bool, bool, bool],
        grad_h_is_scratch: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Return ``(dx_TH, d_topk_weights_TK, dw1_G2IH)``; recomputes the dispatched x for dW1.

        ``grad_h_is_scratch``: nothing reads ``grad_h_R2I`` after this call, so its bytes may hold
        temporaries once its last read is done; a backend may ignore it."""
        ...

    def stage2_forward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: Any,
        act_RI: Tensor | None = None,
    ) -> Tensor:
        """SwiGLU + GEMM2 + weighted combine back to the source ranks: return ``y_TH``.

        ``act_RI``, stage 1's ``swiglu(h_R2I)`` when it made one, replaces the SwiGLU step."""
        ...

    def stage2_backward(
        self,
        h_R2I: Tensor,
        dispatch_weights_R: Tensor,
        w2_GHI: Tensor,
        plan: Any,
        dy_TH: Tensor,
        needs_grad: tuple[bool, bool, bool],
        overwrite_h: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Return ``(dh_R2I, d_dispatch_weights_R, dw2_GHI)``.

        ``overwrite_h``: nothing reads ``h_R2I`` after this call, so ``dh`` may be written over it
        (one ``[R, 2I]`` buffer less at the backward's peak); a backend may ignore it."""
        ...


class NativeAutogradBackend(ExpertBackend, Protocol):
    """A backend whose kernels come with their own autograd (Primus-Turbo's)."""

    def check(self, x: Tensor, topk_idx: Tensor, w1: Tensor, w2: Tensor | None, group) -> None: ...

    def stage1(
        self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, group
    ) -> tuple[Tensor, Tensor, Any]: ...

    def stage2(
        self, h: Tensor, dispatch_weights: Tensor, plan: Any, w2: Tensor, num_tokens: int
    ) -> Tensor: ...

    def fused(
        self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, group
    ) -> Tensor: ...


class StagedBackend:
    """Defaults of :class:`ExpertBackend` for backends whose stages the ops' autograd functions drive."""

    native_autograd = False
    checks_expert_ids = False

    def with_stage1_state(self, plan: Any, state: tuple[Tensor, ...]) -> Any:
        return plan


class TransportBackend(StagedBackend):
    """A staged backend whose rows move through ``self.transport`` (one GPU, NCCL, ...): its plan checks
    expert ids where the transport's does."""

    transport: Any

    @property
    def checks_expert_ids(self) -> bool:
        return self.transport.checks_expert_ids


def swiglu(h_R2I: Tensor) -> Tensor:
    """``silu(gate) * up`` with gate = first half of the columns, up = second half (no clamp)."""
    gate, up = h_R2I.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu_backward(h_R2I: Tensor, grad_a_RI: Tensor) -> Tensor:
    """Gradient of :func:`swiglu` w.r.t. its input, computed in the input's precision or better."""
    gate, up = h_R2I.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = grad_a_RI * up * sig * (1 + gate * (1 - sig))
    d_up = grad_a_RI * silu
    return torch.cat([d_gate, d_up], dim=-1)
