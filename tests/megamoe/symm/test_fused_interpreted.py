"""The fused multi-GPU path end to end on CPU: real gloo ranks, a real shared-memory workspace, the
real kernels under ``TRITON_INTERPRET=1`` (float32, tiny shapes), against the one-rank reference.

The workspace maps every rank's buffer into every process (/dev/shm files standing in for CUDA
symmetric memory), so the kernels' peer loads, stores and epoch signals run as on GPUs, with the
ranks truly concurrent. What only a GPU shows (bf16 numerics, memory ordering across NVLink, speed)
is in test_gpu_symm.py.
"""

from __future__ import annotations

import pytest
import torch

from megamoe import fused_mega_moe
from tests._dist import run_ranks
from tests.megamoe.triton.test_backend import GRADS, _case, _run

pytestmark = pytest.mark.slow  # EP ranks in Triton's interpreter: minutes together, so not in `make unit`


def _rank(rank: int, world: int, case: tuple, layers: int, dispatch: str) -> list[dict[str, torch.Tensor]]:
    import os

    import torch.distributed as dist

    from tests.megamoe.triton.interpreter_compat import install

    install()
    os.environ["MEGAMOE_EP_TRANSPORT"] = "symm"
    mode, _, flat_tail = dispatch.partition("+flat")
    os.environ["MEGAMOE_SYMM_DISPATCH"] = mode
    os.environ["MEGAMOE_SYMM_FLAT_WAIT"] = "1" if flat_tail else "0"
    os.environ["MEGAMOE_SYMM_TAIL"] = flat_tail or "25"
    os.environ["MEGAMOE_SYMM_DEBUG"] = "1"
    os.environ["MEGAMOE_SYMM_MAX_TOKENS"] = str(max(max(t.shape[0] for t in layer) for layer in case[0]))
    out = []
    for layer in range(layers):
        x, idx, tw, w1, w2, dy = (t[layer][rank] for t in case)
        G = w1.shape[0] // world
        local_w1, local_w2 = (w[rank * G : (rank + 1) * G] for w in (w1, w2))
        leaves = [t.clone().requires_grad_() for t in (x, tw, local_w1, local_w2)]
        y = fused_mega_moe(
            leaves[0], idx, leaves[1], leaves[2], leaves[3], group=dist.group.WORLD, backend="triton"
        )
        grads = torch.autograd.grad(y, leaves, dy)
        out.append(dict(zip(GRADS, (y.detach(), *grads), strict=True)))
    from megamoe.backends.symm.workspace import live_workspaces

    (ws,) = live_workspaces()  # the fused path ran, through one workspace
    assert int(ws.state[0]) == 4 * layers  # one epoch per op: 2 forward + 2 backward per layer
    return out


def _cases(tokens: list[list[int]], H: int, I: int, E: int, K: int, drop: float) -> tuple:
    """Per layer, per rank tensors (the same weights on every rank of a layer)."""
    layers = []
    for li, per_rank_T in enumerate(tokens):
        per_rank = [_case(T, H, I, E, K, drop=drop, seed=10 * li + r) for r, T in enumerate(per_rank_T)]
        w1, w2 = per_rank[0][3], per_rank[0][4]
        layers.append([[c[i] if i not in (3, 4) else (w1, w2)[i - 3] for c in per_rank] for i in range(6)])
    return tuple([layer[i] for layer in layers] for i in range(6))


def _check(results, case, world: int) -> None:
    for li in range(len(case[0])):
        per_rank = [tuple(t[li][r] for t in case) for r in range(world)]
        refs = [_run("reference", *c) for c in per_rank]
        for r in range(world):
            for name in ("y", "dx", "d_topk_weights"):
                torch.testing.assert_close(
                    results[r][li][name],
                    refs[r][name],
                    rtol=1e-4,
                    atol=1e-5,
                    msg=f"layer {li} rank {r} {name}",
                )
        for name in ("dw1", "dw2"):
            total = sum(ref[name] for ref in refs)
            ours = torch.cat([results[r][li][name] for r in range(world)])
            torch.testing.assert_close(ours, total, rtol=1e-4, atol=1e-5, msg=f"layer {li} {name}")


