"""The FP8 emulation backend vs the naive float64 oracle on one rank and on 2 real gloo ranks, its
accuracy against the unquantised path, and how backends are chosen for ``precision="fp8"``."""

from __future__ import annotations

import pytest
import torch

from megamoe import UnsupportedSettingError, dispatch_grouped_gemm, fused_mega_moe, grouped_gemm_combine
from megamoe.backends import get_backend
from megamoe.backends.quantized_reference import FP8ReferenceBackend
from tests._dist import run_ranks
from tests.megamoe.quant.cases import GRADS, ep_rank_errors, output_grad, run, snr_db, spread
from tests.megamoe.quant.oracle import FP8, quantized_dense_moe
from tests.megamoe.reference_math import dense_moe, make_case

# (tokens per rank, hidden, inter, experts, topk, skew_to). Experts get > 128 rows (two tiles along
# R), H = 200 and 2I = 272 span two and three tiles with short tails and the weights 2x2 and 3x2
# blocks, dropped slots (make_case drops 10 %), experts with no rows (skew), T = 0.
CASES = {
    "multi-tile rows, short tails H=200 I=136": ([200], 200, 136, 2, 2, None),
    "one short tile H=40 I=20": ([37], 40, 20, 4, 2, None),
    "empty experts": ([50], 160, 64, 5, 2, 2),
    "T=0": ([0], 32, 32, 4, 2, None),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fp8_reference_matches_naive_float64_oracle(case):
    tokens, hidden, inter, experts, topk, skew = case
    c = spread(
        make_case(tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=1, skew_to=skew)
    )
    dy = output_grad(c, 0)
    got = run("fp8", c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"], dy)
    ref = quantized_dense_moe(FP8, c["x"], c["topk_idx"], c["topk_weights"], c["w1"], c["w2"], [dy])
    for name in ("y", *GRADS):
        expected = ref[name][0] if isinstance(ref[name], list) else ref[name]
        torch.testing.assert_close(
            got[name], expected, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_fp8_reference_differs_from_unquantised_and_from_mxfp8():
    """The oracle match above is not vacuous: E4M3 rounding moves y by a few percent, differently
    from MX's blocks and scales."""
    c = make_case(tokens=[40], hidden=256, inter=64, experts=4, topk=2, seed=2)
    args = (c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"])
    y_fp8, y = fused_mega_moe(*args, precision="fp8"), dense_moe(*args)
    rel = ((y_fp8 - y).norm() / y.norm()).item()
    assert 2e-3 < rel < 0.2
    assert not torch.equal(y_fp8, fused_mega_moe(*args, precision="mxfp8"))


def test_fp8_two_stages_equal_fused_op():
    c = make_case(tokens=[33], hidden=160, inter=32, experts=4, topk=2, seed=3)
    x, idx, w = c["x"][0], c["topk_idx"][0], c["topk_weights"][0]
    h, dispatch_weights, handle = dispatch_grouped_gemm(x, idx, w, c["w1"], precision="fp8")
    assert handle.backend.name == "fp8_reference"
    y = grouped_gemm_combine(h, dispatch_weights, handle, c["w2"])
    torch.testing.assert_close(
        y, fused_mega_moe(x, idx, w, c["w1"], c["w2"], precision="fp8"), rtol=0, atol=0
    )


def test_fp8_accuracy_against_the_unquantised_float32_path():
    """float32 in; SNR >= 22 dB and cosine >= 0.995 on every output at T=256 H=256 I=128 (measured
    23.5-24.1 dB: four E4M3 roundings on each path, as for mxfp8; docs/fp8.md has the figures)."""
    c = make_case(tokens=[256], hidden=256, inter=128, experts=4, topk=2, seed=5, dtype=torch.float32)
    x, idx, tw, w1, w2 = c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    got = run("fp8", x, idx, tw, w1, w2, dy)
    inputs = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = dense_moe(inputs[0], idx, inputs[1], inputs[2], inputs[3])
    y.backward(dy)
    ref = {"y": y.detach(), **{n: i.grad for n, i in zip(GRADS, inputs, strict=True)}}
    for name in ("y", *GRADS):
        cos = torch.nn.functional.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0)
        assert snr_db(got[name], ref[name].double()) >= 22 and cos >= 0.995, name


def test_fp8_bf16_inputs_give_bf16_outputs_and_gradients():
    c = make_case(tokens=[20], hidden=128, inter=64, experts=2, topk=2, seed=7, dtype=torch.bfloat16)
    x, idx, tw, w1, w2 = c["x"][0], c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"]
    got = run("fp8", x, idx, tw.float(), w1, w2, torch.ones_like(x))
    assert got["y"].dtype == got["dx"].dtype == got["dw1"].dtype == got["dw2"].dtype == torch.bfloat16


# ---------------------------------------------------------------- backend choice


def test_fp8_get_backend_gives_the_fp8_emulation_on_cpu():
    """``auto`` on the CPU; on CUDA it picks the Triton FP8 kernels (tests/megamoe/triton_fp8)."""
    backend = get_backend("auto", device=torch.device("cpu"), dtype=torch.float32, precision="fp8")
    assert isinstance(backend, FP8ReferenceBackend) and backend.recipe.precision == "fp8"


def test_fp8_on_primus_turbo_names_the_setting():
    with pytest.raises(UnsupportedSettingError, match=r"^precision='fp8': backend 'primus_turbo' has no FP8"):
        get_backend("primus_turbo", device=torch.device("cpu"), dtype=torch.float32, precision="fp8")


# ---------------------------------------------------------------- 2 real gloo ranks

# (case, EP group is a new_group rather than WORLD)
EP_CASES = {
    "uneven T, rows from both ranks in one expert tile, H=136": (([90, 55], 136, 64, 4, 2, None), False),
    "T=0 on a rank, all rows to rank 0's experts, new_group": (([0, 45], 32, 32, 4, 2, 2), True),
}


@pytest.mark.parametrize("case, subgroup", EP_CASES.values(), ids=EP_CASES.keys())
def test_fp8_reference_two_gloo_ranks_match_oracle(case, subgroup, tmp_path):
    for rank, errors in enumerate(run_ranks(ep_rank_errors, 2, tmp_path, "fp8", case, subgroup)):
        for name, err in errors.items():
            assert err < 1e-12, f"rank {rank} {name}: max relative error {err:.3e}"
