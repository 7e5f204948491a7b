"""fused_mega_moe and its two stages vs the naive dense oracle, on 1, 2 and 4 real gloo ranks."""

from __future__ import annotations

import pytest
import torch

import megamoe
from megamoe import InvalidConfigError, dispatch_grouped_gemm, fused_mega_moe, grouped_gemm_combine
from tests._dist import RankFailed, run_ranks
from tests.megamoe.reference_math import dense_moe, make_case

# (tokens per rank, hidden, inter, experts, topk, skew_to): ragged T, a rank with T = 0, experts with no
# rows (skew), E not a power of two, dropped (-1) slots everywhere (drop=0.1 in make_case).
SINGLE_RANK_CASES = {
    "basic": ([13], 16, 8, 4, 2, None),
    "E=6 top-3": ([17], 8, 12, 6, 3, None),
    "empty experts": ([11], 16, 8, 5, 2, 2),
    "T=0": ([0], 16, 8, 4, 2, None),
    "topk=E": ([5], 8, 4, 3, 3, None),
}


def _grads(fn, inputs):
    out = fn(*inputs)
    if not out.requires_grad:  # the oracle builds no graph for T = 0
        return out, [torch.zeros_like(i) for i in inputs]
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    grads = torch.autograd.grad(out, inputs, dy, allow_unused=True)
    return out.detach(), [
        g if g is not None else torch.zeros_like(i) for g, i in zip(grads, inputs, strict=True)
    ]


@pytest.mark.parametrize("case", SINGLE_RANK_CASES.values(), ids=SINGLE_RANK_CASES.keys())
def test_fused_mega_moe_matches_dense_oracle_forward_and_grads(case):
    tokens, hidden, inter, experts, topk, skew = case
    c = make_case(tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=1, skew_to=skew)
    idx = c["topk_idx"][0]
    inputs = [t.clone().requires_grad_() for t in (c["x"][0], c["topk_weights"][0], c["w1"], c["w2"])]
    y, grads = _grads(lambda x, w, w1, w2: fused_mega_moe(x, idx, w, w1, w2, backend="reference"), inputs)
    y_ref, grads_ref = _grads(lambda x, w, w1, w2: dense_moe(x, idx, w, w1, w2), inputs)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    for name, g, g_ref in zip(("dx", "d_topk_weights", "dw1", "dw2"), grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_fused_mega_moe_gradcheck_float64():
    c = make_case(tokens=[6], hidden=6, inter=4, experts=3, topk=2, seed=3)
    idx = c["topk_idx"][0]
    inputs = tuple(t.clone().requires_grad_() for t in (c["x"][0], c["topk_weights"][0], c["w1"], c["w2"]))
    assert torch.autograd.gradcheck(lambda x, w, w1, w2: fused_mega_moe(x, idx, w, w1, w2), inputs)


def test_two_stages_equal_fused_op():
    c = make_case(tokens=[9], hidden=8, inter=4, experts=4, topk=2, seed=4)
    x, idx, w = c["x"][0], c["topk_idx"][0], c["topk_weights"][0]
    h, dispatch_weights, handle = dispatch_grouped_gemm(x, idx, w, c["w1"])
    y = grouped_gemm_combine(h, dispatch_weights, handle, c["w2"])
    valid_slots = int((idx >= 0).sum())
    assert h.shape == (valid_slots, 8) and dispatch_weights.shape == (valid_slots,)
    torch.testing.assert_close(y, fused_mega_moe(x, idx, w, c["w1"], c["w2"]), rtol=0, atol=0)


@pytest.mark.parametrize("used", ["h", "dispatch_weights"])
def test_stage1_gradient_reaching_one_output_only(used):
    """No gradient reaching one of stage 1's outputs counts as a zero gradient there."""
    c = make_case(tokens=[9], hidden=8, inter=4, experts=4, topk=2, seed=6)
    idx = c["topk_idx"][0]
    leaves = [t.clone().requires_grad_() for t in (c["x"][0], c["topk_weights"][0], c["w1"])]

    def loss(zero_other: bool):
        h, dispatch_weights, _ = dispatch_grouped_gemm(leaves[0], idx, leaves[1], leaves[2])
        weights = torch.linspace(-1, 1, h.numel(), dtype=h.dtype).view_as(h)
        outputs = {"h": (h * weights).sum(), "dispatch_weights": (dispatch_weights**2).sum()}
        other = "dispatch_weights" if used == "h" else "h"
        return outputs[used] + (0.0 * outputs[other] if zero_other else 0.0)

    grads = torch.autograd.grad(loss(False), leaves, allow_unused=True)
    expected = torch.autograd.grad(loss(True), leaves)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(torch.zeros_like(e) if g is None else g, e, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "mxfp8"])
