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
from tests.megamoe.quant.cases import GRADS, ep_rank_errors, output_grad, run, snr_db, spread
from tests.megamoe.quant.oracle import MX, quantized_dense_moe
from tests.megamoe.reference_math import dense_moe, make_case

# (tokens per rank, hidden, inter, experts, topk, skew_to). Experts get > 32 rows (several blocks
# along R), H and I both multiples of 32 and not (short tail blocks), dropped slots (make_case drops
# 10 %), experts with no rows (skew), T = 0.
CASES = {
    "multi-block rows and columns": ([80], 64, 48, 3, 2, None),
    "short tail blocks H=40 I=20": ([37], 40, 20, 4, 2, None),
    "empty experts": ([50], 64, 32, 5, 2, 2),
    "T=0": ([0], 32, 32, 4, 2, None),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_mxfp8_reference_matches_naive_float64_oracle(case):
    tokens, hidden, inter, experts, topk, skew = case
    c = spread(
        make_case(tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=1, skew_to=skew)
    )
    got = run("mxfp8", c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"], output_grad(c, 0))
    ref = quantized_dense_moe(
        MX, c["x"], c["topk_idx"], c["topk_weights"], c["w1"], c["w2"], [output_grad(c, 0)]
    )
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


def test_mxfp8_bf16_inputs_accuracy_vs_float64():
    """bf16 in, bf16 out; SNR >= 21 dB and cosine >= 0.996 on every output at this small shape.

    Four E4M3 roundings on each path (two per GEMM, SwiGLU doubling the first GEMM's noise) put the
    ceiling near 24 dB for Gaussian data; docs/mxfp8.md has the figures at a moderate shape.
    """
    c = make_case(tokens=[256], hidden=128, inter=64, experts=4, topk=2, seed=5)
    x, idx, tw, w1, w2 = c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=x.dtype)
    got = run("mxfp8", x.bfloat16(), idx, tw.float(), w1.bfloat16(), w2.bfloat16(), dy.bfloat16())
    assert got["y"].dtype == got["dx"].dtype == got["dw1"].dtype == torch.bfloat16
    inputs = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = dense_moe(inputs[0], idx, inputs[1], inputs[2], inputs[3])
    y.backward(dy)
    ref = {"y": y.detach(), **{n: i.grad for n, i in zip(GRADS, inputs, strict=True)}}
    for name in ("y", "dx", "dw1", "dw2"):
        cos = torch.nn.functional.cosine_similarity(got[name].double().flatten(), ref[name].flatten(), dim=0)
        assert snr_db(got[name], ref[name]) >= 21 and cos >= 0.996, name


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
        InvalidConfigError,
        match=r"^precision='fp4': unknown expert precision\. Use one of bf16, mxfp8, fp8\.",
    ):
        fused_mega_moe(c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"], precision="fp4")


def test_check_precision_names_the_config_key():
    assert check_precision("mxfp8", setting="turbo_mega_moe_precision") == "mxfp8"
    with pytest.raises(
        InvalidConfigError, match=r"^turbo_mega_moe_precision='MXFP8'.*one of bf16, mxfp8, fp8\."
    ):
        check_precision("MXFP8", setting="turbo_mega_moe_precision")


# ---------------------------------------------------------------- 2 real gloo ranks


# (case, EP group is a new_group rather than WORLD)
EP_CASES = {
    "ragged T, rows from both ranks in one expert block": (([40, 25], 64, 32, 4, 2, None), False),
    "T=0 on a rank, all rows to rank 0's experts, new_group": (([0, 45], 32, 32, 4, 2, 2), True),
}


@pytest.mark.parametrize("case, subgroup", EP_CASES.values(), ids=EP_CASES.keys())
def test_mxfp8_reference_two_gloo_ranks_match_oracle(case, subgroup, tmp_path):
    for rank, errors in enumerate(run_ranks(ep_rank_errors, 2, tmp_path, "mxfp8", case, subgroup)):
        for name, err in errors.items():
            assert err < 1e-12, f"rank {rank} {name}: max relative error {err:.3e}"
