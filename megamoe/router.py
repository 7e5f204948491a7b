"""The MoE router: scores, group-limited top-k, scaling, the load-balancing aux loss, forced balancing.

Semantics equal megatron-core's ``TopKRouter`` for the same settings (the parity tests in
``tests/megamoe/test_router.py`` compare against it), but the output is the compact form the expert
ops consume — ``topk_idx [T, K]`` and ``topk_weights [T, K]`` — instead of dense ``[T, E]`` maps.

Legend: T tokens, H hidden, E experts, K top-k, N groups.

* softmax: top-k on the logits, then softmax over the K values; with ``pre_softmax`` the softmax over
  all E comes first and the top-k values are used as they are.
* sigmoid: top-k on ``sigmoid(logits)``; the K values are normalised to sum to one when K > 1.
* group-limited top-k: experts split into N groups, each group scored by the sum of its best
  ``K / group_topk`` scores, the ``group_topk`` best groups kept, the top-k taken inside them.
* the aux loss is the switch-transformer loss ``E * coeff / (K * T^2) * sum_e P_e * f_e`` on full-row
  scores; it is returned to the caller *and* attached to ``topk_weights`` so its gradient flows when
  the weights are used, exactly as megatron-core does.
* forced balancing (benchmarks only): ``uniform`` replaces the logits by random normals (gradient
  passes straight through); ``even`` moves each token's k-th weight to expert ``(t*K + k) % E``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megamoe.errors import InvalidConfigError

ScoreFunction = Literal["softmax", "sigmoid"]
ForceBalance = Literal["even", "uniform"]
AuxLossAttach = Callable[[Tensor, Tensor], Tensor]


def check_force_load_balancing(value: object) -> None:
    """Raise unless ``value`` is None or a forced-balancing mode (``even``, ``uniform``)."""
    if value not in (None, "even", "uniform"):
        raise InvalidConfigError(
            "moe_router_force_load_balancing_type", value, "unknown", "Use 'even' or 'uniform'"
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class RouterConfig:
    """What a router computes; field names follow megatron-core's ``moe_router_*`` settings."""

    num_experts: int
    """E, the number of routed experts over all EP ranks."""
    topk: int
    """K, experts chosen per token."""
    score_function: ScoreFunction = "softmax"
    pre_softmax: bool = False
    """softmax over all experts before the top-k (megatron ``moe_router_pre_softmax``)."""
    num_groups: int | None = None
    """N expert groups for group-limited routing (DeepSeek-V3 node-limited routing)."""
    group_topk: int | None = None
    """groups kept per token; None disables group-limited routing."""
    topk_scaling_factor: float | None = None
    aux_loss_coeff: float = 0.0
    """coefficient of the standard (micro-batch) load-balancing loss; 0 disables it."""
    force_load_balancing: ForceBalance | None = None
    """benchmark-only forced balancing; None routes by the learned scores."""
    dtype: torch.dtype = torch.float32
    """dtype of the gating GEMM and the scores (megatron ``moe_router_dtype``)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise InvalidConfigError("num_moe_experts", self.num_experts, "must be >= 1")
        if not 1 <= self.topk <= self.num_experts:
            raise InvalidConfigError(
                "moe_router_topk",
                self.topk,
                f"must be in [1, num_experts={self.num_experts}]",
                f"Set moe_router_topk <= {self.num_experts}",
            )
        if self.score_function not in ("softmax", "sigmoid"):
            raise InvalidConfigError(
                "moe_router_score_function", self.score_function, "unknown", "Use 'softmax' or 'sigmoid'"
            )
        if self.score_function == "softmax" and self.topk == 1 and not self.pre_softmax:
            raise InvalidConfigError(
                "moe_router_topk",
                1,
                "softmax over one value is always 1, so the router would get no gradient",
                "Set moe_router_pre_softmax=true",
            )
        check_force_load_balancing(self.force_load_balancing)
        if self.group_topk:
            self._check_groups()

    def _check_groups(self) -> None:
        groups = self.num_groups or 0
        if groups < 1 or self.num_experts % groups:
            raise InvalidConfigError(
                "moe_router_num_groups",
                self.num_groups,
                f"must divide num_experts={self.num_experts} when moe_router_group_topk is set",
            )
        if not 1 <= self.group_topk <= groups:
            raise InvalidConfigError(
                "moe_router_group_topk", self.group_topk, f"must be in [1, num_groups={groups}]"
            )
        if self.topk % self.group_topk:
            raise InvalidConfigError(
                "moe_router_group_topk",
                self.group_topk,
                f"must divide moe_router_topk={self.topk} (each group is scored by its top-(K/group_topk))",
            )
        if self.topk > self.group_topk * (self.num_experts // groups):
            raise InvalidConfigError(
                "moe_router_topk",
                self.topk,
                f"exceeds the experts in {self.group_topk} kept groups of {self.num_experts // groups}",
            )


class RouterOutput(NamedTuple):
    topk_idx: Tensor
    """[T, K] int64 global expert ids."""
    topk_weights: Tensor
    """[T, K] routing weights (router dtype); the aux loss is attached to it."""
    aux_loss: Tensor | None
    """scalar load-balancing loss (already times its coefficient), or None when disabled."""


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``weights`` that gives ``aux_loss`` the gradient ``main_loss_backward_scale``.

    This is how the aux loss joins the backward pass without the caller adding it to the loss.
    Training loops that scale the loss (gradient accumulation) set the scale through
    :meth:`set_loss_scale`; megatron-core's schedules do the same for its own scaler, which the
    megatron adapter uses instead of this one.
    """

    main_loss_backward_scale: float = 1.0

    @staticmethod
    def forward(ctx, weights: Tensor, aux_loss: Tensor) -> Tensor:
        ctx.save_for_backward(aux_loss)
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad_weights: Tensor) -> tuple[Tensor, Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad_weights, torch.full_like(aux_loss, AuxLossScaler.main_loss_backward_scale)

    @staticmethod
    def set_loss_scale(scale: float) -> None:
        AuxLossScaler.main_loss_backward_scale = float(scale)


def attach_aux_loss(weights: Tensor, aux_loss: Tensor) -> Tensor:
    """Default aux-loss attachment (see :class:`AuxLossScaler`)."""
    return AuxLossScaler.apply(weights, aux_loss)


class _RandomLogits(torch.autograd.Function):
    """Random normal logits forward, gradient straight through (megatron's ``RandomSTE``)."""

    @staticmethod
    def forward(ctx, logits: Tensor) -> Tensor:
        return logits.clone().normal_()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def _group_limited_topk(scores_TE: Tensor, cfg: RouterConfig) -> tuple[Tensor, Tensor]:
    T, E = scores_TE.shape
    N = cfg.num_groups
    group_scores_TN = scores_TE.view(T, N, E // N).topk(cfg.topk // cfg.group_topk, dim=-1)[0].sum(-1)
    group_idx = group_scores_TN.topk(cfg.group_topk, dim=-1, sorted=False)[1]
    group_mask_TN = torch.zeros_like(group_scores_TN).scatter_(1, group_idx, 1.0)
    score_mask_TE = group_mask_TN.unsqueeze(-1).expand(T, N, E // N).reshape(T, E)
    masked = scores_TE.masked_fill(score_mask_TE == 0, float("-inf"))
    return masked.topk(cfg.topk, dim=-1)


def _topk(scores_TE: Tensor, cfg: RouterConfig) -> tuple[Tensor, Tensor]:
    if cfg.group_topk:
        return _group_limited_topk(scores_TE, cfg)
    return scores_TE.topk(cfg.topk, dim=1)


def topk_routing(logits_TE: Tensor, cfg: RouterConfig) -> tuple[Tensor, Tensor]:
    """Return ``(topk_idx [T, K] int64, topk_weights [T, K])`` from router logits."""
    if cfg.score_function == "softmax":
        if cfg.pre_softmax:
            scores = torch.softmax(logits_TE, dim=-1, dtype=torch.float32).type_as(logits_TE)
            weights, idx = _topk(scores, cfg)
        else:
            top_logits, idx = _topk(logits_TE, cfg)
            weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits_TE)
    else:
        scores = torch.sigmoid(logits_TE.float()).type_as(logits_TE)
        weights, idx = _topk(scores, cfg)
        if cfg.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.topk_scaling_factor:
        weights = weights * cfg.topk_scaling_factor
    return idx, weights


def even_assignment(num_tokens: int, cfg: RouterConfig, device: torch.device) -> Tensor:
    """Round-robin expert ids ``(t*K + k) % E``: every expert gets ``T*K/E`` rows when that divides."""
    slots = torch.arange(num_tokens * cfg.topk, device=device, dtype=torch.int64)
    return (slots % cfg.num_experts).view(num_tokens, cfg.topk)


def load_balancing_loss(
    logits_TE: Tensor, cfg: RouterConfig, reduce_group: dist.ProcessGroup | None = None
) -> Tensor:
    """Switch-transformer aux loss (times its coefficient), megatron-core's ``aux_loss`` type.

    Scores are full-row (softmax over E, or sigmoid normalised over E) and the expert counts come
    from a plain top-k of those scores, summed over ``reduce_group`` (megatron's TP x CP group).
    """
    T, E = logits_TE.shape
    if cfg.score_function == "softmax":
        scores = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits_TE)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = scores.topk(cfg.topk, dim=1)[1]
    tokens_per_expert = torch.zeros_like(logits_TE).int().scatter(1, top, 1).sum(0)
    group_size = 1
    if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
        tokens_per_expert = tokens_per_expert.clone()
        dist.all_reduce(tokens_per_expert, group=reduce_group)
        group_size = dist.get_world_size(reduce_group)
    total = T * group_size
    coeff = E * cfg.aux_loss_coeff / (cfg.topk * total * total) if total else 0.0
    return torch.sum(scores.sum(0) * tokens_per_expert) * coeff


class MegaMoERouter(nn.Module):
    """Gating linear (``weight [E, H]``, float32 unless told otherwise) + :func:`topk_routing` + aux loss."""

    def __init__(
        self,
        cfg: RouterConfig,
        hidden_size: int,
        *,
        reduce_group: dist.ProcessGroup | None = None,
        attach: AuxLossAttach = attach_aux_loss,
        weight_dtype: torch.dtype = torch.float32,
        init_method: Callable[[Tensor], object] | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.reduce_group = reduce_group
        self.attach = attach
        weight = torch.empty(cfg.num_experts, hidden_size, dtype=torch.float32)
        if init_method is None:
            nn.init.normal_(weight, std=1.0 / math.sqrt(hidden_size))
        else:
            init_method(weight)
        self.weight = nn.Parameter(weight.to(weight_dtype))

    def logits(self, x_TH: Tensor) -> Tensor:
        return x_TH.to(self.cfg.dtype) @ self.weight.to(self.cfg.dtype).t()

    def forward(self, x_TH: Tensor) -> RouterOutput:
        logits_TE = self.logits(x_TH)
        if self.cfg.force_load_balancing == "uniform":
            logits_TE = _RandomLogits.apply(logits_TE)
        topk_idx, topk_weights = topk_routing(logits_TE, self.cfg)
        if self.cfg.force_load_balancing == "even":
            topk_idx = even_assignment(x_TH.shape[0], self.cfg, x_TH.device)
        aux_loss = None
        if self.cfg.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux_loss = load_balancing_loss(logits_TE, self.cfg, self.reduce_group)
            topk_weights = self.attach(topk_weights, aux_loss)
        return RouterOutput(topk_idx, topk_weights, aux_loss)
