"""What the quantised-backend tests run and measure: wide-range data, one op call with its gradients,
one EP rank against the oracle, and the error measures."""

from __future__ import annotations

import torch

from megamoe import fused_mega_moe
from tests.megamoe.quant.oracle import ORACLES, quantized_dense_moe
from tests.megamoe.reference_math import make_case

GRADS = ("dx", "d_topk_weights", "dw1", "dw2")


def wide_range(t, seed):
    """``t`` times 2^i per row and 2^j per column, i, j in [-8, 8]: tiles along rows and along columns
    then hold values 2^16 apart, so small ones land in E4M3's subnormals and the tile layout matters
    (for plain Gaussian data every layout rounds alike: scales keep relative rounding)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-8, 9, (*t.shape[:-1], 1), generator=g).to(t.dtype).exp2()
    cols = torch.randint(-8, 9, (*t.shape[:-2], 1, t.shape[-1]), generator=g).to(t.dtype).exp2()
    return t * rows * cols


def spread(c):
    """``make_case`` data with a wide dynamic range (see :func:`wide_range`)."""
    c["w1"], c["w2"] = wide_range(c["w1"], 1), wide_range(c["w2"], 2)
    c["x"] = [wide_range(x, 10 + r) for r, x in enumerate(c["x"])]
    return c


def output_grad(c, rank):
    """Rank ``rank``'s ``dy``, wide-range like its ``x``."""
    g = torch.Generator().manual_seed(100 + rank)
    return wide_range(torch.randn(c["x"][rank].shape, generator=g, dtype=c["x"][rank].dtype), 20 + rank)


def run(precision, x, idx, tw, w1, w2, dy, group=None):
    """``y`` and the four gradients of one ``fused_mega_moe`` call (zeros where none flowed)."""
    inputs = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(inputs[0], idx, inputs[1], inputs[2], inputs[3], group=group, precision=precision)
    if y.requires_grad:
        y.backward(dy)
    grads = [i.grad if i.grad is not None else torch.zeros_like(i) for i in inputs]
    return {"y": y.detach(), **dict(zip(GRADS, grads, strict=True))}


def snr_db(got, ref):
    return (10 * torch.log10(ref.pow(2).sum() / (got.double() - ref).pow(2).sum())).item()


def relative_error(got, expected):
    """Largest error relative to the largest expected magnitude (the data spans 2^±16)."""
    if expected.numel() == 0 or not expected.abs().max():
        return (got - expected).abs().max().item() if expected.numel() else 0.0
    return ((got - expected).abs().max() / expected.abs().max()).item()


def ep_rank_errors(rank, world, precision, case, subgroup):
    """On EP rank ``rank`` (under :func:`tests._dist.run_ranks`): the op's outputs and gradients against
    the oracle's for this rank's tokens and expert shard, as :func:`relative_error` per name.
    ``case`` = (tokens per rank, hidden, inter, experts, topk, skew_to); ``subgroup``: EP over a
    ``new_group`` rather than WORLD."""
    import torch.distributed as dist

    tokens, hidden, inter, experts, topk, skew = case
    c = spread(
        make_case(
            tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=11, skew_to=skew
        )
    )
    group = dist.new_group(list(range(world))) if subgroup else dist.group.WORLD
    G = experts // world
    shard = slice(rank * G, (rank + 1) * G)
    got = run(
        precision,
        c["x"][rank],
        c["topk_idx"][rank],
        c["topk_weights"][rank],
        c["w1"][shard],
        c["w2"][shard],
        output_grad(c, rank),
        group=group,
    )
    dys = [output_grad(c, r) for r in range(world)]
    ref = quantized_dense_moe(
        ORACLES[precision], c["x"], c["topk_idx"], c["topk_weights"], c["w1"], c["w2"], dys
    )
    expected = {
        "y": ref["y"][rank],
        "dx": ref["dx"][rank],
        "d_topk_weights": ref["d_topk_weights"][rank],
        "dw1": ref["dw1"][shard],
        "dw2": ref["dw2"][shard],
    }
    return {n: relative_error(got[n], expected[n]) for n in expected}
