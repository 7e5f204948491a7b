"""The chain grammar: Primus's forms parse to one request; mistakes get errors that say what to type."""

from __future__ import annotations

import pytest

from runner import chain
from runner.errors import ConfigError
from tests.runner._support import request


@pytest.mark.parametrize(
    "flags",
    [["-N", "4"], ["-N4"], ["--nodes", "4"], ["--nodes=4"]],
    ids=["short", "short-joined", "long", "long-equals"],
)
def test_slurm_flags_every_spelling_of_nodes_is_one_flag(flags: list[str]) -> None:
    req = request("slurm", ["srun", *flags, "--", "direct", "--", "--script", "a.py"])
    assert dict(req.slurm_flags)["nodes"] == "4"
    assert [k for k, _ in req.slurm_flags].count("nodes") == 1


def test_slurm_flags_cli_wins_over_config_and_no_time_limit_is_injected(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("slurm: {nodes: 2, partition: cpu}\n")
    req = request("slurm", ["srun", "--nodes=8", "--", "direct", "--", "--script", "a.py"], config_file=cfg)
    flags = dict(req.slurm_flags)
    assert flags["nodes"] == "8"
    assert flags["partition"] == "cpu"
    assert "time" not in flags


def test_slurm_entry_defaults_to_container_when_the_command_follows_the_separator() -> None:
    req = request("slurm", ["srun", "-N", "2", "--", "train", "pretrain", "--config", "x.yaml"])
    assert req.chain == ("slurm", "container", "direct")
    assert req.launcher == "srun"


def test_slurm_without_separator_is_an_error_that_shows_the_form() -> None:
    with pytest.raises(ConfigError, match="missing '--'"):
        request("slurm", ["srun", "-N", "2", "direct"])


@pytest.mark.parametrize("flag", ["--ntasks=4", "--ntasks-per-node=8"])
def test_slurm_more_than_one_task_per_node_is_rejected(flag: str) -> None:
    with pytest.raises(ConfigError, match="one task per node"):
        request("slurm", ["srun", flag, "--", "direct", "--", "--script", "a.py"])


@pytest.mark.parametrize(
    ("mode", "tokens", "chain_"),
    [
        ("direct", ["--", "train", "pretrain", "--config", "x"], ("direct",)),
        ("direct", ["train", "pretrain", "--config", "x"], ("direct",)),
        (
            "container",
            ["--image", "i", "--", "--env", "A=1", "--", "--script", "s.py"],
            ("container", "direct"),
        ),
        ("container", ["--image", "i", "train", "pretrain"], ("container", "direct")),
    ],
    ids=["direct-sep", "direct-nosep", "container-inner-direct-opts", "container-nosep"],
)
def test_chain_primus_forms_parse(mode: str, tokens: list[str], chain_: tuple[str, ...]) -> None:
    req = request(mode, tokens, env={"A": "1"})
    assert req.chain == chain_


def test_command_trainer_options_after_the_command_are_not_launcher_options() -> None:
    req = request("direct", ["--", "train", "pretrain", "--config", "x.yaml", "--dry-run", "--image", "z"])
    assert req.command.argv == ("train", "pretrain", "--config", "x.yaml", "--dry-run", "--image", "z")


def test_command_unknown_is_an_error_naming_both_forms() -> None:
    with pytest.raises(ConfigError, match="--script FILE"):
        request("direct", ["--", "python", "x.py"])


def test_mode_unknown_option_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError, match="Did you mean --image"):
        request("container", ["--imgae", "x", "--", "--script", "a.py"])


def test_env_option_keeps_only_the_name_in_the_request() -> None:
    parsed = chain.parse_chain("direct", ["--env", "TOKEN=s3cret", "--", "--script", "a.py"])
    req = chain.make_request(
        parsed, request("direct", ["--script", "a.py"]).config, {"TOKEN": "s3cret"}, cwd="/w"
    )
    assert req.env_names == ("TOKEN",)
    assert "s3cret" not in str(req.to_dict())


def test_request_round_trips_through_json() -> None:
    req = request("slurm", ["srun", "-N", "2", "--", "container", "-v", "/a:/b", "--", "--script", "a.py"])
    assert chain.Request.from_dict(req.to_dict()) == req


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-N", "abc"], "primus-cli slurm: -N abc: --nodes must be a positive integer (e.g. 2), got 'abc'."),
        (["--nodes=0"], "--nodes=0: --nodes must be a positive integer"),
        (["-N-2"], "-N-2: --nodes must be a positive integer"),
        (["--cpus-per-task", "x"], "--cpus-per-task x: --cpus-per-task must be a positive integer"),
        (["--ntasks-per-node=two"], "--ntasks-per-node=two: --ntasks-per-node must be a positive integer"),
        (["--gpus-per-node=mi300x:"], "--gpus-per-node must be a positive integer ([type:]N"),
    ],
    ids=["nodes-word", "nodes-zero", "nodes-negative", "cpus", "tasks", "gpus"],
)
def test_slurm_count_flags_must_be_positive_integers(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        request("slurm", ["srun", *flags, "--", "direct", "--", "--script", "a.py"])
    assert message in err.value.format_message()


def test_slurm_gpu_counts_may_name_the_gpu_type() -> None:
    req = request("slurm", ["srun", "--gpus-per-node=mi300x:8", "--", "direct", "--", "--script", "a.py"])
    assert dict(req.slurm_flags)["gpus-per-node"] == "mi300x:8"


@pytest.mark.parametrize("option", ["--gpus-per-node", "--master-port", "--hook-timeout"])
@pytest.mark.parametrize("value", ["0", "abc", "-1"])
def test_direct_count_options_must_be_positive_integers(option: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{option} {value}: expected a positive integer"):
        request("direct", [f"{option}={value}", "--", "--script", "a.py"])


PREPARE = ["train", "prepare-data", "--input", "c.jsonl", "--output-prefix", "d/c"]


@pytest.mark.parametrize("launcher", ["srun", "sbatch"])
def test_slurm_command_that_runs_once_gets_one_node(launcher: str) -> None:
    req = request("slurm", [launcher, "-p", "cpu", "--", "direct", "--", *PREPARE])
    assert dict(req.slurm_flags)["nodes"] == "1"


def test_slurm_command_that_runs_once_on_several_nodes_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"slurm --nodes=4: `train prepare-data` runs as one process on one node"
    ):
        request("slurm", ["srun", "-N", "4", "--", "direct", "--", *PREPARE])
