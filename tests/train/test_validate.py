"""Every setting the trainer cannot honour fails at start-up, naming the setting (before any step)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megamoe.errors import InvalidConfigError, UnsupportedSettingError
from megamoe.train.config import resolve_config
from megamoe.train.validate import plan_run

CONFIGS = Path(__file__).resolve().parents[2] / "examples/megatron/configs/cpu"
MOCK = CONFIGS / "moe_tiny-mock-pretrain.yaml"
REAL_TEXT = CONFIGS / "moe_tiny-pretrain.yaml"


def _plan(argv: list[str], *, world: int = 2, has_cuda: bool = False, config: Path = MOCK, environ=None):
    resolved = resolve_config(config, argv, environ=environ or {})
    return plan_run(resolved.config, world_size=world, has_cuda=has_cuda)


@pytest.mark.parametrize(
    ("argv", "has_cuda", "setting"),
    [
        (["--ckpt_format", "torch"], False, "ckpt_format"),
        (["--async_save", "true"], False, "async_save"),
        (["--fp8", "hybrid"], True, "fp8"),
        (["--recompute_layer_ids", "0,3"], True, "recompute_layer_ids"),
        (["--context_parallel_size", "2"], True, "context_parallel_size"),
        (["--moe_token_dispatcher_type", "flex"], True, "moe_token_dispatcher_type"),
        (["--moe_grouped_gemm", "true"], True, "moe_grouped_gemm"),
        (["--use_precision_aware_optimizer", "true"], True, "use_precision_aware_optimizer"),
        (["--external_cuda_graph", "true"], False, "external_cuda_graph"),
        (["--recompute_granularity", "full", "--recompute_method", "uniform", "--recompute_num_layers", "1"],
         False, "recompute_granularity"),
        (["--moe_layer_recompute", "true"], False, "moe_layer_recompute"),
        (["--sequence_parallel", "true", "--tensor_model_parallel_size", "2", "--expert_model_parallel_size", "1"],
         True, "sequence_parallel"),
    ],
)  # fmt: skip
def test_unsupported_setting_fails_with_its_name(argv: list[str], has_cuda: bool, setting: str) -> None:
    with pytest.raises(UnsupportedSettingError, match=rf"^{setting}="):
        _plan(argv, has_cuda=has_cuda)


def test_grouped_gemm_experts_plan_once_grouped_gemm_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's GroupedMLP needs only an importable ``grouped_gemm``: here the benchmarks' shim."""
    shim = Path(__file__).resolve().parents[2] / "benchmarks" / "grouped_gemm_shim"
    monkeypatch.syspath_prepend(str(shim))
    assert _plan(["--moe_grouped_gemm", "true"], has_cuda=True) is not None


@pytest.mark.parametrize(
    ("argv", "world", "setting"),
    [
        (["--global_batch_size", "12"], 2, "global_batch_size"),
        (["--overlap_param_gather", "true", "--use_distributed_optimizer", "false"], 2, "overlap_param_gather"),
        (["--expert_model_parallel_size", "3"], 3, "num_experts"),
        (["--expert_model_parallel_size", "4"], 2, "expert_model_parallel_size"),
        (["--pipeline_model_parallel_size", "2", "--expert_model_parallel_size", "1"], 3,
         r"tensor_model_parallel_size \* pipeline_model_parallel_size \* context_parallel_size"),
        (["--pipeline_model_parallel_size", "3", "--expert_model_parallel_size", "1"], 3, "num_layers"),
        (["--lr_warmup_iters", "20"], 2, "lr_warmup_iters"),
        (["--bf16", "true", "--fp16", "true"], 2, "fp16"),
        (["--exp_avg_dtype", "bf16"], 2, "exp_avg_dtype"),
        (["--moe_layer_freq", "[0,1]"], 2, "moe_layer_freq"),
        (["--train_iters", "0"], 2, "train_iters"),
        (["--tensor_model_parallel_size", "2", "--expert_model_parallel_size", "1"], 2, "sequence_parallel"),
    ],
)  # fmt: skip
def test_inconsistent_setting_fails_with_its_name(argv: list[str], world: int, setting: str) -> None:
    with pytest.raises(InvalidConfigError, match=rf"^{setting}="):
        _plan(argv, world=world)


def test_plan_derives_batch_geometry_and_checkpoint_folders() -> None:
    plan = _plan(["--workspace", "/w", "--global_batch_size", "32"])
    assert (plan.data_parallel_size, plan.num_microbatches, plan.global_batch_size) == (2, 4, 32)
    assert plan.save_dir == plan.load_dir == Path("/w/megamoe/demo/moe_tiny-mock-pretrain/checkpoints")
    assert plan.data_cache_dir == Path("/w/data_cache")


def test_plan_notes_primus_kernel_hints_it_ignores_and_a_missing_wandb(monkeypatch) -> None:
    import megamoe.train.validate as validate

    monkeypatch.setattr(validate, "_installed", lambda module: module != "wandb")
    plan = _plan(["--use_turbo_deepep", "true", "--moe_permute_fusion", "true", "--wandb_project", "p"])
    assert "use_turbo_deepep=True, moe_permute_fusion=True" in plan.notes[0]
    assert (
        plan.notes[1].startswith("wandb_project='p': wandb is not installed")
        and "pip install wandb" in plan.notes[1]
    )