def test_backward_writes_dh_over_a_private_h_only_when_the_graph_is_freed(precision):
    """A private ``h`` is dead inside stage 2's backward, so the Triton backends (interpreted here) write
    ``dh`` over it, with the same gradients, and stage 1's backward is told that its ``grad_h`` is that
    buffer, free once read; a shared ``h`` or a retained graph keeps ``h`` intact."""
    c = make_case(tokens=[13], hidden=32, inter=32, experts=3, topk=2, seed=8, dtype=torch.float32)
    idx, dy = c["topk_idx"][0], torch.randn(13, 32, generator=torch.Generator().manual_seed(9))

    def run(h_is_private: bool, retain_graph: bool):
        leaves = [t.clone().requires_grad_() for t in (c["x"][0], c["topk_weights"][0], c["w1"], c["w2"])]
        h, dispatch_weights, handle = dispatch_grouped_gemm(
            leaves[0], idx, leaves[1], leaves[2], backend="triton", precision=precision
        )
        h_before = h.detach().clone()
        grad_h = []  # what stage 1's backward receives, and whether it lives in h's memory
        h.register_hook(lambda g: grad_h.append((g.clone(), g.data_ptr() == h.data_ptr())))
        stage1_backward = handle.backend.stage1_backward
        scratch = []

        def spy(*args, grad_h_is_scratch=False):
            scratch.append(grad_h_is_scratch)
            return stage1_backward(*args, grad_h_is_scratch=grad_h_is_scratch)

        handle.backend.stage1_backward = spy
        try:
            y = grouped_gemm_combine(h, dispatch_weights, handle, leaves[3], h_is_private=h_is_private)
            y.backward(dy, retain_graph=retain_graph)
        finally:
            del handle.backend.stage1_backward
        return y, h, h_before, leaves, [leaf.grad.clone() for leaf in leaves], grad_h[0], scratch[0]

    _, h, h_before, _, expected, (dh, in_h), scratch = run(h_is_private=False, retain_graph=False)
    assert torch.equal(h, h_before) and not in_h and not scratch

    _, h, _, _, grads, (dh_private, in_h), scratch = run(h_is_private=True, retain_graph=False)
    assert in_h and scratch and torch.equal(dh_private, dh)  # dh lived in h's memory
    for g, e in zip(grads, expected, strict=True):
        assert torch.equal(g, e)

    y, h, h_before, leaves, grads, (_, in_h), scratch = run(h_is_private=True, retain_graph=True)
    assert torch.equal(h, h_before) and not in_h and not scratch
    y.backward(dy)  # the retained graph still holds the forward's h: the same gradients, accumulated
    for leaf, g, e in zip(leaves, grads, expected, strict=True):
        assert torch.equal(g, e) and torch.equal(leaf.grad, 2 * e)


def test_forward_saves_no_dispatched_copy_of_x():
    """Backward recomputes the dispatched tokens: nothing of shape [R, H] may be saved for it."""
    c = make_case(tokens=[10], hidden=8, inter=6, experts=4, topk=3, seed=5, drop=0.0)  # 2I != H
    x = c["x"][0].clone().requires_grad_()
    rows = 10 * 3
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fused_mega_moe(x, c["topk_idx"][0], c["topk_weights"][0], c["w1"], c["w2"])
    assert (rows, 8) not in saved, f"a dispatched [R={rows}, H=8] tensor was saved: {saved}"
    assert (10, 8) in saved  # the original x is what stage 1 keeps
    y.sum().backward()
    assert x.grad is not None


