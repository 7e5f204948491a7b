"""Token exchange for expert parallelism over any process group, with ``all_to_all_single``.

Legend: T local tokens, K top-k, E experts, W EP ranks, G = E / W local experts, S valid (token, k)
slots this rank sends, R rows this rank receives.

A (token, k) slot with global expert ``e`` goes to rank ``e // G``. Sent rows are ordered by global
expert (stable), which is (destination rank, local expert, slot) order, so one ``all_to_all_single``
moves them. Received rows arrive source-rank-major; ``recv_perm`` reorders them expert-major —
(local expert, source rank, source slot order) — which is deterministic and what grouped GEMMs want.
``combine_*`` is the exact inverse. Slots with expert id ``-1`` are dropped: they send nothing and get
zero weight-gradient.

The counts are exchanged on the host (``.tolist()``): this is the reference and the NCCL path, not the
sync-free fused one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_to_all(
    rows: Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """``all_to_all_single`` on row blocks; bf16 travels as bytes because gloo has no bf16 (nor int16)."""
    send = rows.contiguous()
    if send.dtype != torch.bfloat16:
        out = send.new_empty((out_rows, *send.shape[1:]))
        dist.all_to_all_single(out, send, out_splits, in_splits, group=group)
        return out
    wire = send.reshape(send.shape[0], math.prod(send.shape[1:])).view(torch.uint8)  # (not -1: 0 rows)
    out = wire.new_empty((out_rows, wire.shape[1]))
    dist.all_to_all_single(out, wire, out_splits, in_splits, group=group)
    return out.view(torch.bfloat16).reshape(out_rows, *send.shape[1:])


@dataclass(kw_only=True, slots=True)
class TokenExchange:
    """Who sends which (token, k) row where, for one forward; reused by backward."""

    num_tokens: int
    topk: int
    num_experts: int
    group: dist.ProcessGroup | None
    ep_size: int
    send_slots_S: Tensor
    """flat slot ids ``t*K + k`` in send order (valid slots only)."""
    send_splits: list[int]
    """rows sent to each rank."""
    recv_splits: list[int]
    """rows received from each rank."""
    recv_perm_R: Tensor
    """for each expert-sorted row, its index in the received (source-major) buffer."""
    tokens_per_expert: list[int]
    """rows per local expert, G entries (host ints: this path synchronises anyway)."""

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def num_rows(self) -> int:
        return int(self.recv_perm_R.numel())

    @property
    def send_tokens_S(self) -> Tensor:
        return torch.div(self.send_slots_S, self.topk, rounding_mode="floor")

    @classmethod
    def build(
        cls, topk_idx_TK: Tensor, *, num_experts: int, group: dist.ProcessGroup | None
    ) -> TokenExchange:
        W, _ = _group_size_rank(group)
        T, K = topk_idx_TK.shape
        G = num_experts // W
        flat = topk_idx_TK.reshape(-1).long()
        valid = flat >= 0
        order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)
        send_counts_E = torch.bincount(flat[valid], minlength=num_experts)
        num_send = int(send_counts_E.sum())
        if W == 1:
            recv_counts_WG = send_counts_E.view(1, G)
        else:
            recv_counts_WG = torch.empty_like(send_counts_E)
            dist.all_to_all_single(recv_counts_WG, send_counts_E, group=group)
            recv_counts_WG = recv_counts_WG.view(W, G)
        perm = _expert_major_perm(recv_counts_WG)
        return cls(
            num_tokens=T,
            topk=K,
            num_experts=num_experts,
            group=group,
            ep_size=W,
            send_slots_S=order[:num_send],
            send_splits=send_counts_E.view(W, G).sum(1).tolist(),
            recv_splits=recv_counts_WG.sum(1).tolist(),
            recv_perm_R=perm,
            tokens_per_expert=recv_counts_WG.sum(0).tolist(),
        )

    def dispatch(self, rows_SX: Tensor) -> Tensor:
        """Send per-slot rows (in send order) to their experts; return them expert-sorted ``[R, ...]``."""
        if self.ep_size == 1:
            return rows_SX[self.recv_perm_R]
        received = _all_to_all(rows_SX, self.num_rows, self.recv_splits, self.send_splits, self.group)
        return received[self.recv_perm_R]

    def combine(self, rows_RX: Tensor) -> Tensor:
        """Inverse of :meth:`dispatch`: return expert-sorted rows to their slots, in send order ``[S, ...]``."""
        source_major = torch.empty_like(rows_RX).index_copy_(0, self.recv_perm_R, rows_RX)
        if self.ep_size == 1:
            return source_major
        return _all_to_all(
            source_major, int(self.send_slots_S.numel()), self.send_splits, self.recv_splits, self.group
        )

    def dispatch_tokens(self, x_TH: Tensor) -> Tensor:
        """Rows of ``x`` for every valid slot, at their experts: ``[R, H]``."""
        return self.dispatch(x_TH[self.send_tokens_S])

    def dispatch_slot_values(self, values_TK: Tensor) -> Tensor:
        """Per-slot scalars (routing weights) at their experts: ``[R]``."""
        return self.dispatch(values_TK.reshape(-1)[self.send_slots_S])

    def combine_tokens(self, rows_RH: Tensor, *, acc_dtype: torch.dtype) -> Tensor:
        """Sum each token's returned rows: ``[T, H]`` (accumulated in ``acc_dtype``)."""
        back_SH = self.combine(rows_RH)
        out = torch.zeros(self.num_tokens, rows_RH.shape[1], dtype=acc_dtype, device=rows_RH.device)
        return out.index_add_(0, self.send_tokens_S, back_SH.to(acc_dtype))

    def combine_slot_values(self, values_R: Tensor) -> Tensor:
        """Per-row scalars back to their slots: ``[T, K]``, zero for dropped slots."""
        back_S = self.combine(values_R)
        out = values_R.new_zeros(self.num_tokens * self.topk)
        out[self.send_slots_S] = back_S
        return out.view(self.num_tokens, self.topk)


def _expert_major_perm(counts_WG: Tensor) -> Tensor:
    """Indices into a source-major buffer of blocks ``(w, g)`` that visit it block-wise in (g, w) order."""
    W, G = counts_WG.shape
    flat = counts_WG.reshape(-1)
    start_WG = (flat.cumsum(0) - flat).view(W, G)
    counts_em = counts_WG.t().reshape(-1)
    starts_em = start_WG.t().reshape(-1)
    total = int(counts_em.sum())
    block_first_row = torch.repeat_interleave(counts_em.cumsum(0) - counts_em, counts_em, output_size=total)
    within = torch.arange(total, device=counts_WG.device) - block_first_row
    return torch.repeat_interleave(starts_em, counts_em, output_size=total) + within
