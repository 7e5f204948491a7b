"""The Primus-Turbo adapter: argument order, output rows, the original's limits, a missing install.

Primus-Turbo's FlyDSL kernels need an AMD MI355X GPU, so the package is replaced here by a stand-in
with the same module path and signatures (``primus_turbo.pytorch.ops.moe``) that computes with our
reference backend and pads ``y`` to a multiple of 128 rows as the original does. This is the one
mocked part; everything around it (our ops, the gloo EP group) is real.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from megamoe import UnsupportedSettingError, dispatch_grouped_gemm, fused_mega_moe, grouped_gemm_combine
from megamoe.backends import _CACHE
from tests._dist import run_ranks

FAKE_MOE = textwrap.dedent(
    '''
    """Stand-in for Primus-Turbo's MegaMoE ops (test double; the real ones need gfx950)."""
    import torch
    import torch.nn.functional as F
    from megamoe.ops import fused_mega_moe as _ref, dispatch_grouped_gemm as _s1, grouped_gemm_combine as _s2

    CALLS = []

    def _pad(y):
        rows = -(-y.shape[0] // 128) * 128
        return F.pad(y, (0, 0, 0, rows - y.shape[0]))

    def fused_mega_moe(group, x, topk_idx, topk_weights, w1, w2):
        CALLS.append(("fused", type(group).__name__))
        return _pad(_ref(x, topk_idx, topk_weights, w1, w2, group, backend="reference"))

    def fused_mega_moe_stage1(x, topk_idx, topk_weights, w1, group):
        CALLS.append(("stage1", type(group).__name__))
        return _s1(x, topk_idx, topk_weights, w1, group, backend="reference")

    def fused_mega_moe_stage2(l1_out, dispatch_weights, handle, topk_idx, topk_weights, w2, group):
        CALLS.append(("stage2", type(group).__name__))
        return _pad(_s2(l1_out, dispatch_weights, handle, w2))
    '''
)


def _install_fake_primus_turbo(root) -> None:
    pkg = root / "primus_turbo" / "pytorch" / "ops"
    pkg.mkdir(parents=True)
    for d in (root / "primus_turbo", root / "primus_turbo" / "pytorch", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "moe.py").write_text(FAKE_MOE)
    sys.path.insert(0, str(root))


def _run_with_fake(rank, world, root):
    import torch.distributed as dist

    _install_fake_primus_turbo_path(root)
    from primus_turbo.pytorch.ops import moe

    g = torch.Generator().manual_seed(rank)
    T, H, I, G, K = 128, 512, 256, 1, 2
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.randint(0, G * world, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g)
    w1 = (torch.randn(G, 2 * I, H, generator=torch.Generator().manual_seed(9)) / H**0.5).bfloat16()
    w2 = (torch.randn(G, H, I, generator=torch.Generator().manual_seed(9)) / I**0.5).bfloat16()
    group = dist.group.WORLD
    y = fused_mega_moe(x, idx, weights, w1, w2, group, backend="primus_turbo")
    h, dw, handle = dispatch_grouped_gemm(x, idx, weights, w1, group, backend="primus_turbo")
    y_staged = grouped_gemm_combine(h, dw, handle, w2)
    y_ref = fused_mega_moe(x, idx, weights, w1, w2, group, backend="reference")
    return tuple(y.shape), torch.equal(y, y_ref), torch.equal(y_staged, y_ref), list(moe.CALLS)


def _install_fake_primus_turbo_path(root) -> None:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def test_primus_turbo_backend_delegates_with_group_first_and_cuts_padding(tmp_path):
    _install_fake_primus_turbo(tmp_path)
    try:
        results = run_ranks(_run_with_fake, 2, tmp_path, tmp_path)
    finally:
        sys.path.remove(str(tmp_path))
    for shape, fused_ok, staged_ok, calls in results:
        assert shape == (128, 512) and fused_ok and staged_ok
        assert calls == [("fused", "ProcessGroup"), ("stage1", "ProcessGroup"), ("stage2", "ProcessGroup")]


LIMITS = {
    "dtype": (dict(dtype=torch.float32), "x.dtype"),
    "single rank": (dict(), "expert_model_parallel_size=1"),
}


@pytest.mark.parametrize("case", LIMITS.values(), ids=LIMITS.keys())
def test_primus_turbo_backend_names_the_broken_limit(case, tmp_path, monkeypatch):
    _install_fake_primus_turbo(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _CACHE.clear()  # every cached backend: the next call builds primus_turbo anew
    overrides, setting = case
    dtype = overrides.get("dtype", torch.bfloat16)
    args = (torch.zeros(128, 512, dtype=dtype), torch.zeros(128, 2, dtype=torch.long), torch.ones(128, 2))
    with pytest.raises(UnsupportedSettingError, match=rf"^{setting}") as info:
        fused_mega_moe(
            *args,
            torch.zeros(1, 512, 512, dtype=dtype),
            torch.zeros(1, 512, 256, dtype=dtype),
            backend="primus_turbo",
        )
    assert "backend='triton' or 'reference'" in str(info.value)
    for name in [m for m in sys.modules if m.startswith("primus_turbo")]:
        del sys.modules[name]
    _CACHE.clear()  # every cached backend: the next call builds primus_turbo anew


def test_missing_primus_turbo_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "primus_turbo", None)  # import of it now raises ImportError
    _CACHE.clear()  # every cached backend: the next call builds primus_turbo anew
    with pytest.raises(UnsupportedSettingError, match="REBUILD_PRIMUS_TURBO=1"):
        fused_mega_moe(
            torch.zeros(4, 8),
            torch.zeros(4, 1, dtype=torch.long),
            torch.ones(4, 1),
            torch.zeros(1, 8, 8),
            torch.zeros(1, 8, 4),
            backend="primus_turbo",
        )