def test_bfloat16_close_to_float64_oracle():
    c = make_case(tokens=[32], hidden=32, inter=16, experts=4, topk=2, seed=6)
    idx = c["topk_idx"][0]
    x, w, w1, w2 = c["x"][0], c["topk_weights"][0], c["w1"], c["w2"]
    y16 = fused_mega_moe(x.bfloat16(), idx, w.float(), w1.bfloat16(), w2.bfloat16())
    y = dense_moe(x, idx, w, w1, w2)
    cos = torch.nn.functional.cosine_similarity(y16.double().flatten(), y.flatten(), dim=0)
    assert cos > 0.999


BAD_INPUTS = {
    "x not 2-D": (dict(x=torch.zeros(2, 3, 8)), "x.shape"),
    "w1 wrong H": (dict(w1=torch.zeros(4, 8, 9)), "w1.shape"),
    "w1 odd rows": (dict(w1=torch.zeros(4, 7, 8)), "w1.shape"),
    "w2 mismatched": (dict(w2=torch.zeros(4, 8, 5)), "w2.shape"),
    "idx rows": (dict(topk_idx=torch.zeros(3, 2, dtype=torch.long)), "topk_idx.shape"),
    "idx dtype": (dict(topk_idx=torch.zeros(5, 2)), "topk_idx.dtype"),
    "weights shape": (dict(topk_weights=torch.zeros(5, 3)), "topk_weights.shape"),
    "expert id >= E": (dict(topk_idx=torch.full((5, 2), 4)), "topk_idx"),
    "expert id < -1": (dict(topk_idx=torch.full((5, 2), -2)), "topk_idx"),
    "dtype mismatch": (dict(w2=torch.zeros(4, 8, 4, dtype=torch.float64)), "w2.dtype"),
}


@pytest.mark.parametrize("bad", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_fused_mega_moe_bad_input_names_the_tensor(bad):
    overrides, name = bad
    args = dict(
        x=torch.zeros(5, 8),
        topk_idx=torch.zeros(5, 2, dtype=torch.long),
        topk_weights=torch.zeros(5, 2),
        w1=torch.zeros(4, 8, 8),
        w2=torch.zeros(4, 8, 4),
    )
    args.update(overrides)
    with pytest.raises(ValueError, match=rf"^{name}"):
        fused_mega_moe(**args)


def test_public_api_is_explicit():
    assert set(megamoe.__all__) >= {"fused_mega_moe", "dispatch_grouped_gemm", "grouped_gemm_combine"}


# ---------------------------------------------------------------- multi-rank (real gloo process groups)


def _ep_rank_check(rank, world, case):
    import torch.distributed as dist

    tokens, hidden, inter, experts, topk, skew = case
    c = make_case(
        tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=11, skew_to=skew
    )
    G = experts // world
    shard = slice(rank * G, (rank + 1) * G)
    x = c["x"][rank].clone().requires_grad_()
    w = c["topk_weights"][rank].clone().requires_grad_()
    w1 = c["w1"][shard].clone().requires_grad_()
    w2 = c["w2"][shard].clone().requires_grad_()
    y = fused_mega_moe(x, c["topk_idx"][rank], w, w1, w2, group=dist.group.WORLD)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + rank), dtype=y.dtype)
    dx, dw, dw1, dw2 = torch.autograd.grad(y, (x, w, w1, w2), dy, allow_unused=True)

    # Oracle: every rank's tokens through the full weights; this rank's slice of the answers.
    W1 = c["w1"].clone().requires_grad_()
    W2 = c["w2"].clone().requires_grad_()
    xs = [t.clone().requires_grad_() for t in c["x"]]
    ws = [t.clone().requires_grad_() for t in c["topk_weights"]]
    loss = 0
    for r in range(world):
        y_r = dense_moe(xs[r], c["topk_idx"][r], ws[r], W1, W2)
        dy_r = torch.randn(y_r.shape, generator=torch.Generator().manual_seed(100 + r), dtype=y_r.dtype)
        loss = loss + (y_r * dy_r).sum()
        if r == rank:
            y_ref = y_r.detach()
    loss.backward()
    errors = {
        "y": (y - y_ref).abs().max().item() if y.numel() else 0.0,
        "dx": (dx - xs[rank].grad).abs().max().item() if dx.numel() else 0.0,
        "d_topk_weights": (dw - ws[rank].grad).abs().max().item() if dw.numel() else 0.0,
        "dw1": (dw1 - W1.grad[shard]).abs().max().item(),
        "dw2": (dw2 - W2.grad[shard]).abs().max().item(),
    }
    return errors