DISPATCH = pytest.mark.parametrize("dispatch", ["push", "pull"])
# and push with flattened fixed-stride GEMM programs: no tail, a quarter, every tile from the counter
LAYER_DISPATCH = pytest.mark.parametrize(
    "dispatch", ["push", "pull", "broadcast", "push+flat0", "push+flat25", "push+flat100"]
)


@LAYER_DISPATCH
@pytest.mark.parametrize(
    ("tokens", "drop"),
    [([[11, 6]], 0.1), ([[9, 0]], 0.0)],
    ids=["ragged-tokens-drops", "one-rank-no-tokens"],
)
def test_fused_ep2_matches_reference(tmp_path, tokens, drop, dispatch) -> None:
    case = _cases(tokens, H=24, I=16, E=4, K=2, drop=drop)
    _check(run_ranks(_rank, 2, tmp_path, case, len(tokens), dispatch, timeout=600), case, 2)


@LAYER_DISPATCH
def test_back_to_back_layers_reuse_one_workspace(tmp_path, dispatch) -> None:
    """Three layers with new routing each: every op overwrites the pools the previous one used."""
    case = _cases([[7, 5], [4, 9], [8, 8]], H=16, I=8, E=4, K=2, drop=0.2)
    _check(run_ranks(_rank, 2, tmp_path, case, 3, dispatch, timeout=600), case, 2)


@pytest.mark.parametrize("dispatch", ["push", "broadcast"])
@pytest.mark.parametrize(
    ("world", "tokens"), [(8, [3, 5, 0, 4, 6, 2, 5, 3])], ids=["ep8"]
)  # the flat waits' limit
def test_larger_ep_groups(tmp_path, world, tokens, dispatch) -> None:
    """EP = 4 and 8 (the most one node holds): every rank sends to every peer and to itself."""
    case = _cases([tokens], H=16, I=8, E=2 * world, K=3, drop=0.1)
    _check(run_ranks(_rank, world, tmp_path, case, 1, dispatch, timeout=600), case, world)


def _stuck_peer_rank(rank: int, world: int, case: tuple) -> str:
    import os

    import torch.distributed as dist

    from megamoe.backends.symm.workspace import SymmTimeoutError, get_workspace
    from megamoe.settings import SymmSettings
    from tests.megamoe.triton.interpreter_compat import install

    install()
    os.environ.update(
        MEGAMOE_EP_TRANSPORT="symm",
        MEGAMOE_SYMM_DEBUG="1",
        MEGAMOE_SYMM_WAIT_SPINS="300",
        MEGAMOE_SYMM_MAX_TOKENS="6",
    )
    x, idx, tw, w1, w2, _ = (t[0][rank] for t in case)
    if rank == 1:  # joins the input check and the workspace allocation, then never calls the op
        dist.all_reduce(torch.zeros(1, dtype=torch.int32), op=dist.ReduceOp.MAX)
        get_workspace(
            dist.group.WORLD,
            num_tokens=x.shape[0],
            topk=2,
            num_experts=4,
            hidden=16,
            dtype=x.dtype,
            device=x.device,
            settings=SymmSettings.from_env(),
        )
        return ""
    with pytest.raises(SymmTimeoutError) as err:
        fused_mega_moe(x, idx, tw, w1[:2], w2[:2], group=dist.group.WORLD, backend="triton")
    return str(err.value)


def test_debug_mode_turns_a_stuck_peer_into_an_error_naming_the_wait(tmp_path) -> None:
    case = _cases([[6, 6]], H=16, I=8, E=4, K=2, drop=0.0)
    message = run_ranks(_stuck_peer_rank, 2, tmp_path, case, timeout=300)[0]
    assert "arrive[1] on EP rank 0" in message and "expected >= 1" in message


