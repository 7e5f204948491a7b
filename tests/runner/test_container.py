"""container mode: runtime flags, mounts, and variables forwarded by name only."""

from __future__ import annotations

import pytest

from runner import env as env_mod
from runner.config import EnvOpts
from runner.errors import LaunchError
from tests.runner._support import plan

CMD = ["--", "--script", "a.py"]


def test_env_whitelist_and_prefixes_forward_set_names_only() -> None:
    env = {"HF_TOKEN": "hf-secret-1", "NCCL_DEBUG": "INFO", "RANDOM_VAR": "x", "GPU_ARCHS": "gfx950"}
    p = plan("container", ["--image", "i", *CMD], env=env)
    step = p.step("container")
    assert {"HF_TOKEN", "NCCL_DEBUG", "GPU_ARCHS"} <= set(step.env_names)
    assert "RANDOM_VAR" not in step.env_names
    assert "WANDB_API_KEY" not in step.env_names  # whitelisted but unset
    assert "hf-secret-1" not in str(p) and "hf-secret-1" not in str(p.to_dict())
    i = step.argv.index("HF_TOKEN")
    assert step.argv[i - 1] == "-e"


def test_forwarded_names_keep_whitelist_order_then_prefixes() -> None:
    names = env_mod.forwarded_names(
        EnvOpts(forward=["B", "A"], prefixes=["P_"]), {"A": "", "P_2": "", "P_1": ""}
    )
    assert names == ("A", "P_1", "P_2")


@pytest.mark.parametrize(
    ("vendor", "runtime", "expected"),
    [
        ("amd", "podman", ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video"]),
        ("nvidia", "docker", ["--gpus", "all"]),
    ],
)
def test_gpu_flags_per_vendor(vendor: str, runtime: str, expected: list[str]) -> None:
    devices = frozenset({"/dev/kfd", "/dev/dri", "/dev/nvidiactl"})
    argv = plan("container", ["--image", "i", *CMD], gpu_vendor=vendor, runtimes=(runtime,), devices=devices)
    joined = " ".join(argv.step("container").argv)
    assert " ".join(expected) in joined


def test_missing_amd_devices_fail_a_launch_and_warn_in_a_dry_run() -> None:
    p = plan("container", ["--image", "i", *CMD], devices=frozenset())
    assert any("/dev/kfd" in w for w in p.warnings)
    with pytest.raises(LaunchError, match="/dev/kfd"):
        plan("container", ["--image", "i", *CMD], devices=frozenset(), dry_run=False)


def test_container_mounts_checkout_and_outside_files_at_their_paths() -> None:
    argv = plan("container", ["--image", "i", "--", "--script", "/data/job.py"]).step("container").argv
    assert "/src/megamoe:/src/megamoe" in argv
    assert "/data/job.py:/data/job.py:ro" in argv
    assert argv[argv.index("-w") + 1] == "/work/job"


def test_container_host_ipc_and_network_no_shm_size_then() -> None:
    argv = plan("container", ["--image", "i", *CMD]).step("container").argv
    assert "--ipc=host" in argv and "--network=host" in argv
    assert not any(a.startswith("--shm-size") for a in argv)
    argv = plan("container", ["--image", "i", "--ipc", "private", *CMD]).step("container").argv
    assert "--shm-size=64g" in argv


def test_container_cli_ulimit_replaces_the_configured_one_of_its_type() -> None:
    argv = plan("container", ["--image", "i", "--ulimit", "nofile=10:10", *CMD]).step("container").argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--ulimit"] == ["nofile=10:10"]


def test_container_name_is_unique_per_job_and_labelled() -> None:
    argv = plan("container", ["--image", "i", *CMD]).step("container").argv
    assert argv[argv.index("--name") + 1] == "primus-job42-node0"
    assert "io.megamoe.primus-cli=1" in argv


def test_container_mounts_what_a_one_process_command_reads_and_writes() -> None:
    cmd = ["--", "train", "prepare-data", "--input", "/data/a.jsonl,in/b.jsonl", "--tokenizer-model", "/models/tok",
           "--output-prefix", "/scratch/out/corpus"]  # fmt: skip
    p = plan("container", ["--image", "i", *cmd])
    argv = p.step("container").argv
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert mounts == [
        "/src/megamoe:/src/megamoe", "/work/job:/work/job", "/data/a.jsonl:/data/a.jsonl:ro",
        "/models/tok:/models/tok:ro", "/scratch/out:/scratch/out",
    ]  # fmt: skip
    assert p.steps[-1].kind == "python"


def test_container_without_gpus_here_says_the_gpu_flags_were_guessed_in_a_dry_run() -> None:
    p = plan("container", ["--image", "i", *CMD], gpu_vendor="none", visible_gpus=0)
    assert not {"--gpus", "--group-add"} & set(p.step("container").argv)
    assert any(w.startswith("no container GPU flags: guessed from this host") for w in p.warnings)
    assert not any(
        "GPU flags" in w for w in plan("container", ["--image", "i", "--gpu", "none", *CMD]).warnings
    )
