"""The Triton backend's kernels against the reference backend, in float32 under TRITON_INTERPRET=1.

Tiny shapes keep the interpreter fast; bf16 numerics at the real shapes are in test_gpu_backend.py.
H and I are multiples of 8 but not of the tiles (ragged N and K), experts get 0..many rows, slots drop.
"""

from __future__ import annotations

import pytest
import torch

from megamoe import dispatch_grouped_gemm, fused_mega_moe, grouped_gemm_combine
from megamoe.backends import resolve_backend_name
from tests._dist import run_ranks

GRADS = ("y", "dx", "d_topk_weights", "dw1", "dw2")


def _case(T: int, H: int, I: int, G: int, K: int, *, drop: float, empty: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = torch.randint(0, G, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    idx[idx < empty] = -1
    tw = torch.rand(T, K, generator=g)
    w1 = torch.randn(G, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(G, H, I, generator=g) / I**0.5
    dy = torch.randn(T, H, generator=g)
    return x, idx, tw, w1, w2, dy


def _run(backend: str, x, idx, tw, w1, w2, dy) -> dict[str, torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
    y = fused_mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend=backend)
    grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return dict(zip(GRADS, (y.detach(), *grads), strict=True))


@pytest.mark.parametrize(
    ("T", "H", "I", "G", "K", "drop", "empty"),
    [(23, 24, 40, 5, 3, 0.15, 2), (16, 32, 16, 3, 2, 0.0, 0), (9, 8, 8, 4, 4, 1.0, 0)],
    ids=["ragged-drops-empty-experts", "full-tiles", "all-slots-dropped"],
)
def test_triton_fused_matches_reference_fp32(
    T: int, H: int, I: int, G: int, K: int, drop: float, empty: int
) -> None:
    case = _case(T, H, I, G, K, drop=drop, empty=empty)
    ours, ref = _run("triton", *case), _run("reference", *case)
    for name in GRADS:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_triton_stages_match_reference_and_pad_dropped_rows_with_zeros() -> None:
    x, idx, tw, w1, w2, _ = _case(21, 16, 24, 4, 2, drop=0.3)
    h, weights, handle = dispatch_grouped_gemm(x, idx, tw, w1, backend="triton")
    h_ref, weights_ref, handle_ref = dispatch_grouped_gemm(x, idx, tw, w1, backend="reference")
    rows = h_ref.shape[0]
    assert h.shape == (21 * 2, 48)  # static: every slot has a row, dropped ones at the end
    torch.testing.assert_close(h[:rows], h_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights[:rows], weights_ref)
    assert not h[rows:].any() and not weights[rows:].any()
    y = grouped_gemm_combine(h, weights, handle, w2)
    torch.testing.assert_close(
        y, grouped_gemm_combine(h_ref, weights_ref, handle_ref, w2), rtol=1e-4, atol=1e-5
    )


def test_triton_no_tokens_gives_empty_output_and_zero_weight_grads() -> None:
    out = _run("triton", *_case(0, 16, 8, 3, 2, drop=0.0))
    assert out["y"].shape == (0, 16) and out["dx"].shape == (0, 16)
    assert not out["dw1"].any() and not out["dw2"].any()


def test_triton_same_bits_every_run() -> None:
    case = _case(19, 16, 24, 3, 3, drop=0.1, seed=3)
    first, again = _run("triton", *case), _run("triton", *case)
    for name in GRADS:
        assert torch.equal(first[name], again[name]), name


def test_dw1_from_x_gathered_in_column_chunks_has_the_same_bits(monkeypatch) -> None:
    """dW1's gathered ``x`` in three column chunks (the last one ragged), each gathered beside the wgrad
    of the one before: the same gradients, bit for bit, as from one gather of every column."""
    from megamoe.backends.triton import configs

    case = _case(23, 40, 24, 4, 3, drop=0.15, empty=1, seed=5)
    whole = _run("triton", *case)
    monkeypatch.setattr(configs, "WGRAD_OPERAND_CHUNK_BYTES", 1)
    assert configs.column_chunks(69, 40, 4, 16) == [(0, 16), (16, 32), (32, 40)]
    chunked = _run("triton", *case)
    for name in GRADS:
        assert torch.equal(chunked[name], whole[name]), name


def test_auto_backend_is_triton_for_cuda_bf16_and_reference_elsewhere() -> None:
    assert resolve_backend_name("auto", device=torch.device("cuda"), dtype=torch.bfloat16) == "triton"
    assert resolve_backend_name("auto", device=torch.device("cuda"), dtype=torch.float32) == "reference"
    assert resolve_backend_name("auto", device=torch.device("cpu"), dtype=torch.bfloat16) == "reference"


def _ep_rank(rank: int, world: int, case: tuple) -> dict[str, torch.Tensor]:
    from tests.megamoe.triton.interpreter_compat import install

    install()
    x, idx, tw, w1, w2, dy = (t[rank] for t in case)
    import torch.distributed as dist

    G = w1.shape[0] // world
    local_w1, local_w2 = (w[rank * G : (rank + 1) * G] for w in (w1, w2))
    leaves = [t.clone().requires_grad_() for t in (x, tw, local_w1, local_w2)]
    y = fused_mega_moe(
        leaves[0], idx, leaves[1], leaves[2], leaves[3], group=dist.group.WORLD, backend="triton"
    )
    grads = torch.autograd.grad(y, leaves, dy)
    return dict(zip(GRADS, (y.detach(), *grads), strict=True))


def test_triton_ep2_over_gloo_matches_one_rank_reference(tmp_path) -> None:
    per_rank = [_case(T, 16, 8, 4, 2, drop=0.1, seed=s) for s, T in ((1, 11), (2, 6))]
    w1, w2 = per_rank[0][3], per_rank[0][4]
    case = tuple([c[i] if i not in (3, 4) else (w1, w2)[i - 3] for c in per_rank] for i in range(6))
    results = run_ranks(_ep_rank, 2, tmp_path, case)
    for rank, got in enumerate(results):
        x, idx, tw, _, _, dy = (t[rank] for t in case)
        ref = _run("reference", x, idx, tw, w1, w2, dy)
        for name in ("y", "dx", "d_topk_weights"):
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")
    # weight grads: each rank holds its experts' slice of the one-rank gradient summed over both ranks' tokens
    full = [_run("reference", *(t[r] for t in case[:3]), w1, w2, case[5][r]) for r in range(2)]
    for name in ("dw1", "dw2"):
        total = full[0][name] + full[1][name]
        torch.testing.assert_close(
            torch.cat([results[0][name], results[1][name]]), total, rtol=1e-4, atol=1e-5
        )