def _too_many_tokens_rank(rank: int, world: int, case: tuple) -> str:
    import os

    import torch.distributed as dist

    from megamoe.backends.symm.workspace import SymmCapacityError, SymmTimeoutError
    from tests.megamoe.triton.interpreter_compat import install

    install()
    os.environ.update(
        MEGAMOE_EP_TRANSPORT="symm",
        MEGAMOE_SYMM_DEBUG="1",
        MEGAMOE_SYMM_WAIT_SPINS="300",
        MEGAMOE_SYMM_MAX_TOKENS="5",
    )
    x, idx, tw, w1, w2, _ = (t[0][rank] for t in case)
    errors = (SymmCapacityError, SymmTimeoutError)
    with pytest.raises(errors) as err:
        fused_mega_moe(
            x,
            idx,
            tw,
            w1[rank * 2 : rank * 2 + 2],
            w2[rank * 2 : rank * 2 + 2],
            group=dist.group.WORLD,
            backend="triton",
        )
    return f"{type(err.value).__name__}: {err.value}"


def test_more_tokens_than_the_workspace_holds_is_refused_with_the_numbers(tmp_path) -> None:
    """Rank 0 refuses before moving a row; its peer, left waiting, gives up in debug mode."""
    case = _cases([[7, 3]], H=16, I=8, E=4, K=2, drop=0.0)
    first, second = run_ranks(_too_many_tokens_rank, 2, tmp_path, case, timeout=300)
    assert first.startswith("SymmCapacityError: tokens on this EP rank=7")
    assert "holds 5 tokens per rank" in first and "MEGAMOE_SYMM_MAX_TOKENS>=7" in first
    assert second.startswith("SymmTimeoutError") and "arrive[0] on EP rank 1" in second


