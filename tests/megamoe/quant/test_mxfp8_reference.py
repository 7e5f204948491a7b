"""The MXFP8 emulation backend vs the naive float64 oracle on one rank and on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from megamoe import (
    InvalidConfigError,
    UnsupportedSettingError,
    dispatch_grouped_gemm,
    fused_mega_moe,
    grouped_gemm_combine,
)
from megamoe.quant import check_precision, fake_quantize_mx
from tests._dist import run_ranks
from tests.megamoe.quant.mx_oracle import mx_dense_moe
from tests.megamoe.reference_math import dense_moe, make_case

GRADS = ("dx", "d_topk_weights", "dw1", "dw2")

# (tokens per rank, hidden, inter, experts, topk, skew_to). Experts get > 32 rows (several blocks
# along R), H and I both multiples of 32 and not (short tail blocks), dropped slots (make_case drops
# 10 %), experts with no rows (skew), T = 0.
CASES = {
    "multi-block rows and columns": ([80], 64, 48, 3, 2, None),
    "short tail blocks H=40 I=20": ([37], 40, 20, 4, 2, None),
    "empty experts": ([50], 64, 32, 5, 2, 2),
    "T=0": ([0], 32, 32, 4, 2, None),
}


def _wide_range(t, seed):
    """``t`` times 2^i per row and 2^j per column, i, j in [-8, 8]: blocks along rows and along columns
    then hold values 2^16 apart, so small ones land in E4M3's subnormals and the block layout matters
    (for plain Gaussian data every layout rounds alike: power-of-two scales keep relative rounding)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-8, 9, (*t.shape[:-1], 1), generator=g).to(t.dtype).exp2()
    cols = torch.randint(-8, 9, (*t.shape[:-2], 1, t.shape[-1]), generator=g).to(t.dtype).exp2()
    return t * rows * cols


def _spread(c):
    """``make_case`` data with a wide dynamic range (see :func:`_wide_range`)."""
    c["w1"], c["w2"] = _wide_range(c["w1"], 1), _wide_range(c["w2"], 2)
    c["x"] = [_wide_range(x, 10 + r) for r, x in enumerate(c["x"])]
    return c


def _run(x, idx, tw, w1, w2, dy, group=None):
    inputs = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(inputs[0], idx, inputs[1], inputs[2], inputs[3], group=group, precision="mxfp8")
    if y.requires_grad:
        y.backward(dy)
    grads = [i.grad if i.grad is not None else torch.zeros_like(i) for i in inputs]
    return {"y": y.detach(), **dict(zip(GRADS, grads, strict=True))}


