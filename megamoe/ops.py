"""The expert path as autograd ops: ``dispatch_grouped_gemm -> SwiGLU -> grouped_gemm_combine``.

Legend: T local tokens, H hidden, I expert intermediate, E experts (all ranks), G = E / W local
experts, W EP ranks, K top-k, R rows routed to this rank's experts.

    y_t = sum_k w_tk * (silu(x_t W1g_e^T) * (x_t W1u_e^T)) W2_e^T,   e = topk_idx[t, k]

* :func:`dispatch_grouped_gemm` (stage 1): tokens to the ranks owning their experts, then
  ``h = x W1^T`` per expert. Returns ``h [R, 2I]``, the routing weight of each row
  ``dispatch_weights [R]`` and a :class:`MegaMoEHandle` for stage 2. A backend that computes
  ``act = silu(gate) * up`` in GEMM1's epilogue leaves it in the handle, tied to this ``h``.
* :func:`grouped_gemm_combine` (stage 2): SwiGLU (skipped when the handle's ``act`` belongs to the
  ``h`` passed in), ``W2``, rows back to their source rank, weighted sum over the K slots. The gradient
  of the routing weights rides ``dispatch_weights`` back through stage 1 (Primus-Turbo's split), so
  ``topk_weights`` gets its gradient.
* :func:`fused_mega_moe` is both stages.

Stage 1 saves only ``x`` and ``w1``: its backward dispatches ``x`` again for dW1 rather than keeping
the dispatched copy (K times the size of ``x``). ``topk_idx == -1`` marks a dropped slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends import ExpertBackend, get_backend
from megamoe.errors import InvalidConfigError, MegaMoEError, shape_error
from megamoe.settings import EPSettings


@dataclass(frozen=True, slots=True)
class MegaMoEHandle:
    """What stage 2 needs from stage 1: the backend and its routing plan, and the activation if stage 1
    computed one."""

    backend: ExpertBackend
    plan: Any
    num_tokens: int
    act: Tensor | None = None
    """``silu(gate) * up [R, I]`` from stage 1 (GEMM1's epilogue), or None: stage 2 runs SwiGLU."""
    act_of: tuple[Tensor, int] | None = None
    """The ``h`` that ``act`` was computed from and its version counter: stage 2 uses ``act`` only for
    that very tensor, unmodified (a new or in-place changed ``h`` gets a fresh SwiGLU). Under
    torch.compile only the identity is checked: dynamo cannot compare version counters."""
    dh_over_h: list[int] = field(default_factory=list)
    """Shared by the stages' backward nodes (eager only): the address of the ``h`` that stage 2's
    backward wrote ``dh`` over. Stage 1's backward then knows its ``grad_h`` is that buffer, which no one
    else holds."""

    def act_for(self, h: Tensor) -> Tensor | None:
        """The stage-1 activation if it belongs to ``h``, else None."""
        if self.act is None or self.act_of is None or h is not self.act_of[0]:
            return None
        if torch.compiler.is_compiling():
            return self.act
        return self.act if h._version == self.act_of[1] else None


def _ep_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _validate(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor | None, ep: int
) -> None:
    """Check shapes, dtypes and expert ids against the layer contract; raise naming the tensor."""
    if x.dim() != 2:
        raise shape_error("x", x.shape, "[T, H]")
    T, H = x.shape
    if not x.is_floating_point():
        raise InvalidConfigError("x.dtype", x.dtype, "must be a floating dtype")
    if w1.dim() != 3 or w1.shape[2] != H or w1.shape[1] % 2:
        raise shape_error("w1", w1.shape, f"[G, 2I, H={H}]", "rows 0:I are the gate, I:2I the up projection")
    G, two_i = w1.shape[0], w1.shape[1]
    if w2 is not None and tuple(w2.shape) != (G, H, two_i // 2):
        raise shape_error("w2", w2.shape, f"[G={G}, H={H}, I={two_i // 2}] to match w1 {tuple(w1.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != T:
        raise shape_error("topk_idx", topk_idx.shape, f"[T={T}, K]")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise InvalidConfigError("topk_idx.dtype", topk_idx.dtype, "must be int32 or int64")
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise shape_error("topk_weights", topk_weights.shape, f"{list(topk_idx.shape)} like topk_idx")
    for name, t in (("w1", w1), ("w2", w2)):
        if t is not None and t.dtype != x.dtype:
            raise InvalidConfigError(f"{name}.dtype", t.dtype, f"must equal x.dtype={x.dtype}")
    devices = {t.device for t in (x, topk_idx, topk_weights, w1, w2) if t is not None}
    if len(devices) > 1:
        raise InvalidConfigError("device", sorted(map(str, devices)), "all inputs must be on one device")
    num_experts = G * ep
    if x.device.type == "cpu" and topk_idx.numel() and not torch.compiler.is_compiling():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            raise InvalidConfigError(
                "topk_idx",
                f"values in [{lo}, {hi}]",
                f"expert ids must be in [0, E={num_experts}) or -1 for a dropped slot (E = G={G} x EP={ep})",
            )


def _assert_expert_ids(topk_idx: Tensor, num_experts: int) -> None:
    """The check of the expert ids where :func:`_validate` cannot read them on the host (on GPUs, under
    torch.compile), asynchronous: for backends whose plan does not check them itself."""
    on_host = topk_idx.device.type == "cpu" and not torch.compiler.is_compiling()
    if topk_idx.numel() and not on_host:
        torch._assert_async(
            ((topk_idx >= -1) & (topk_idx < num_experts)).all(),
            f"topk_idx: expert ids must be in [0, {num_experts}) or -1",
        )


def _agree_on_errors(
    error: MegaMoEError | None, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Every EP rank raises if any rank's input is bad, instead of the good ranks hanging in a collective.

    Only for CPU process groups in eager mode: on GPUs the flag exchange would be a host sync in every
    forward, and shape errors there are raised before any collective on every rank alike; under
    torch.compile the checks run while tracing, as on GPUs.
    """
    if _ep_size(group) > 1 and device.type == "cpu" and not torch.compiler.is_compiling():
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if error is None and int(flag.item()):
            raise InvalidConfigError(
                "group", "peer", "another EP rank passed invalid MegaMoE inputs (see its error)"
            )
    if error is not None:
        raise error


class _DispatchGroupedGemm(torch.autograd.Function):
    """``(h, dispatch_weights, act, *state)``; ``act`` is empty when the backend gave none, never
    differentiable; ``state``: the tensors a backend's plan gains in stage 1 (see :func:`_with_state`)."""

    @staticmethod
    def forward(ctx, x, topk_weights, w1, handle: MegaMoEHandle):
        h, dispatch_weights, act, *state = handle.backend.stage1_forward(x, topk_weights, w1, handle.plan)
        if act is None:
            act = h.new_empty(0)
        ctx.mark_non_differentiable(act, *state)
        # no zero-filled gradients for act and state (an [R, I] memset every backward); the backward
        # makes the zeros of h or dispatch_weights itself where no gradient reached them
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w1, *state)
        ctx.handle = handle
        ctx.zero_grads = ((h.shape, h.dtype), (dispatch_weights.shape, dispatch_weights.dtype))
        return h, dispatch_weights, act, *state

    @staticmethod
    def backward(ctx, grad_h, grad_dispatch_weights, grad_act, *grad_state):
        x, w1, *state = ctx.saved_tensors
        handle = _with_state(ctx.handle, state)
        needs = tuple(ctx.needs_input_grad[:3])
        (h_shape, h_dtype), (w_shape, w_dtype) = ctx.zero_grads
        grad_h = x.new_zeros(h_shape, dtype=h_dtype) if grad_h is None else grad_h.contiguous()
        if grad_dispatch_weights is None:
            grad_dispatch_weights = x.new_zeros(w_shape, dtype=w_dtype)
        dx, d_topk_weights, dw1 = handle.backend.stage1_backward(
            x, w1, handle.plan, grad_h, grad_dispatch_weights.contiguous(), needs,
            grad_h_is_scratch=_is_dh_written_over_h(grad_h, handle.dh_over_h),
        )  # fmt: skip
        return dx, d_topk_weights, dw1, None


def _is_dh_written_over_h(grad_h: Tensor, dh_over_h: list[int]) -> bool:
    """True when ``grad_h`` is the ``dh`` that stage 2 wrote over a private ``h`` (:class:`_GroupedGemmCombine`'s
    ``h_is_private``): no one else holds or reads it, so stage 1 may use its bytes once it has read them."""
    return grad_h.numel() > 0 and grad_h.data_ptr() in dh_over_h and _graph_freed_after_this_backward()


def _with_state(handle: MegaMoEHandle, state) -> MegaMoEHandle:
    """The handle whose plan holds what stage 1 returned after ``act``: a backend whose plan is complete
    only after stage 1 (the symmetric-memory EP path: its layout comes from stage 1's count exchange)
    returns it as tensors, and its ``with_stage1_state`` folds them in. Nothing is mutated, so
    torch.compile sees plain dataflow."""
    if not state:
        return handle
    return replace(handle, plan=handle.backend.with_stage1_state(handle.plan, tuple(state)))


class _GroupedGemmCombine(torch.autograd.Function):
    """``y`` from ``h`` (or from ``act``, stage 1's ``swiglu(h)``, when not empty); saves ``h`` only.

    ``h_is_private``: no one but this node reads ``h`` after the forward, so once the graph is not
    retained the backward may write ``dh`` over it (``h`` is dead by then; its buffer would otherwise
    stay alive beside ``dh`` and dW2's operands until the node returns)."""

    @staticmethod
    def forward(ctx, h, dispatch_weights, w2, handle: MegaMoEHandle, act=None, h_is_private=False):
        act = act if act is not None and act.numel() else None
        y = handle.backend.stage2_forward(h, dispatch_weights, w2, handle.plan, act)
        ctx.save_for_backward(h, dispatch_weights, w2)
        ctx.handle = handle
        ctx.h_is_private = h_is_private
        return y

    @staticmethod
    def backward(ctx, dy):
        h, dispatch_weights, w2 = ctx.saved_tensors
        handle: MegaMoEHandle = ctx.handle
        needs = tuple(ctx.needs_input_grad[:3])
        overwrite_h = ctx.h_is_private and _graph_freed_after_this_backward()
        dh, d_dispatch_weights, dw2 = handle.backend.stage2_backward(
            h, dispatch_weights, w2, handle.plan, dy.contiguous(), needs, overwrite_h=overwrite_h
        )
        if overwrite_h and dh is not None and dh.numel() and dh.data_ptr() == h.data_ptr():
            handle.dh_over_h.append(dh.data_ptr())  # stage 1's grad_h: its bytes are free once read
        return dh, d_dispatch_weights, dw2, None, None, None


def _graph_freed_after_this_backward() -> bool:
    """True when autograd frees the saved tensors once this backward returns (no ``retain_graph``, no
    ``create_graph``), in eager mode: then a saved input no one else reads is dead inside the backward."""
    if torch.compiler.is_compiling():
        return False
    return not torch._C._autograd._get_current_graph_task_keep_graph()


def _select_backend(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor | None,
    group: dist.ProcessGroup | None,
    backend: str,
    precision: str,
    settings: EPSettings | None,
) -> ExpertBackend:
    error = None
    try:
        _validate(x, topk_idx, topk_weights, w1, w2, _ep_size(group))
    except MegaMoEError as e:
        error = e
    _agree_on_errors(error, group, x.device)
    impl = get_backend(
        backend,
        device=x.device,
        dtype=x.dtype,
        precision=precision,
        ep_size=_ep_size(group),
        settings=settings,
    )
    if not impl.checks_expert_ids:
        _assert_expert_ids(topk_idx, w1.shape[0] * _ep_size(group))
    if impl.native_autograd:
        impl.check(x, topk_idx, w1, w2, group)
    return impl


def _make_handle(impl: ExpertBackend, x: Tensor, topk_idx: Tensor, w1: Tensor, group) -> MegaMoEHandle:
    plan = impl.make_plan(topk_idx, num_experts=w1.shape[0] * _ep_size(group), group=group)
    return MegaMoEHandle(impl, plan, x.shape[0])


def dispatch_grouped_gemm(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str = "auto",
    precision: str = "bf16",
    settings: EPSettings | None = None,
) -> tuple[Tensor, Tensor, MegaMoEHandle]:
    """Stage 1: dispatch + GEMM1. Returns ``(h [R, 2I] pre-SwiGLU, dispatch_weights [R], handle)``.

    ``settings``: how tokens move at EP > 1 (default :meth:`EPSettings.from_env`)."""
    impl = _select_backend(x, topk_idx, topk_weights, w1, None, group, backend, precision, settings)
    if impl.native_autograd:
        h, dispatch_weights, plan = impl.stage1(x, topk_idx, topk_weights, w1, group)
        return h, dispatch_weights, MegaMoEHandle(impl, plan, x.shape[0])
    handle = _make_handle(impl, x, topk_idx, w1, group)
    h, dispatch_weights, act, *state = _DispatchGroupedGemm.apply(x, topk_weights, w1, handle)
    handle = _with_state(handle, state)
    if act.numel():
        version = 0 if torch.compiler.is_compiling() else h._version
        handle = replace(handle, act=act, act_of=(h, version))
    return h, dispatch_weights, handle


def grouped_gemm_combine(
    h: Tensor, dispatch_weights: Tensor, handle: MegaMoEHandle, w2: Tensor, *, h_is_private: bool = False
) -> Tensor:
    """Stage 2: SwiGLU + GEMM2 + combine + weighted top-k reduce. Returns ``y [T, H]``.

    The SwiGLU is skipped when ``handle`` carries stage 1's activation of this very ``h`` (unmodified).
    ``h_is_private=True`` promises that nothing reads ``h`` after this call (the layer's own ``h``): the
    backward then writes ``dh`` over ``h``'s memory when the graph is not retained, one ``[R, 2I]``
    buffer less at the backward's peak.
    """
    if h.dim() != 2 or w2.dim() != 3 or h.shape[1] != 2 * w2.shape[2]:
        raise shape_error("h", h.shape, f"[R, 2I] matching w2 {tuple(w2.shape)} = [G, H, I]")
    if w2.dtype != h.dtype:
        raise InvalidConfigError("w2.dtype", w2.dtype, f"must equal the activations' dtype {h.dtype}")
    if handle.backend.native_autograd:
        return handle.backend.stage2(h, dispatch_weights, handle.plan, w2, handle.num_tokens)
    act = handle.act_for(h)
    # the backward keeps the handle: without act (freed after the forward) and without a second ref to h
    bare = handle if handle.act is None else replace(handle, act=None, act_of=None)
    act = h.new_empty(0) if act is None else act
    return _GroupedGemmCombine.apply(h, dispatch_weights, w2, bare, act, h_is_private)


def fused_mega_moe(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str = "auto",
    precision: str = "bf16",
    settings: EPSettings | None = None,
) -> Tensor:
    """The whole expert path: ``y [T, H]`` for ``x [T, H]`` routed by ``topk_idx``/``topk_weights [T, K]``.

    ``w1 [G, 2I, H]`` (gate rows then up rows), ``w2 [G, H, I]``; global expert ``e`` lives on EP rank
    ``e // G`` of ``group`` (None = one rank). Differentiable in ``x``, ``topk_weights``, ``w1``, ``w2``.
    ``precision`` is the expert GEMMs' number format: ``"bf16"`` computes in the inputs' dtype,
    ``"mxfp8"`` in MX blocks (E4M3 data, one E8M0 scale per 32; :mod:`megamoe.quant.mx`), ``"fp8"``
    in DeepSeek-V3's blockwise FP8 (E4M3, float32 scales per 1x128 tile and 128x128 weight block;
    :mod:`megamoe.quant.fp8`), while the parameters stay in their dtype. The handle carries it to :func:`grouped_gemm_combine`.
    ``settings``: how tokens move at EP > 1 (:class:`~megamoe.settings.EPSettings`; default
    :meth:`~megamoe.settings.EPSettings.from_env`, the ``MEGAMOE_EP_TRANSPORT``/``MEGAMOE_SYMM_*`` variables).
    """
    impl = _select_backend(x, topk_idx, topk_weights, w1, w2, group, backend, precision, settings)
    if impl.native_autograd:
        return impl.fused(x, topk_idx, topk_weights, w1, w2, group)
    handle = _make_handle(impl, x, topk_idx, w1, group)
    h, dispatch_weights, act, *state = _DispatchGroupedGemm.apply(x, topk_weights, w1, handle)
    return _GroupedGemmCombine.apply(h, dispatch_weights, w2, _with_state(handle, state), act, True)
