"""The transport part of the Triton backends when the exchange is not fused into their kernels.

Legend: T tokens, K top-k, G local experts, R rows the kernels compute.

A transport turns one forward's routing into :class:`Rows`: the routing plan the expert kernels run
over, and how tokens and per-slot scalars get to those rows and back. The expert math (bf16 in
:mod:`.backend`, MXFP8 in :mod:`megamoe.backends.triton_mx.backend`) is written once against it:

* :class:`LocalRows` (one GPU): the kernels gather ``x`` by token themselves (K slots per token) and
  their combine writes ``y``; nothing moves;
* :class:`ExchangedRows` (EP over any process group): ``all_to_all_single`` moves the rows
  (:class:`~megamoe.backends.exchange.TokenExchange`, split sizes read on the host), and the kernels
  see the received rows as R tokens with one slot each.

The fused symmetric-memory path is not a transport here: its kernels move the rows themselves
(:mod:`megamoe.backends.symm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.backends.exchange import TokenExchange
from megamoe.backends.triton.routing import RoutingPlan, build_received_plan, build_routing_plan
from megamoe.quant.fp8 import FP8Tensor


class Rows(Protocol):
    routing: RoutingPlan

    def tokens_in(self, x_TH: Tensor) -> Tensor:
        """What the kernels read as tokens (``x`` or ``dy``)."""
        ...

    def quantized_tokens_in(self, q_TH: FP8Tensor) -> FP8Tensor:
        """The same for tokens quantised rowwise at the source (1×128 tiles along H move with their
        rows): E4M3 bytes and their scales travel, about half of bf16's bytes."""
        ...

    def weights_in(self, topk_weights_TK: Tensor) -> Tensor:
        """The routing weight of each of the plan's slots ``[S]`` (the kernels pick each row's through
        ``routing.row_slot_R``)."""
        ...

    def tokens_out(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        """The kernels' combined output back as ``[T, H]`` in ``dtype``."""
        ...

    def slot_values_out(self, values_S: Tensor) -> Tensor:
        """Scalars of the plan's slots ``[S]`` back as the caller's ``[T, K]`` (the kernels pick them
        from the rows through ``routing.slot_row_S``, zero for dropped slots)."""
        ...


@dataclass(frozen=True, slots=True)
class LocalRows:
    routing: RoutingPlan

    def tokens_in(self, x_TH: Tensor) -> Tensor:
        return x_TH.contiguous()

    def quantized_tokens_in(self, q_TH: FP8Tensor) -> FP8Tensor:
        return q_TH

    def weights_in(self, topk_weights_TK: Tensor) -> Tensor:
        return topk_weights_TK.contiguous().view(-1)

    def tokens_out(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        return y

    def slot_values_out(self, values_S: Tensor) -> Tensor:
        return values_S.view(self.routing.num_tokens, self.routing.topk)


@dataclass(frozen=True, slots=True)
class ExchangedRows:
    routing: RoutingPlan
    exchange: TokenExchange

    def tokens_in(self, x_TH: Tensor) -> Tensor:
        return self.exchange.dispatch_tokens(x_TH.contiguous())

    def quantized_tokens_in(self, q_TH: FP8Tensor) -> FP8Tensor:
        data = self.exchange.dispatch_tokens(q_TH.data.view(torch.uint8))  # bytes: any backend moves them
        return FP8Tensor(data.view(q_TH.data.dtype), self.exchange.dispatch_tokens(q_TH.scale), q_TH.tile)

    def weights_in(self, topk_weights_TK: Tensor) -> Tensor:
        return self.exchange.dispatch_slot_values(topk_weights_TK)

    def tokens_out(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        return self.exchange.combine_tokens(y, acc_dtype=torch.float32).to(dtype)

    def slot_values_out(self, values_S: Tensor) -> Tensor:
        return self.exchange.combine_slot_values(values_S)  # one slot per received row, in row order


class LocalTransport:
    """One GPU (or an EP group of one)."""

    name = "local"
    checks_expert_ids = True
    """the routing plan counts ids outside ``[-1, E)`` and asserts on the device that there were none"""

    def rows(
        self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None, block_m: int
    ) -> LocalRows:
        plan = build_routing_plan(topk_idx_TK, num_experts=num_experts, block_m=block_m, check_ids=True)
        return LocalRows(plan)


class AllToAllTransport:
    """EP over any process group with ``all_to_all_single`` (NCCL on GPUs, gloo on CPUs)."""

    name = "nccl"
    checks_expert_ids = False

    def rows(
        self, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None, block_m: int
    ) -> ExchangedRows:
        exchange = TokenExchange.build(topk_idx_TK, num_experts=num_experts, group=group)
        routing = build_received_plan(exchange.tokens_per_expert, block_m=block_m, device=topk_idx_TK.device)
        return ExchangedRows(routing, exchange)


Transport = LocalTransport | AllToAllTransport
