"""The fused EP steps as custom ops (``megamoe.backends.symm.ops``) on CPU: real gloo ranks, the
workspace in host shared memory, the kernels under ``TRITON_INTERPRET=1`` (as test_fused_interpreted.py).

* every op's fake implementation gives the shapes and dtypes of its real outputs, with the pool size
  taken from ``MEGAMOE_SYMM_MAX_TOKENS`` before the workspace exists;
* ``torch.compile(fullgraph=True)`` of the whole layer, forward and backward, gives eager's bits;
* the two-stage API (``dispatch_grouped_gemm`` then ``grouped_gemm_combine``, what ``MegaMoELayer``
  calls), whose handle carries stage 1's layout, gives the fused op's bits.

The GPU run of the compiled layer (inductor) is in test_gpu_symm.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from megamoe.backends.symm import ops as symm_ops
from megamoe.backends.symm.workspace import WorkspaceKey, pool_rows
from megamoe.errors import InvalidConfigError
from megamoe.settings import SymmSettings
from tests._dist import run_ranks
from tests.megamoe.triton.test_backend import GRADS, _case

H, I, E, K = 24, 16, 4, 2
TOKENS = (11, 6)  # ragged over the two ranks


def _setup(rank: int, world: int):
    import os

    import torch.distributed as dist

    from tests.megamoe.triton.interpreter_compat import install

    install()
    os.environ["MEGAMOE_EP_TRANSPORT"] = "symm"
    os.environ["MEGAMOE_SYMM_MAX_TOKENS"] = str(max(TOKENS))
    x, idx, tw, w1, w2, dy = _case(TOKENS[rank], H, I, E, K, drop=0.1, seed=rank)
    w1, w2 = (
        w[rank * (E // world) : (rank + 1) * (E // world)] for w in _case(8, H, I, E, K, drop=0, seed=7)[3:5]
    )
    return dist.group.WORLD, x, idx, tw, w1, w2, dy


def _meta(ts) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in ts]


def _fake_vs_real_rank(rank: int, world: int) -> dict[str, tuple]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    group, x, idx, tw, w1, w2, dy = _setup(rank, world)
    name, T = group.group_name, x.shape[0]
    mode = FakeTensorMode()

    def fake(op, *args):
        def conv(a):
            if isinstance(a, torch.Tensor):
                return mode.from_tensor(a)
            if isinstance(a, list):
                return [conv(t) for t in a]
            return a

        with mode:  # the registered op (eager calls skip it): its fake implementation runs
            out = op.op(*[conv(a) for a in args])
        return _meta(out if isinstance(out, (list, tuple)) else [out])

    report = {}
    # before the first op: the fake stage 1 sizes the pool from MEGAMOE_SYMM_MAX_TOKENS
    settings = SymmSettings.from_env().to_json()
    report["stage1_forward"] = (fake(symm_ops.stage1_forward, x, idx, tw, w1, name, E, settings),)
    h, weights, *state = symm_ops.stage1_forward(x, idx, tw, w1, name, E, settings)
    report["stage1_forward"] += (_meta([h, weights, *state]),)
    args2 = (h, weights, w2, state, name, E, T, K)
    y = symm_ops.stage2_forward(*args2)
    report["stage2_forward"] = (fake(symm_ops.stage2_forward, *args2), _meta([y]))
    dh_in = torch.randn_like(h)
    for needs in ((True, True, True), (False, True, False)):
        args = (h, weights, w2, dy, state, name, E, K, *needs)
        report[f"stage2_backward {needs}"] = (
            fake(symm_ops.stage2_backward, *args),
            _meta(symm_ops.stage2_backward(*args)),
        )
        args = (x, w1, dh_in, weights, state, name, E, K, *needs)
        report[f"stage1_backward {needs}"] = (
            fake(symm_ops.stage1_backward, *args),
            _meta(symm_ops.stage1_backward(*args)),
        )
    return report


def test_every_fake_implementation_matches_its_op(tmp_path) -> None:
    for rank, report in enumerate(run_ranks(_fake_vs_real_rank, 2, tmp_path, timeout=600)):
        for op, (fake, real) in report.items():
            assert fake == real, f"rank {rank} {op}: fake {fake} != real {real}"


def _compiled_rank(rank: int, world: int) -> dict[str, bool]:
    from torch._dynamo.testing import CompileCounterWithBackend

    from megamoe import fused_mega_moe

    os.environ.pop("TORCHDYNAMO_DISABLE", None)  # the rank workers start with dynamo off (tests/_dist.py)
    torch._dynamo.config.disable = False
    group, x, idx, tw, w1, w2, dy = _setup(rank, world)

    def layer(x, tw, w1, w2):
        return fused_mega_moe(x, idx, tw, w1, w2, group=group, backend="triton")

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    outs = []
    for fn in (layer, compiled):
        leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
        y = fn(*leaves)
        outs.append((y.detach(), *torch.autograd.grad(y, leaves, dy)))
    report = {name: torch.equal(eager, got) for name, eager, got in zip(GRADS, *outs, strict=True)}
    return {**report, "traced once": counter.frame_count == 1}


@pytest.mark.slow
def test_the_layer_compiles_as_one_graph_with_eager_bits(tmp_path) -> None:
    for rank, report in enumerate(run_ranks(_compiled_rank, 2, tmp_path, timeout=600)):
        assert all(report.values()), f"rank {rank}: compiled differs from eager: {report}"


def test_tracing_before_the_workspace_exists_needs_its_size() -> None:
    key = WorkspaceKey("no-such-group", K, E, H, torch.float32)
    with pytest.raises(InvalidConfigError, match="MEGAMOE_SYMM_MAX_TOKENS"):
        pool_rows(key, 2, SymmSettings())
    assert (
        pool_rows(key, 2, SymmSettings(max_tokens=10)) == 2 * 10 * K
    )  # capacity 2: the worst case at EP = 2


def _two_stage_rank(rank: int, world: int) -> dict[str, bool]:
    from megamoe import dispatch_grouped_gemm, fused_mega_moe, grouped_gemm_combine

    group, x, idx, tw, w1, w2, dy = _setup(rank, world)

    def two_stage(x, tw, w1, w2):  # what MegaMoELayer calls: the handle carries stage 1's layout
        h, dispatch_weights, handle = dispatch_grouped_gemm(x, idx, tw, w1, group, backend="triton")
        return grouped_gemm_combine(h, dispatch_weights, handle, w2)

    def fused(x, tw, w1, w2):
        return fused_mega_moe(x, idx, tw, w1, w2, group=group, backend="triton")

    outs = []
    for fn in (fused, two_stage):
        leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2)]
        y = fn(*leaves)
        outs.append((y.detach(), *torch.autograd.grad(y, leaves, dy)))
    return {name: torch.equal(a, b) for name, a, b in zip(GRADS, *outs, strict=True)}


def test_the_two_stage_api_gives_the_fused_op_bits(tmp_path) -> None:
    for rank, report in enumerate(run_ranks(_two_stage_rank, 2, tmp_path, timeout=600)):
        assert all(report.values()), f"rank {rank}: two stages differ from the fused op: {report}"