MULTI_RANK_CASES = {
    "2 ranks ragged T": ([9, 4], 16, 8, 4, 2, None),
    "2 ranks, one with T=0": ([0, 7], 8, 4, 6, 3, None),
    "4 ranks ragged, E=12, empty experts": ([5, 0, 8, 3], 8, 4, 12, 3, 5),
}


@pytest.mark.parametrize("case", MULTI_RANK_CASES.values(), ids=MULTI_RANK_CASES.keys())
def test_fused_mega_moe_expert_parallel_matches_dense_oracle(case, tmp_path):
    world = len(case[0])
    errors = run_ranks(_ep_rank_check, world, tmp_path, case)
    for rank, errs in enumerate(errors):
        for name, err in errs.items():
            assert err < 1e-10, f"rank {rank} {name}: max error {err:.3e}"


def _bf16_ep_rank(rank, world):
    import torch.distributed as dist

    c = make_case(tokens=[6, 9], hidden=16, inter=8, experts=4, topk=2, seed=12)
    G = 2
    args = [
        c["x"][rank],
        c["topk_weights"][rank],
        c["w1"][rank * G : (rank + 1) * G],
        c["w2"][rank * G : (rank + 1) * G],
    ]
    bf16 = [a.bfloat16().requires_grad_() for a in args]
    y = fused_mega_moe(bf16[0], c["topk_idx"][rank], *bf16[1:], group=dist.group.WORLD)
    y.float().sum().backward()
    y_ref = dense_moe(args[0], c["topk_idx"][rank], args[1], c["w1"], c["w2"])
    cos = torch.nn.functional.cosine_similarity(y.double().flatten(), y_ref.flatten(), dim=0).item()
    return cos, [t.grad is not None and t.grad.dtype == torch.bfloat16 for t in bf16]


def test_bfloat16_expert_parallel_including_bf16_routing_weights(tmp_path):
    for cos, grads_ok in run_ranks(_bf16_ep_rank, 2, tmp_path):
        assert cos > 0.999 and all(grads_ok)


def _bad_input_on_one_rank(rank, world):
    import torch.distributed as dist

    x = torch.zeros(4, 8)
    idx = torch.zeros(4, 2, dtype=torch.long)
    if rank == 1:
        idx[0, 0] = 99  # only rank 1 is wrong; rank 0 must not hang in the exchange
    try:
        fused_mega_moe(
            x, idx, torch.ones(4, 2), torch.zeros(2, 8, 8), torch.zeros(2, 8, 4), group=dist.group.WORLD
        )
    except InvalidConfigError as e:
        return str(e)
    return "no error"


def test_bad_input_on_one_rank_raises_on_every_rank_instead_of_hanging(tmp_path):
    messages = run_ranks(_bad_input_on_one_rank, 2, tmp_path, timeout=120)
    assert messages[1].startswith("topk_idx=") and "[0, E=4)" in messages[1]
    assert "another EP rank" in messages[0]


def test_run_ranks_reports_rank_traceback(tmp_path):
    with pytest.raises(RankFailed, match="ZeroDivisionError"):
        run_ranks(_divide_by_zero, 2, tmp_path, timeout=120)


def _divide_by_zero(rank, world):
    return 1 / 0
