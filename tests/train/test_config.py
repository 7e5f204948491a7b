"""The shipped experiment files and the seed jobs' flags resolve, type and validate; export round-trips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from megamoe.train.__main__ import cli
from megamoe.train.config import resolve_config
from megamoe.train.model import transformer_config
from megamoe.train.validate import plan_run

ROOT = Path(__file__).resolve().parents[2]
DSV3 = ROOT / "examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml"
CPU_DEMO = ROOT / "examples/megatron/configs/cpu/moe_tiny-pretrain.yaml"
CPU_MOCK = ROOT / "examples/megatron/configs/cpu/moe_tiny-mock-pretrain.yaml"
CPU_PP2 = ROOT / "examples/megatron/configs/cpu/moe_tiny-pp2-pretrain.yaml"

# The three seed jobs' flags (docs of Primus's MegaMoE), exactly as the scripts in examples/ pass them.
_EP8 = ["--num_layers", "4", "--micro_batch_size", "2", "--global_batch_size", "1024"]
_EP8_TAIL = [
    "--tensor_model_parallel_size", "1", "--pipeline_model_parallel_size", "1",
    "--expert_model_parallel_size", "8", "--moe_layer_freq", "1",
    "--moe_shared_expert_intermediate_size", "None", "--pipeline_model_parallel_layout", "null",
    "--recompute_granularity", "null", "--recompute_num_layers", "0", "--recompute_layer_ids", "null",
    "--moe_router_force_load_balancing_type", "uniform",
]  # fmt: skip
SEED_JOBS = {
    "ep8": (8, [*_EP8, *_EP8_TAIL, "--enable_primus_turbo", "True", "--use_turbo_mega_moe", "True", "--mock_data", "True"]),
    "ep8_cuda_graph": (8, [
        *_EP8, "--train_iters", "15", *_EP8_TAIL, "--external_cuda_graph", "True", "--cuda_graph_scope", "full",
        "--cuda_graph_warmup_steps", "3", "--enable_primus_turbo", "True", "--use_turbo_mega_moe", "True",
        "--mock_data", "True",
    ]),
    "8node_ep8_pp8": (64, [
        "--train_iters", "15", "--micro_batch_size", "2", "--global_batch_size", "1024",
        "--tensor_model_parallel_size", "1", "--pipeline_model_parallel_size", "8",
        "--pipeline_model_parallel_layout",
        "Ett|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttt|tttL",
        "--expert_model_parallel_size", "8", "--moe_shared_expert_intermediate_size", "None",
        "--mtp_num_layers", "0", "--recompute_granularity", "full", "--recompute_method", "uniform",
        "--recompute_num_layers", "1", "--recompute_layer_ids", "null",
        "--moe_router_force_load_balancing_type", "uniform", "--enable_primus_turbo", "True",
        "--use_turbo_mega_moe", "True", "--mock_data", "True",
    ]),
}  # fmt: skip


@pytest.mark.parametrize("job", sorted(SEED_JOBS))
def test_seed_job_resolves_and_validates_on_its_gpu_world(job: str) -> None:
    world, argv = SEED_JOBS[job]
    cfg = resolve_config(DSV3, argv, environ={}).config
    plan = plan_run(cfg, world_size=world, has_cuda=True)
    assert cfg.turbo.use_turbo_mega_moe and cfg.moe.moe_router_force_load_balancing
    assert plan.global_batch_size == 1024
    assert plan.num_microbatches == 1024 // (2 * plan.data_parallel_size)


def test_seed_pp8_layout_gives_megatron_two_virtual_stages() -> None:
    world, argv = SEED_JOBS["8node_ep8_pp8"]
    cfg = resolve_config(DSV3, argv, environ={}).config
    tconfig = transformer_config(cfg, plan_run(cfg, world_size=world, has_cuda=True))
    assert tconfig.virtual_pipeline_model_parallel_size == 2
    assert tconfig.moe_layer_freq == [0] * 3 + [1] * 58


def test_dsv3_experiment_reads_primus_env_defaults_and_overrides() -> None:
    cfg = resolve_config(DSV3, [], environ={"PRIMUS_EP": "16", "PRIMUS_SEQ_LENGTH": "2048"}).config
    assert (cfg.parallel.expert_model_parallel_size, cfg.training.seq_length) == (16, 2048)
    assert cfg.parallel.pipeline_model_parallel_size == 16
    assert cfg.output_dir == "./output/amd/root/deepseek_v3-pretrain"


@pytest.mark.parametrize("model", ["deepseek_v3_tiny", "qwen3_30B_A3B", "qwen3_235B_A22B", "moe_tiny"])
def test_packaged_model_presets_build_a_transformer_config(model: str) -> None:
    argv = ["--pipeline_model_parallel_size", "1", "--pipeline_model_parallel_layout", "null",
            "--expert_model_parallel_size", "1", "--recompute_granularity", "null"]  # fmt: skip
    cfg = resolve_config(DSV3, argv, environ={"PRIMUS_MODEL": model}).config
    tconfig = transformer_config(cfg, plan_run(cfg, world_size=1, has_cuda=False))
    assert tconfig.num_moe_experts == cfg.moe.num_experts


@pytest.mark.parametrize(("path", "iters"), [(CPU_DEMO, 40), (CPU_MOCK, 20), (CPU_PP2, 20)])
def test_cpu_demo_configs_validate_on_two_cpu_ranks(path: Path, iters: int, demo_data: Path) -> None:
    cfg = resolve_config(path, [], environ={"PRIMUS_DATA_DIR": str(demo_data)}).config
    plan_run(cfg, world_size=2, has_cuda=False)
    assert cfg.training.train_iters == iters and cfg.turbo.use_turbo_mega_moe
    assert cfg.data.mock_data == (path != CPU_DEMO)


def test_export_config_round_trips_to_the_same_settings(tmp_path: Path) -> None:
    resolved = resolve_config(DSV3, ["--num_layers", "4", "--lr", "2e-4"], environ={})
    exported = tmp_path / "effective.yaml"
    exported.write_text(resolved.export())
    again = resolve_config(exported, [], environ={})
    assert again.config == resolved.config
    assert yaml.safe_load(exported.read_text())["modules"]["pre_trainer"]["overrides"]["lr"] == 2e-4


def test_cli_dry_run_prints_effective_config_and_writes_export(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "cfg.yaml"
    result = CliRunner().invoke(
        cli,
        ["pretrain", "--config", str(CPU_MOCK), "--export_config", str(out), "--dry-run", "--lr", "1e-3"],
        env={"WORLD_SIZE": "2"},
    )
    assert result.exit_code == 0, result.output
    assert "lr: 0.001" in result.output and "# run plan:" in result.output
    assert re.search(r"^# lr +cli$", result.output, re.M)
    assert re.search(
        r"^# num_experts +\S+/megamoe/configs/models/megatron/moe_tiny\.yaml$", result.output, re.M
    )
    assert yaml.safe_load(out.read_text())["modules"]["pre_trainer"]["overrides"]["lr"] == 1e-3


def test_cli_unknown_key_exits_2_with_the_close_match() -> None:
    result = CliRunner().invoke(cli, ["pretrain", "--config", str(CPU_DEMO), "--dry-run", "--num_layer", "3"])
    assert result.exit_code == 2
    assert "num_layer='3': unknown setting. Use 'num_layers', the closest known key." in result.output


_SCRIPTS = {"ep8": "ep8.sh", "ep8_cuda_graph": "ep8_cudagraph.sh", "8node_ep8_pp8": "pp8_8node.sh"}


@pytest.mark.parametrize("job", sorted(_SCRIPTS))
def test_example_scripts_pass_the_seed_flags(job: str) -> None:
    """examples/*.sh (rendered from primus-cli's templates) carry exactly the seed jobs' flags."""
    import shlex

    words = shlex.split((ROOT / "examples" / _SCRIPTS[job]).read_text().replace("\\\n", " "), comments=True)
    argv = words[words.index("--config") + 2 :]
    assert argv == SEED_JOBS[job][1]


def test_ep_settings_come_from_the_config_keys_and_fall_back_to_the_environment(monkeypatch) -> None:
    import math

    from megamoe.train.model import ep_settings

    monkeypatch.setenv("MEGAMOE_EP_TRANSPORT", "nccl")
    monkeypatch.setenv("MEGAMOE_SYMM_MAX_TOKENS", "64")
    monkeypatch.setenv("MEGAMOE_SYMM_DISPATCH", "pull")
    argv = ["--turbo_mega_moe_symm_dispatch", "push", "--turbo_mega_moe_symm_capacity_factor", "inf"]
    settings = ep_settings(resolve_config(CPU_MOCK, argv, environ={}).config)
    assert settings.transport == "nccl" and settings.symm.max_tokens == 64  # null keys: the variables
    assert settings.symm.dispatch == "push" and settings.symm.capacity_factor == math.inf  # set keys win
    argv = ["--turbo_mega_moe_ep_transport", "symm", "--turbo_mega_moe_symm_max_tokens", "4096"]
    settings = ep_settings(resolve_config(CPU_MOCK, argv, environ={}).config)
    assert (settings.transport, settings.symm.max_tokens, settings.symm.dispatch) == ("symm", 4096, "pull")


def test_the_symmetric_workspace_is_sized_from_the_batch_unless_a_key_sizes_it() -> None:
    from megamoe.train.model import symm_max_tokens

    argv = ["--seq_length", "96", "--micro_batch_size", "3"]
    assert symm_max_tokens(resolve_config(CPU_MOCK, argv, environ={}).config) == 288
    argv += ["--turbo_mega_moe_symm_max_tokens", "1000"]
    assert symm_max_tokens(resolve_config(CPU_MOCK, argv, environ={}).config) == 1000