def _dy(c, rank):
    g = torch.Generator().manual_seed(100 + rank)
    return _wide_range(torch.randn(c["x"][rank].shape, generator=g, dtype=c["x"][rank].dtype), 20 + rank)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_mxfp8_reference_matches_naive_float64_oracle(case):
    tokens, hidden, inter, experts, topk, skew = case
    c = _spread(
        make_case(tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=1, skew_to=skew)
    )
    got = _run(c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"], _dy(c, 0))
    ref = mx_dense_moe(c["x"], c["topk_idx"], c["topk_weights"], c["w1"], c["w2"], [_dy(c, 0)])
    for name in ("y", *GRADS):
        expected = ref[name][0] if isinstance(ref[name], list) else ref[name]
        torch.testing.assert_close(
            got[name], expected, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_mxfp8_reference_differs_from_unquantised_path():
    """The oracle match above is not vacuous: MX rounding moves y by about 2^-5 relative."""
    c = make_case(tokens=[40], hidden=64, inter=32, experts=4, topk=2, seed=2)
    args = (c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"])
    y_mx, y = fused_mega_moe(*args, precision="mxfp8"), dense_moe(*args)
    rel = ((y_mx - y).norm() / y.norm()).item()
    assert 2e-3 < rel < 0.2


def test_mxfp8_two_stages_equal_fused_op():
    c = make_case(tokens=[33], hidden=64, inter=32, experts=4, topk=2, seed=3)
    x, idx, w = c["x"][0], c["topk_idx"][0], c["topk_weights"][0]
    h, dispatch_weights, handle = dispatch_grouped_gemm(x, idx, w, c["w1"], precision="mxfp8")
    assert handle.backend.name == "mxfp8_reference"
    y = grouped_gemm_combine(h, dispatch_weights, handle, c["w2"])
    torch.testing.assert_close(
        y, fused_mega_moe(x, idx, w, c["w1"], c["w2"], precision="mxfp8"), rtol=0, atol=0
    )


def test_mxfp8_rowwise_quantisation_commutes_with_dispatch():
    """Why a kernel may quantise x and dy at the source and send E4M3 rows: per-row scales travel along."""
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(4))
    rows = torch.tensor([3, 3, 0, 15, 7, 7, 7, 1])
    torch.testing.assert_close(fake_quantize_mx(x)[rows], fake_quantize_mx(x[rows]), rtol=0, atol=0)


def _snr_db(got, ref):
    return (10 * torch.log10(ref.pow(2).sum() / (got.double() - ref).pow(2).sum())).item()


def test_mxfp8_bf16_inputs_accuracy_vs_float64():
    """bf16 in, bf16 out; SNR >= 21 dB and cosine >= 0.996 on every output at this small shape.

    Four E4M3 roundings on each path (two per GEMM, SwiGLU doubling the first GEMM's noise) put the
    ceiling near 24 dB for Gaussian data; docs/mxfp8.md has the figures at a moderate shape.
    """
    c = make_case(tokens=[256], hidden=128, inter=64, experts=4, topk=2, seed=5)
    x, idx, tw, w1, w2 = c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=x.dtype)
    got = _run(x.bfloat16(), idx, tw.float(), w1.bfloat16(), w2.bfloat16(), dy.bfloat16())
    assert got["y"].dtype == got["dx"].dtype == got["dw1"].dtype == torch.bfloat16
    inputs = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = dense_moe(inputs[0], idx, inputs[1], inputs[2], inputs[3])
    y.backward(dy)
    ref = {"y": y.detach(), **{n: i.grad for n, i in zip(GRADS, inputs, strict=True)}}
    for name in ("y", "dx", "dw1", "dw2"):
        cos = torch.nn.functional.cosine_similarity(got[name].double().flatten(), ref[name].flatten(), dim=0)
        assert _snr_db(got[name], ref[name]) >= 21 and cos >= 0.996, name


def test_mxfp8_on_a_backend_without_mxfp8_kernels_names_the_setting():
    c = make_case(tokens=[4], hidden=32, inter=32, experts=2, topk=1, seed=6)
    with pytest.raises(
        UnsupportedSettingError, match=r"^precision='mxfp8': backend 'primus_turbo' has no MXFP8"
    ):
        fused_mega_moe(
            c["x"][0],
            c["topk_idx"][0],
            c["topk_weights"][0],
            c["w1"],
            c["w2"],
            backend="primus_turbo",
            precision="mxfp8",
        )


def test_unknown_precision_names_the_setting_and_choices():
    c = make_case(tokens=[4], hidden=32, inter=32, experts=2, topk=1, seed=6)
    with pytest.raises(
        InvalidConfigError, match=r"^precision='fp8': unknown expert precision\. Use one of bf16, mxfp8"
    ):
        fused_mega_moe(c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"], precision="fp8")


def test_check_precision_names_the_config_key():
    assert check_precision("mxfp8", setting="turbo_mega_moe_precision") == "mxfp8"
    with pytest.raises(InvalidConfigError, match=r"^turbo_mega_moe_precision='MXFP8'.*one of bf16, mxfp8"):
        check_precision("MXFP8", setting="turbo_mega_moe_precision")


# ---------------------------------------------------------------- 2 real gloo ranks


def _ep_rank(rank, world, case, subgroup):
    import torch.distributed as dist

    tokens, hidden, inter, experts, topk, skew = case
    c = _spread(
        make_case(
            tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=11, skew_to=skew
        )
    )
    group = dist.new_group(list(range(world))) if subgroup else dist.group.WORLD
    G = experts // world
    shard = slice(rank * G, (rank + 1) * G)
    got = _run(
        c["x"][rank],
        c["topk_idx"][rank],
        c["topk_weights"][rank],
        c["w1"][shard],
        c["w2"][shard],
        _dy(c, rank),
        group=group,
    )
    ref = mx_dense_moe(
        c["x"], c["topk_idx"], c["topk_weights"], c["w1"], c["w2"], [_dy(c, r) for r in range(world)]
    )
    expected = {
        "y": ref["y"][rank],
        "dx": ref["dx"][rank],
        "d_topk_weights": ref["d_topk_weights"][rank],
        "dw1": ref["dw1"][shard],
        "dw2": ref["dw2"][shard],
    }
    return {n: _relative_error(got[n], expected[n]) for n in expected}


def _relative_error(got, expected):
    """Largest error relative to the largest expected magnitude (the data spans 2^±16)."""
    if expected.numel() == 0 or not expected.abs().max():
        return (got - expected).abs().max().item() if expected.numel() else 0.0
    return ((got - expected).abs().max() / expected.abs().max()).item()


# (case, EP group is a new_group rather than WORLD)
EP_CASES = {
    "ragged T, rows from both ranks in one expert block": (([40, 25], 64, 32, 4, 2, None), False),
    "T=0 on a rank, all rows to rank 0's experts, new_group": (([0, 45], 32, 32, 4, 2, 2), True),
}


@pytest.mark.parametrize("case, subgroup", EP_CASES.values(), ids=EP_CASES.keys())
def test_mxfp8_reference_two_gloo_ranks_match_oracle(case, subgroup, tmp_path):
    for rank, errors in enumerate(run_ranks(_ep_rank, 2, tmp_path, case, subgroup)):
        for name, err in errors.items():
            assert err < 1e-12, f"rank {rank} {name}: max relative error {err:.3e}"