def _comm_only_rank(rank: int, world: int, case: tuple, num_comm: int, dispatch: str) -> bool:
    """The comm role alone (no GEMM tiles, so no program waits; the CPU grid is 4 programs)."""
    import os

    import torch.distributed as dist

    from megamoe.backends.exchange import TokenExchange
    from megamoe.backends.symm import launch
    from megamoe.backends.symm.backend import SymmBackend, rows_to_move
    from megamoe.settings import SymmSettings
    from tests.megamoe.triton.interpreter_compat import install

    install()
    os.environ["MEGAMOE_SYMM_DISPATCH"] = dispatch
    x, idx, tw, w1, _, _ = (t[0][rank] for t in case)
    E, group = w1.shape[0], dist.group.WORLD
    backend = SymmBackend(SymmSettings.from_env())
    plan = backend.make_plan(idx, num_experts=E, group=group)
    backend.exchange(plan, x, tw)
    ws = plan.ws
    launch.fused_gemm(
        ws,
        op="gemm1",
        a_RK=ws.view("pool"),
        b=w1[: E // world],
        b_kn=False,
        tiles_X3=plan.layout.tiles_X3,
        num_tiles_1=torch.zeros(1, dtype=torch.int32),
        out_RN=torch.empty(ws.pool_rows, w1.shape[1]),
        push=rows_to_move(plan, x, tw),
        num_comm=num_comm,
    )
    dist.barrier()  # every rank's pushes are done (kernels run synchronously on the CPU)
    expected = TokenExchange.build(idx, num_experts=E, group=group).dispatch_tokens(x)
    lay = plan.layout
    received = int(lay.expert_start_G1[-1])
    # each expert's rows come own rank first in the pool, sources ascending in TokenExchange's order
    expert = torch.searchsorted(lay.expert_start_G1[1:], torch.arange(received), right=True)
    order = torch.sort(expert * world + lay.row_src_R[:received], stable=True).indices
    flags_set = bool((ws.view("pool_ready") == ws.state[0]).all())
    return torch.equal(ws.view("pool")[:received][order], expected) and flags_set and not ws.task_done.any()


@DISPATCH
@pytest.mark.parametrize(
    "num_comm", [3, 4, 7], ids=["one-per-peer-one-idle", "two-per-peer", "three-per-peer"]
)
def test_comm_programs_split_each_task_and_the_last_one_signals(tmp_path, num_comm, dispatch) -> None:
    case = _cases([[9, 6]], H=24, I=8, E=6, K=2, drop=0.1)
    assert all(run_ranks(_comm_only_rank, 2, tmp_path, case, num_comm, dispatch, timeout=300))


def _overflow_rank(rank: int, world: int, case: tuple) -> str:
    """Every token of both ranks routes to rank 0's two experts: 32 rows against a pool of 16."""
    import os

    import torch.distributed as dist

    from megamoe.backends.symm.workspace import SymmCapacityError, check_capacity
    from tests.megamoe.triton.interpreter_compat import install

    install()
    os.environ.update(MEGAMOE_EP_TRANSPORT="symm", MEGAMOE_SYMM_CAPACITY="1", MEGAMOE_SYMM_MAX_TOKENS="8")
    x, _, tw, w1, w2, dy = (t[0][rank] for t in case)
    idx = torch.tensor([[0, 1]] * x.shape[0])
    leaves = [
        t.clone().requires_grad_() for t in (x, tw, w1[rank * 2 : rank * 2 + 2], w2[rank * 2 : rank * 2 + 2])
    ]
    y = fused_mega_moe(
        leaves[0], idx, leaves[1], leaves[2], leaves[3], group=dist.group.WORLD, backend="triton"
    )
    torch.autograd.grad(y, leaves, dy)  # the whole step runs on both ranks: no deadlock past the cap
    try:
        check_capacity()
    except SymmCapacityError as err:
        return str(err)
    return ""


def test_rows_past_the_capacity_are_reported_with_the_numbers(tmp_path) -> None:
    """Rank 0 gets twice what its pool holds; the step finishes, then the check names rank, rows and fix."""
    case = _cases([[8, 8]], H=16, I=8, E=4, K=2, drop=0.0)
    first, second = run_ranks(_overflow_rank, 2, tmp_path, case, timeout=300)
    assert first.startswith("routed rows on EP rank 0=32")
    assert "holds 16 rows per rank (MEGAMOE_SYMM_CAPACITY=1 x 8 tokens x top-2)" in first
    assert "MEGAMOE_SYMM_CAPACITY>=2.00" in first
    assert second == ""  # rank 1 received nothing


def _traced_rank(rank: int, world: int, case: tuple) -> tuple[list[list[int]], int]:
    """Stage 1 forward with ``MEGAMOE_SYMM_TRACE=1``: the timeline and the tiles past the fixed-stride share."""
    import os

    import torch.distributed as dist

    from megamoe.backends.symm import launch
    from megamoe.backends.symm.backend import SymmBackend
    from megamoe.backends.triton.configs import gemm_config
    from megamoe.settings import SymmSettings
    from tests.megamoe.triton.interpreter_compat import install

    install()
    os.environ.update(
        MEGAMOE_SYMM_TRACE="1",
        MEGAMOE_SYMM_FLAT_WAIT="1",
        MEGAMOE_SYMM_TAIL="25",
        MEGAMOE_SYMM_DISPATCH="push",
    )
    x, idx, tw, w1, _, _ = (t[0][rank] for t in case)
    E = w1.shape[0]
    backend = SymmBackend(SymmSettings.from_env())
    plan = backend.make_plan(idx, num_experts=E, group=dist.group.WORLD)
    h = backend.stage1_forward(x, tw, w1[rank * 2 : rank * 2 + 2], plan)[0]
    total = int(plan.layout.num_tiles_1) * -(-h.shape[1] // gemm_config("gemm1", x.device).block_n)
    return launch.program_timeline(plan.ws).tolist(), total - (total - (total * 25 + 99) // 100)


def test_the_traced_timeline_accounts_for_every_counter_tile(tmp_path) -> None:
    """One row per program; the counter tiles taken add up to the launch's tail (timestamps are 0 here)."""
    case = _cases([[12, 9]], H=16, I=8, E=4, K=2, drop=0.0)
    for timeline, tail in run_ranks(_traced_rank, 2, tmp_path, case, timeout=300):
        assert len(timeline) >= 2 and all(len(row) == 5 for row in timeline)
        assert sum(row[4] for row in timeline) == tail > 0
        assert all(row[:4] == [0, 0, 0, 0] for row in timeline)  # no GPU timer in the interpreter
