"""The MX GEMM kernels against float64 products of the exactly dequantised operands.

Bitwise equality is impossible (fp32 sums in another order), so: relative error per element small
against the float64 product, and SNR >= 60 dB against the float32 emulation
(:mod:`megamoe.backends.quantized_reference`'s math). Under ``TRITON_INTERPRET=1`` the interpreter runs
the E4M3 dot by upcasting to fp16 and multiplying in fp32 (exact products), so these pin the kernels'
indexing, scale handling, gather, tile table and ragged edges, not Hopper's MMA rounding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.accuracy import snr_db
from megamoe.backends.triton.configs import block_m, num_programs
from megamoe.backends.triton.routing import build_routing_plan
from megamoe.backends.triton_mx.configs import gemm_config, wgrad_config
from megamoe.backends.triton_mx.grouped_gemm import mx_grouped_gemm
from megamoe.backends.triton_mx.quantize_rows import quantize_rows
from megamoe.backends.triton_mx.quantize_segments import quantize_segments, segment_block_starts
from megamoe.backends.triton_mx.wgrad import mx_wgrad
from megamoe.quant.mx import fake_quantize_mx, quantize_mx
from tests.megamoe.triton_mx.test_quantize import DEVICE

INTERPRETED = DEVICE.type == "cpu"
REL_TOL, FLOOR_DB = (1e-5, 60.0) if INTERPRETED else (2e-3, 50.0)
"""Interpreted, the kernels sum in float32 as the reference does; a GPU's tensor cores add the products
of each MMA in reduced precision first (measured on an H100: 4e-4 of a row's largest element)."""


def spread(rows: int, cols: int, *, seed: int) -> torch.Tensor:
    """Gaussian values times 2**U(-8, 8) per element: a wrong block or scale shows, nothing overflows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-8, 9, (rows, cols), generator=g).float()
    )


def _routing(T: int, K: int, G: int, *, drop: float, empty: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    idx[idx < empty] = -1
    return idx


@pytest.mark.parametrize(
    ("T", "K", "G", "N", "KD", "gather"),
    [(29, 3, 5, 40, 96, True), (29, 3, 5, 24, 80, False), (16, 2, 3, 16, 32, False)],
    ids=["gather-ragged", "tma-short-k-block", "one-k-block"],
)
def test_mx_grouped_gemm_matches_dequantised_product(
    T: int, K: int, G: int, N: int, KD: int, gather: bool
) -> None:
    idx = _routing(T, K, G, drop=0.2, empty=1)
    plan = build_routing_plan(idx.to(DEVICE), num_experts=G, block_m=block_m(DEVICE))
    valid = int(plan.expert_start_G1[-1])
    rows = plan.row_token_R.long().cpu()[:valid]
    src = spread(T if gather else T * K, KD, seed=1)
    w = spread(G * N, KD, seed=2).reshape(G, N, KD)
    a = quantize_rows(src.to(DEVICE))
    b = quantize_mx(w.to(DEVICE), dim=-1)
    out = torch.full((T * K, N), float("nan"), device=DEVICE)
    mx_grouped_gemm(
        a,
        b,
        out,
        plan,
        config=gemm_config(DEVICE),
        num_sms=num_programs(DEVICE),
        a_rows=plan.row_token_R if gather else None,
    )
    a_deq = fake_quantize_mx(src, dim=1).double()
    a_deq = a_deq[rows] if gather else a_deq[:valid]
    b_deq = fake_quantize_mx(w, dim=-1).double()
    experts = torch.repeat_interleave(
        torch.arange(G), (plan.expert_start_G1[1:] - plan.expert_start_G1[:-1]).cpu()
    )
    want = torch.einsum("rk,rnk->rn", a_deq, b_deq[experts])
    got = out[:valid].double().cpu()
    assert torch.isfinite(got).all()
    scale = want.abs().amax(dim=1, keepdim=True).clamp_min(1e-300)
    assert ((got - want).abs() / scale).max() < REL_TOL
    assert snr_db(got, want) >= FLOOR_DB


@pytest.mark.parametrize(
    ("counts", "block_k"),
    [([0, 45, 32, 1, 0, 70], 64), ([16, 16, 16], 64), ([0, 45, 32, 1, 0, 70, 100], 128), ([45, 1, 70], 32)],
    ids=["ragged-empty", "short-segments", "four-blocks-a-stage", "one-block-a-stage"],
)
def test_mx_wgrad_matches_per_expert_product_of_along_r_operands(counts: list[int], block_k: int) -> None:
    """Each stage reads BLOCK_K / 32 blocks; segments padded with zero blocks to that many (``align``)."""
    G, M, N = len(counts), 24, 40
    R = sum(counts)
    align = block_k // 32
    config = dataclasses.replace(wgrad_config(DEVICE), block_k=block_k)
    p_src, q_src = spread(R, M, seed=5), spread(R + 3, N, seed=6)
    index = torch.randperm(R + 3, generator=torch.Generator().manual_seed(1))[:R]
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    block_start = segment_block_starts(starts, align=align)
    assert (block_start % align == 0).all()
    num_blocks = -(-R // 32) + G * align
    p = quantize_segments(p_src.to(DEVICE), starts, block_start, num_blocks)
    q = quantize_segments(
        q_src.to(DEVICE), starts, block_start, num_blocks, index_R=index.to(torch.int32).to(DEVICE)
    )
    out = torch.full((G, M, N), float("nan"), device=DEVICE)
    mx_wgrad(p, q, out, block_start, config=config, num_sms=num_programs(DEVICE), block_align=align)
    q_rows = q_src[index]
    for g, (pc, qc) in enumerate(zip(p_src.split(counts), q_rows.split(counts), strict=True)):
        want = fake_quantize_mx(pc, dim=0).double().t() @ fake_quantize_mx(qc, dim=0).double()
        got = out[g].double().cpu()
        if not counts[g]:
            assert (got == 0).all(), f"expert {g} has no rows: zero gradient"
            continue
        assert snr_db(got, want) >= FLOOR_DB, f"expert {g}"
        assert ((got - want).abs() / want.abs().max()).max() < REL_TOL, f"expert {g}"


def test_mx_wgrad_rejects_a_stage_deeper_than_the_block_alignment() -> None:
    starts = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    p = quantize_segments(spread(40, 16, seed=1).to(DEVICE), starts, segment_block_starts(starts), 3)
    out = torch.empty(1, 16, 16, device=DEVICE)
    config = dataclasses.replace(wgrad_config(DEVICE), block_k=64)
    with pytest.raises(ValueError, match="must divide block_align=1"):
        mx_wgrad(p, p, out, segment_block_starts(starts), config=config, num_sms=1)


@pytest.mark.parametrize("block_k", [32, 64, 128, 256])
def test_mx_grouped_gemm_any_stage_depth_matches(block_k: int) -> None:
    """BLOCK_K / 32 scaled 32-deep dots per stage (1, 2, 4, 8), K not a multiple of the stage."""
    T, KD, N, G = 24, 272, 16, 2
    idx = torch.arange(T).remainder(G).unsqueeze(1)
    plan = build_routing_plan(idx.to(DEVICE), num_experts=G, block_m=block_m(DEVICE))
    src, w = spread(T, KD, seed=3), spread(G * N, KD, seed=4).reshape(G, N, KD)
    out = torch.empty(T, N, device=DEVICE)
    config = dataclasses.replace(gemm_config(DEVICE), block_k=block_k)
    a = quantize_rows(src.to(DEVICE))
    b = quantize_mx(w.to(DEVICE), dim=-1)
    mx_grouped_gemm(a, b, out, plan, config=config, num_sms=num_programs(DEVICE), a_rows=plan.row_token_R)
    rows = plan.row_token_R.long().cpu()
    experts = torch.repeat_interleave(
        torch.arange(G), (plan.expert_start_G1[1:] - plan.expert_start_G1[:-1]).cpu()
    )
    want = torch.einsum(
        "rk,rnk->rn",
        fake_quantize_mx(src, dim=1).double()[rows],
        fake_quantize_mx(w, dim=-1).double()[experts],
    )
    assert snr_db(out.double().cpu(), want) >= FLOOR_DB


def test_mx_grouped_gemm_nan_block_poisons_only_its_rows() -> None:
    """A NaN in A gives its block the NaN scale code, which the GEMM turns into NaN (not 480 or inf)."""
    T, KD, N = 16, 64, 16
    idx = torch.zeros(T, 1, dtype=torch.int64)
    plan = build_routing_plan(idx.to(DEVICE), num_experts=1, block_m=block_m(DEVICE))
    src = spread(T, KD, seed=7)
    src[3, 5] = float("nan")
    out = torch.empty(T, N, device=DEVICE)
    b = quantize_mx(spread(N, KD, seed=8).reshape(1, N, KD).to(DEVICE), dim=-1)
    a = quantize_rows(src.to(DEVICE))
    mx_grouped_gemm(a, b, out, plan, config=gemm_config(DEVICE), num_sms=num_programs(DEVICE))
    assert a.scale[3, 0] == 255
    assert torch.isnan(out[3]).all() and torch.isfinite(out[torch.arange(T) != 3]).all()


@pytest.mark.slow
def test_mx_gemms_programs_per_sm_change_only_the_grid() -> None:
    """``programs_per_sm`` (two co-resident 4-warp programs on an H200) launches more persistent programs:
    every tile is still summed by one program in the same order, so the outputs are bitwise equal."""
    T, KD, N, G = 40, 96, 48, 3
    idx = _routing(T, 2, G, drop=0.1, empty=0, seed=5)
    plan = build_routing_plan(idx.to(DEVICE), num_experts=G, block_m=block_m(DEVICE))
    a = quantize_rows(spread(T, KD, seed=6).to(DEVICE))
    b = quantize_mx(spread(G * N, KD, seed=7).reshape(G, N, KD).to(DEVICE), dim=-1)
    outs = []
    for per_sm in (1, 3):
        out = torch.zeros(plan.row_token_R.shape[0], N, device=DEVICE)
        config = dataclasses.replace(gemm_config(DEVICE), programs_per_sm=per_sm)
        mx_grouped_gemm(a, b, out, plan, config=config, num_sms=1, a_rows=plan.row_token_R)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])

    starts = plan.expert_start_G1
    align = wgrad_config(DEVICE).block_k // 32
    block_start = segment_block_starts(starts, align=align)
    num_blocks = -(-int(starts[-1]) // 32) + G * align
    R = plan.row_token_R.shape[0]
    p = quantize_segments(spread(R, 32, seed=8).to(DEVICE), starts, block_start, num_blocks)
    q = quantize_segments(spread(R, 48, seed=9).to(DEVICE), starts, block_start, num_blocks)
    wouts = []
    for per_sm in (1, 3):
        out = torch.empty(G, 32, 48, device=DEVICE)
        config = dataclasses.replace(wgrad_config(DEVICE), programs_per_sm=per_sm)
        mx_wgrad(p, q, out, block_start, config=config, num_sms=1, block_align=align)
        wouts.append(out)
    assert torch.equal(wouts[0], wouts[1])
