"""Naive per-token dense quantised expert path in float64 on dequantised operands: the oracle of the tests.

Written from the quantisation tables in :mod:`megamoe.backends.quantized_reference`, one (token, k)
slot at a time; only the wgrad GEMMs stack an expert's rows (in slot order, which is the backend's row
order) because their tiles run along the rows. Forward and backward are written out by hand: the
quantised backward quantises ``dy`` and ``dh`` itself, so it is not the autograd of the quantised
forward. Both weight forms are quantised from scratch here (``W^T`` from ``w.transpose``), whatever
the backend shares between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megamoe.quant import fake_quantize_fp8, fake_quantize_fp8_blocks, fake_quantize_mx


@dataclass(frozen=True)
class Quantizers:
    """A precision's operand quantisers, in float64: ``operand(t, dim)`` tiles along ``dim``,
    ``weight(w [E, Y, X])`` the form a GEMM multiplies (blocks along X, or 128×128 blocks)."""

    operand: Callable[[Tensor, int], Tensor]
    weight: Callable[[Tensor], Tensor]


MX = Quantizers(
    operand=lambda t, dim: fake_quantize_mx(t, dim).double(),
    weight=lambda w: fake_quantize_mx(w, -1).double(),
)
FP8 = Quantizers(
    operand=lambda t, dim: fake_quantize_fp8(t, dim, dtype=torch.float64),
    weight=lambda w: fake_quantize_fp8_blocks(w, dtype=torch.float64),
)
ORACLES = {"mxfp8": MX, "fp8": FP8}


def _swiglu(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _swiglu_vjp(h: Tensor, grad_a: Tensor) -> Tensor:
    h = h.detach().requires_grad_()
    (grad_h,) = torch.autograd.grad(_swiglu(h), h, grad_a)
    return grad_h


def quantized_dense_moe(
    q: Quantizers,
    xs: list[Tensor],
    idxs: list[Tensor],
    tws: list[Tensor],
    w1: Tensor,
    w2: Tensor,
    dys: list[Tensor],
) -> dict[str, list[Tensor] | Tensor]:
    """``y, dx, d_topk_weights`` per source (rank) and ``dw1, dw2`` for all experts, in float64.

    ``xs[r] [T_r, H]`` are the tokens of source rank r (one entry for a single rank), ``w1 [E, 2I, H]``,
    ``w2 [E, H, I]`` all experts' weights, ``dys[r]`` the output gradients.
    """
    _q = q.operand
    w1q, w2q = q.weight(w1), q.weight(w2)  # reduced along H, along I
    w1tq, w2tq = q.weight(w1.transpose(1, 2)), q.weight(w2.transpose(1, 2))  # along 2I, along H
    rows: dict[int, list[tuple[Tensor, Tensor, Tensor, Tensor]]] = {e: [] for e in range(w1.shape[0])}
    ys, dxs, dtws = [], [], []
    for x, idx, tw, dy in zip(xs, idxs, tws, dys, strict=True):
        x, tw, dy = x.double(), tw.double(), dy.double()
        y, dx, dtw = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(tw)
        for t in range(x.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e < 0:
                    continue
                h = _q(x[t : t + 1], -1) @ w1q[e].t()
                a = _swiglu(h)
                y[t] += tw[t, k] * (_q(a, -1) @ w2q[e].t())[0]
                da = _q(dy[t : t + 1], -1) @ w2tq[e].t()
                dtw[t, k] = (da * a).sum()
                dh = _swiglu_vjp(h, da * tw[t, k])
                dx[t] += (_q(dh, -1) @ w1tq[e].t())[0]
                rows[e].append((x[t], dy[t], (a * tw[t, k])[0], dh[0]))
        ys.append(y)
        dxs.append(dx)
        dtws.append(dtw)
    dw1 = torch.zeros(w1.shape, dtype=torch.float64)
    dw2 = torch.zeros(w2.shape, dtype=torch.float64)
    for e, expert_rows in rows.items():
        if expert_rows:
            x_e, dy_e, wa_e, dh_e = (torch.stack(col) for col in zip(*expert_rows, strict=True))
            dw2[e] = _q(dy_e, 0).t() @ _q(wa_e, 0)
            dw1[e] = _q(dh_e, 0).t() @ _q(x_e, 0)
    return {"y": ys, "dx": dxs, "d_topk_weights": dtws, "dw1": dw1, "dw2": dw2}