@pytest.mark.parametrize(
    ("setting", "value", "match"),
    [
        ("micro_batch_size", "0", "must be >= 1"),
        ("global_batch_size", "0", "must be >= 1"),
        ("seq_length", "-5", "must be >= 1"),
        ("hidden_size", "0", "must be >= 1"),
        ("num_experts", "0", "must be >= 1"),
        ("moe_router_topk", "0", "must be >= 1"),
        ("moe_router_topk", "9", "more than num_experts=8"),
        ("log_interval", "0", "must be >= 1"),
        ("save_interval", "0", "must be >= 1"),
        ("eval_interval", "0", "must be >= 1"),
        ("eval_iters", "-1", "must be >= 0"),
        ("lr", "-1", "must be >= 0"),
        ("min_lr", "1.0", "above lr"),
        ("clip_grad", "-1", "must be >= 0"),
        ("hidden_dropout", "1.5", "must satisfy 0 <= value <= 1"),
        ("adam_beta2", "1.0", "must satisfy 0 <= value < 1"),
        ("expert_model_parallel_size", "0", "must be >= 1"),
    ],
)
def test_numeric_settings_out_of_range_fail_with_name_value_and_range(
    setting: str, value: str, match: str
) -> None:
    with pytest.raises(InvalidConfigError, match=rf"^{setting}={value!s}.*: {match}"):
        _plan([f"--{setting}", value])


def test_real_text_demo_plans_when_its_data_is_there(demo_data: Path) -> None:
    plan = _plan([], config=REAL_TEXT, environ={"PRIMUS_DATA_DIR": str(demo_data)})
    assert plan.global_batch_size == 16


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--data_path", "null"], r"^data_path=None: mock_data is false but no data is given"),
        (
            ["--data_path", "{d}/nothing_text_document"],
            r"nothing_text_document.bin and nothing_text_document.idx missing in ",
        ),
        (
            ["--data_path", "{d}/pydoc_text_document", "--train_data_path", "x"],
            "given together with train_data_path",
        ),
        (["--data_path", "0.5 {d}/pydoc_text_document 0.5"], "a weight before every prefix"),
        (["--data_path", "0 {d}/pydoc_text_document"], "sum to more than 0"),
        (["--split", "1,2,3,4"], r"^split='1,2,3,4'"),
        (["--tokenizer_model", "{d}"], "the directory holds no tokenizer"),
        (["--tokenizer_type", "GPT2BPETokenizer"], r"^tokenizer_type='GPT2BPETokenizer'"),
    ],
)
def test_bad_real_data_settings_fail_at_start_up_naming_the_file_or_setting(
    demo_data: Path, argv, match
) -> None:
    argv = [a.format(d=demo_data) for a in argv]
    with pytest.raises((InvalidConfigError, UnsupportedSettingError), match=match):
        _plan(argv, config=REAL_TEXT, environ={"PRIMUS_DATA_DIR": str(demo_data)})


def test_external_cuda_graph_uses_megatron_local_graphs_without_transformer_engine() -> None:
    assert importlib.util.find_spec("transformer_engine") is None, "this test pins the no-TE choice"
    assert _plan(["--external_cuda_graph", "true"], has_cuda=True).cuda_graph_impl == "local"
    with pytest.raises(UnsupportedSettingError, match=r"^cuda_graph_impl='transformer_engine'"):
        _plan(["--external_cuda_graph", "true", "--cuda_graph_impl", "transformer_engine"], has_cuda=True)


def test_a_save_folder_with_checkpoints_is_continued_or_replaced_never_overwritten(tmp_path: Path) -> None:
    tracker = tmp_path / "megamoe/demo/moe_tiny-mock-pretrain/checkpoints/latest_checkpointed_iteration.txt"
    tracker.parent.mkdir(parents=True)
    tracker.write_text("20\n")
    base = ["--workspace", str(tmp_path)]
    _plan(base)  # auto_continue_train (the default) resumes them
    with pytest.raises(
        InvalidConfigError,
        match=r"^save=.*already holds checkpoints \(up to iteration 20\).*--overwrite_checkpoints true",
    ):
        _plan([*base, "--auto_continue_train", "false"])
    with pytest.raises(InvalidConfigError, match=r"^save="):
        _plan([*base, "--finetune", "true"])
    _plan([*base, "--auto_continue_train", "false", "--overwrite_checkpoints", "true"])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--turbo_mega_moe_symm_max_tokens", "0"], r"^turbo_mega_moe_symm_max_tokens=0: must be >= 1"),
        (
            ["--turbo_mega_moe_symm_capacity_factor", "-1"],
            r"^turbo_mega_moe_symm_capacity_factor=-1(\.0)?: must be",
        ),
        (
            ["--turbo_mega_moe_symm_dispatch", "scatter"],
            r"^turbo_mega_moe_symm_dispatch='scatter': expected one of push/pull/broadcast",
        ),
        (
            ["--turbo_mega_moe_ep_transport", "nvshmem"],
            r"^turbo_mega_moe_ep_transport='nvshmem': expected one of symm/nccl",
        ),
    ],
)
def test_bad_ep_settings_fail_at_start_up_naming_the_key(argv, match) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        _plan(argv)
