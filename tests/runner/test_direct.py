"""direct mode: nproc and rendezvous from env or Slurm, checked with errors that name the variable;
node logs; the one-process step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runner.errors import ConfigError
from runner.modes import direct
from tests.runner._support import host_facts, plan, request

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


def test_port_free_one_is_picked_on_one_node_when_none_is_given() -> None:
    assert _ctx({}, free_port=lambda: 40001).master_port == "40001"
    assert _ctx({}, dry_run=True).master_port == "<FREE_PORT>"


def test_port_given_or_several_nodes_is_not_picked() -> None:
    assert _ctx({"MASTER_PORT": "29501"}, free_port=lambda: 40001).master_port == "29501"
    several = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h"}
    assert _ctx(several, free_port=lambda: 40001).master_port == "1234"  # every node can know it


def test_port_given_that_is_taken_here_is_an_error_and_a_warning_in_a_dry_run() -> None:
    taken = {"port_in_use": lambda port: port == 29501}
    with pytest.raises(ConfigError, match=r"^MASTER_PORT=29501: already in use on login1 \(another job"):
        _ctx({"MASTER_PORT": "29501"}, **taken)
    req = request("direct", SCRIPT)
    _, warnings = direct.node_context(req, host_facts(env={"MASTER_PORT": "29501"}, **taken), dry_run=True)
    assert any("MASTER_PORT=29501: already in use" in w for w in warnings)


def test_nproc_read_off_this_host_is_a_dry_run_warning() -> None:
    req = request("direct", SCRIPT)
    _, warnings = direct.node_context(req, host_facts(env={}, visible_gpus=0), dry_run=True)
    assert warnings == [
        "nproc-per-node=1 guessed from this host (no GPUs visible); set GPUS_PER_NODE or --gpus-per-node"
    ]
    _, warnings = direct.node_context(
        req, host_facts(env={"GPUS_PER_NODE": "2"}, visible_gpus=0), dry_run=True
    )
    assert warnings == []


@pytest.mark.parametrize(
    ("tokens", "run_dir", "log"),
    [
        (SCRIPT, None, "/work/job/logs/job42-node0.log"),
        (["--", "train", "pretrain", "--config", "c.yaml"], "/work/job/output/g/u/e", "/work/job/output/g/u/e/logs/job42-node0.log"),
        (["--log-dir", "mine", "--", "train", "pretrain", "--config", "c.yaml"], "/work/job/output/g/u/e", "/work/job/mine/job42-node0.log"),
    ],
    ids=["script", "run-dir", "explicit-wins"],
)  # fmt: skip
def test_node_log_goes_under_the_run_directory_unless_set(
    tokens: list[str], run_dir: str | None, log: str
) -> None:
    req = replace(request("direct", tokens), run_dir=run_dir)
    assert direct.log_file(req, _ctx({})) == log


def test_command_that_runs_once_is_one_python_process_after_the_hooks() -> None:
    p = plan("direct", ["--", "train", "prepare-data", "--input", "c.jsonl", "--output-prefix", "d/c"])
    [step] = p.steps
    assert step.kind == "python"
    assert step.argv == (
        "/src/megamoe/.venv/bin/python", "-m", "megamoe.train", "prepare-data",
        "--input", "c.jsonl", "--output-prefix", "d/c",
    )  # fmt: skip
    assert p.preflight is None and p.log_file is None and p.warnings == ()
