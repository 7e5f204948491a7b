"""The benchmarks' ``grouped_gemm`` stand-in against per-expert matmuls, forward and backward, and
against what megatron-core's ``GroupedMLP`` imports from it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.train_e2e_compare import GROUPED_GEMM_SHIM


@pytest.fixture
def gg(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(GROUPED_GEMM_SHIM))
    yield importlib.import_module("grouped_gemm")
    for name in ("grouped_gemm", "grouped_gemm.ops"):  # the rest of the suite runs without it
        sys.modules.pop(name, None)


def _per_expert(a: torch.Tensor, b: torch.Tensor, sizes: list[int], trans_b: bool) -> torch.Tensor:
    rows = torch.split(a, sizes)
    return torch.cat([r @ (w.t() if trans_b else w) for r, w in zip(rows, b, strict=True)])


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("sizes", [[3, 0, 7, 1], [0, 0, 0, 5], [0, 0, 0, 0]])
def test_gmm_matches_a_matmul_per_expert(gg, sizes: list[int], trans_b: bool) -> None:
    torch.manual_seed(0)
    k, n = 16, 8
    a = torch.randn(sum(sizes), k, requires_grad=True)
    b = torch.randn(len(sizes), n if trans_b else k, k if trans_b else n, requires_grad=True)
    out = gg.ops.gmm(a, b, torch.tensor(sizes), trans_b=trans_b)
    ref_a, ref_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = _per_expert(ref_a, ref_b, sizes, trans_b) if sum(sizes) else torch.zeros(0, n)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    if sum(sizes):
        ref.backward(grad)
        torch.testing.assert_close(a.grad, ref_a.grad)
        torch.testing.assert_close(b.grad, ref_b.grad)
    empty = [e for e, s in enumerate(sizes) if s == 0]
    assert b.grad is not None and not b.grad[empty].any()  # an expert without rows gets a zero gradient


def test_gmm_takes_an_expanded_gradient_and_device_side_sizes(gg) -> None:
    a = torch.randn(6, 8, dtype=torch.bfloat16, requires_grad=True)  # rows of 16 bytes, as torch wants
    b = torch.randn(2, 8, 8, dtype=torch.bfloat16, requires_grad=True)
    gg.ops.gmm(a, b, torch.tensor([2, 4], device=a.device)).sum().backward()  # sum's gradient has stride 0
    assert a.grad is not None and b.grad is not None


def test_gmm_names_the_shapes_it_wanted(gg) -> None:
    with pytest.raises(ValueError, match=r"expected a\[M, K\], b\[E, K, N\] and batch_sizes\[E\]"):
        gg.ops.gmm(torch.zeros(4, 2), torch.zeros(3, 2, 2), torch.tensor([4]))


def test_megatron_grouped_mlp_sees_the_shim() -> None:
    """In a fresh interpreter, as the benchmark's runs get it: the shim first on ``PYTHONPATH``."""
    probe = (
        "from megatron.core.transformer.moe import grouped_gemm_util as u; import grouped_gemm.ops as o; "
        "assert u.grouped_gemm_is_available() and u.ops.gmm is o.gmm, u.ops; print(o.__file__)"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(GROUPED_GEMM_SHIM), os.environ.get("PYTHONPATH")])),
    }
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(GROUPED_GEMM_SHIM / "grouped_gemm" / "ops.py")
