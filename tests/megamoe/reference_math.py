"""Naive per-token dense MoE, written straight from the layer contract: the oracle of the op tests."""

from __future__ import annotations

import torch
from torch import Tensor


def dense_moe(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor, w1_E2IH: Tensor, w2_EHI: Tensor
) -> Tensor:
    """``y_t = sum_k w_tk * (silu(x_t W1g_e^T) * (x_t W1u_e^T)) W2_e^T`` with ``e = topk_idx[t, k]`` (-1 skipped)."""
    y = torch.zeros_like(x_TH)
    for e in range(w1_E2IH.shape[0]):
        hit_TK = topk_idx_TK == e
        tokens = hit_TK.any(1).nonzero().flatten()
        if tokens.numel() == 0:
            continue
        weight_T = (topk_weights_TK * hit_TK).sum(1)[tokens]
        gate, up = (x_TH[tokens] @ w1_E2IH[e].t()).chunk(2, dim=-1)
        out = (torch.nn.functional.silu(gate) * up) @ w2_EHI[e].t()
        y = y.index_add(0, tokens, out * weight_T.unsqueeze(1).to(out.dtype))
    return y


def make_case(
    *,
    tokens: list[int],
    hidden: int,
    inter: int,
    experts: int,
    topk: int,
    seed: int,
    drop: float = 0.1,
    skew_to: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Tensor | list[Tensor]]:
    """Global weights and per-rank inputs; ``skew_to`` routes every slot to experts < skew_to (others empty)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=dtype) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g, dtype=dtype) / inter**0.5
    xs, idxs, weights = [], [], []
    for t in tokens:
        xs.append(torch.randn(t, hidden, generator=g, dtype=dtype))
        high = skew_to or experts
        scores = torch.rand(t, high, generator=g)
        idx = scores.topk(min(topk, high), dim=1).indices
        if idx.shape[1] < topk:
            idx = torch.cat([idx, torch.full((t, topk - idx.shape[1]), -1)], 1)
        idx[torch.rand(t, topk, generator=g) < drop] = -1
        idxs.append(idx)
        weights.append(torch.rand(t, topk, generator=g, dtype=dtype))
    return {"w1": w1, "w2": w2, "x": xs, "topk_idx": idxs, "topk_weights": weights}
