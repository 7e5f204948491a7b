"""The preflight: `train pretrain`'s config checked once, before any hook, in launches and dry runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runner import preflight
from runner.errors import ConfigError
from runner.modes import direct
from tests.runner._support import PRIMUS_CLI, host_facts, job_env, plan, request

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "examples/megatron/configs/cpu/moe_tiny-pretrain.yaml")
TINY_MOCK = str(REPO / "examples/megatron/configs/cpu/moe_tiny-mock-pretrain.yaml")
PRETRAIN = ["--", "train", "pretrain", "--config", "c.yaml", "--num_layers", "4"]


def _check(mode: str, tokens: list[str], **host: object):
    return plan(mode, tokens, **host).preflight


def test_preflight_checks_the_world_of_this_node_with_the_same_arguments() -> None:
    check = _check("direct", PRETRAIN, env={"GPUS_PER_NODE": "4"})
    assert check.argv == (
        "/src/megamoe/.venv/bin/python", "-m", "megamoe.train", "check", "--world-size", "4", "--cuda",
        "--config", "c.yaml", "--num_layers", "4",
    )  # fmt: skip
    assert check.assumed == ""


def test_preflight_on_a_cpu_host_checks_without_cuda_and_says_nproc_was_guessed() -> None:
    check = _check("direct", PRETRAIN, visible_gpus=0, gpu_vendor="none")
    assert "--no-cuda" in check.argv and check.world_size == 1
    assert check.assumed.startswith("nproc-per-node=1 guessed from this host (no GPUs visible)")


@pytest.mark.parametrize(
    ("slurm", "env", "world", "assumed"),
    [
        (["sbatch", "-N", "2"], {"GPUS_PER_NODE": "8"}, 16, ""),
        (["srun"], {"GPUS_PER_NODE": "8", "SLURM_NNODES": "3"}, 24, "3 nodes from this allocation's SLURM_NNODES"),
        (["sbatch"], {"GPUS_PER_NODE": "8"}, 8, "1 node, Slurm's default (no -N)"),
        (["srun", "-N", "2"], {}, 16, "nproc-per-node=8 guessed from this host (8 GPUs visible)"),
        (["srun", "-N", "2", "--gpus-per-node=mi300x:4"], {}, 8, ""),
    ],
    ids=["known", "allocation", "default-node", "guessed-nproc", "slurm-gpus"],
)  # fmt: skip
def test_preflight_from_a_submit_host_uses_what_is_known_and_says_what_it_assumed(
    slurm: list[str], env: dict[str, str], world: int, assumed: str
) -> None:
    check = _check("slurm", [*slurm, "--", "direct", *PRETRAIN], env=env)
    assert check.world_size == world
    assert check.assumed.startswith(assumed)


def test_preflight_assumes_gpus_on_slurm_nodes_seen_from_a_cpu_login_node() -> None:
    check = _check("slurm", ["srun", "-N", "2", "--", "container", *PRETRAIN], env={"GPUS_PER_NODE": "8"},
                   visible_gpus=0, gpu_vendor="none")  # fmt: skip
    assert "--cuda" in check.argv and check.assumed == "GPUs on the nodes"


@pytest.mark.parametrize(
    "tokens",
    [
        ["--", "--script", "a.py"],
        ["--", "train", "prepare-data", "--input", "c.jsonl", "--output-prefix", "d/c"],
        ["--", "train", "pretrain", "--help"],
    ],
    ids=["script", "prepare-data", "help"],
)
def test_preflight_only_for_pretrain(tokens: list[str]) -> None:
    assert _check("direct", tokens) is None


def test_preflight_skipped_with_a_warning_where_megamoe_is_not_importable() -> None:
    p = plan("container", ["--image", "i", *PRETRAIN], trainer_importable=False)
    assert p.preflight is None
    assert any(w.startswith("preflight skipped: megamoe and torch are not importable") for w in p.warnings)


def test_preflight_verdict_rejected_is_one_error_with_the_assumptions() -> None:
    check = _check("slurm", ["srun", "-N", "2", "--", "direct", *PRETRAIN])
    req = request("slurm", ["srun", "-N", "2", "--", "direct", *PRETRAIN])
    with pytest.raises(ConfigError) as err:
        preflight.conclude(check, {"ok": False, "error": "x=1: bad. Fix it."}, req)
    assert err.value.format_message() == (
        "x=1: bad. Fix it. (checked for world size 16: nproc-per-node=8 guessed from this host (8 GPUs visible); "
        "set GPUS_PER_NODE or --gpus-per-node)"
    )


def test_preflight_verdict_accepted_puts_the_node_logs_in_the_run_directory() -> None:
    req = request("direct", PRETRAIN)
    check = _check("direct", PRETRAIN)
    done = preflight.conclude(check, {"ok": True, "output_dir": "./output/g/u/e"}, req)
    assert done.run_dir == "/work/job/output/g/u/e"
    assert direct.log_file(done, direct.node_context(done, host_facts(), dry_run=True)[0]) == (
        "/work/job/output/g/u/e/logs/job42-node0.log"
    )


# --------------------------------------------------------------------------- real primus-cli


@pytest.mark.parametrize("dry_run", [False, True], ids=["launch", "dry-run"])
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--expert_model_parallel_size", "3"], "expert_model_parallel_size=3"),
        (["--num_layer", "3"], "num_layer='3': unknown setting. Use 'num_layers'"),
    ],
    ids=["ep-does-not-divide", "misspelt-key"],
)
def test_preflight_bad_config_is_one_line_and_exit_2_before_any_hook(
    tmp_path: Path, dry_run: bool, override: list[str], message: str
) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "00_mark.sh").write_text(f"touch {tmp_path}/hook-ran\n")
    args = [*(["--dry-run"] * dry_run), "direct", "--hooks-dir", str(hooks), "--", "train", "pretrain"]
    res = subprocess.run([PRIMUS_CLI, *args, "--config", TINY, *override], cwd=tmp_path,
                         env=job_env({"PATH": "/usr/bin:/bin"}), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    [line] = res.stderr.splitlines()
    assert line.startswith("Error: ") and message in line
    assert not (tmp_path / "hook-ran").exists() and not (tmp_path / "logs").exists()


def test_preflight_dry_run_of_a_good_config_shows_the_logs_in_its_run_directory(tmp_path: Path) -> None:
    res = subprocess.run([PRIMUS_CLI, "--dry-run", "direct", "--", "train", "pretrain", "--config", TINY_MOCK],
                         cwd=tmp_path, env=job_env({"PATH": "/usr/bin:/bin"}), capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    run_dir = tmp_path / "output/megamoe/demo/moe_tiny-mock-pretrain"
    assert f"--log-dir {run_dir}/logs/" in res.stdout
    assert "# preflight (here, before any hook): world size 2 = 1 node x 2 processes\n" in res.stdout
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "chain",
    [["container", "--image", "img:1", "--"], ["slurm", "srun", "-N", "1", "--", "direct", "--"]],
    ids=["container", "slurm"],
)
def test_preflight_runs_on_this_host_for_containers_and_slurm_too(tmp_path: Path, chain: list[str]) -> None:
    args = ["--dry-run", *chain, "train", "pretrain", "--config", TINY, "--expert_model_parallel_size", "3"]
    res = subprocess.run([PRIMUS_CLI, *args], cwd=tmp_path, env=job_env({"PATH": "/usr/bin:/bin"}),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("Error: num_experts=8: not divisible by expert_model_parallel_size=3")
