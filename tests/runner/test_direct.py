"""direct mode: nproc and rendezvous from env or Slurm, checked with errors that name the variable."""

from __future__ import annotations

import pytest

from runner.errors import ConfigError
from runner.modes import direct
from tests.runner._support import host_facts, request

SCRIPT = ["--", "--script", "a.py"]


def _ctx(env: dict[str, str], dry_run: bool = False, **host: object) -> direct.NodeContext:
    facts = host_facts(env=env, **host)
    return direct.node_context(request("direct", SCRIPT), facts, dry_run=dry_run)[0]


@pytest.mark.parametrize(
    ("env", "visible", "nproc"),
    [({}, 0, "1"), ({}, 8, "8"), ({"GPUS_PER_NODE": "2"}, 0, "2"), ({"GPUS_PER_NODE": "4"}, 8, "4")],
    ids=["no-gpu", "visible", "env-cpu", "env-wins"],
)
def test_nproc_per_node_defaults(env: dict[str, str], visible: int, nproc: str) -> None:
    assert _ctx(env, visible_gpus=visible).nproc == nproc


def test_slurm_step_derives_rank_nodes_and_first_host_as_master() -> None:
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "node[1-3]",
        "SLURMD_NODENAME": "node2",
        "SLURM_JOB_ID": "77",
    }
    ctx = _ctx(env)
    assert (ctx.nnodes, ctx.node_rank, ctx.master_addr, ctx.master_port) == ("3", "1", "node1", "20077")


def test_slurm_user_master_addr_that_is_not_the_first_node_is_an_error() -> None:
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURMD_NODENAME": "node2",
        "SLURM_JOB_ID": "1",
    }
    with pytest.raises(ConfigError, match="MASTER_ADDR=node2: not the first node"):
        _ctx({**env, "MASTER_ADDR": "node2"})


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK=2: must be in 0..1"),
        ({"MASTER_PORT": "80"}, "MASTER_PORT=80: out of range"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: out of range"),
        ({"NNODES": "two"}, "NNODES='two': not an integer"),
        ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE=0"),
    ],
    ids=["rank", "port-low", "port-high", "nnodes", "gpus"],
)
def test_bad_rendezvous_settings_are_clear_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _ctx(env)


def test_unresolvable_master_is_an_error_and_a_warning_in_a_dry_run() -> None:
    with pytest.raises(ConfigError, match="does not resolve"):
        _ctx({"MASTER_ADDR": "nohost"}, resolves=lambda h: False)
    req = request("direct", SCRIPT)
    _, warnings = direct.node_context(
        req, host_facts(env={"MASTER_ADDR": "nohost"}, resolves=lambda h: False), dry_run=True
    )
    assert any("does not resolve" in w for w in warnings)


def test_node_log_is_unique_per_node() -> None:
    req = request("direct", SCRIPT)
    logs = {
        direct.log_file(req, _ctx({"NNODES": "2", "NODE_RANK": r, "MASTER_ADDR": "h"})) for r in ("0", "1")
    }
    assert len(logs) == 2


def test_batch_script_without_srun_runs_one_node_and_says_so() -> None:
    facts = host_facts(env={"SLURM_JOB_ID": "5", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"})
    ctx, warnings = direct.node_context(request("direct", SCRIPT), facts, dry_run=False)
    assert ctx.nnodes == "1"
    assert any("not in an srun step" in w for w in warnings)
