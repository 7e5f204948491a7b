"""The FP8-against-bf16 training benchmark: its arguments and plan (the GPU experiment it resolves to),
the comparison and tables, ``main`` over a stand-in interpreter (data steps, exit status, files), and
one real ``--tiny`` run on a CPU rank (slow)."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path

import pytest

from benchmarks import train_precision_compare as tpc
from benchmarks import train_precision_report as report
from benchmarks.train_runs import RunSummary
from megamoe.train.config import resolve_config


def _plan(argv: list[str], environ: dict[str, str] | None = None) -> tpc.Plan:
    args, extra = tpc.parse_args(argv)
    return tpc.build_plan(args, extra, environ or {})


def _trainer_args(plan: tpc.Plan, precision: str) -> list[str]:
    argv = plan.train_command(precision)
    return argv[argv.index("pretrain") + 1 :]


# --------------------------------------------------------------------------- arguments and plan


@pytest.mark.parametrize(
    ("text", "expected"),
    [("bf16,fp8", ("bf16", "fp8")), ("fp8", ("fp8",)), (" bf16 , mxfp8,fp8 ", ("bf16", "mxfp8", "fp8"))],
)
def test_precisions_parse(text: str, expected: tuple[str, ...]) -> None:
    assert tpc.parse_args(["--precisions", text])[0].precisions == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precisions", "bf16,fp16"], "expected a comma-separated list of bf16, fp8, mxfp8"),
        (["--precisions", "fp8,fp8"], "a precision is listed twice"),
        (["--precisions", ","], "expected a comma-separated list"),
        (["--train-iters", "0"], "must be a positive integer"),
        (["--gpus", "two"], "invalid _positive value"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        tpc.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err and message in err


def test_gpu_plan_resolves_to_the_toy_deepseek_v3_on_real_text_with_fp8_experts(tmp_path: Path) -> None:
    plan = _plan(["--out", str(tmp_path)])
    assert plan.precisions == ("bf16", "fp8")
    assert plan.env == {"TORCHDYNAMO_DISABLE": "1", "PRIMUS_MODEL": "deepseek_v3_tiny"}
    args = _trainer_args(plan, "fp8")
    assert args[:2] == ["--config", str(tpc.GPU_CONFIG)]
    cfg = resolve_config(tpc.GPU_CONFIG, args[2:], environ=plan.env).config
    # The FP8 Triton kernels read E4M3 rows by TMA: H and I must be multiples of 16.
    assert cfg.model.hidden_size % 16 == 0 and cfg.moe.moe_ffn_hidden_size % 16 == 0
    assert (cfg.model.hidden_size, cfg.moe.moe_ffn_hidden_size, cfg.moe.num_experts) == (256, 128, 16)
    assert cfg.parallel.expert_model_parallel_size == 1 and cfg.parallel.pipeline_model_parallel_size == 1
    assert (cfg.training.seq_length, cfg.training.train_iters, cfg.training.bf16) == (512, 300, True)
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (8, 8)
    assert cfg.data.mock_data is False and cfg.data.data_path == str(tmp_path / "data/pydoc_text_document")
    assert cfg.model.vocab_size is None
    assert not cfg.moe.moe_router_force_load_balancing  # learned routing
    assert (cfg.turbo.use_turbo_mega_moe, cfg.turbo.turbo_mega_moe_precision) == (True, "fp8")
    assert cfg.workspace == str(tmp_path / "fp8" / "workspace")


def test_every_run_differs_only_in_precision_and_workspace_and_the_switch_is_last(tmp_path: Path) -> None:
    plan = _plan(["--out", str(tmp_path), "--precisions", "bf16,fp8,mxfp8", "--", "--lr", "3e-4"])
    runs = {p: _trainer_args(plan, p) for p in plan.precisions}
    for precision, args in runs.items():
        assert args[-6:] == ["--enable_primus_turbo", "True", "--use_turbo_mega_moe", "True",
                             "--turbo_mega_moe_precision", precision]  # fmt: skip
        assert args[-8:-6] == ["--lr", "3e-4"]  # overrides after --, before the switch
        assert args[args.index("--seed") + 1] == "1234"
    strip = {p: [w for w in a if p not in w] for p, a in runs.items()}
    assert strip["bf16"] == strip["fp8"] == strip["mxfp8"]


def test_tiny_plan_is_the_cpu_demo_model_with_ep_over_the_ranks(tmp_path: Path) -> None:
    plan = _plan(["--tiny", "--gpus", "2", "--out", str(tmp_path), "--data-dir", str(tmp_path / "d")],
                 environ={"TORCHDYNAMO_DISABLE": "0"})  # fmt: skip
    assert plan.env == {"TORCHDYNAMO_DISABLE": "0"}  # the caller's choice is kept
    args = _trainer_args(plan, "fp8")
    cfg = resolve_config(tpc.TINY_CONFIG, args[2:], environ={}).config
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.training.global_batch_size == 8
    assert (cfg.training.train_iters, cfg.training.eval_interval, cfg.training.eval_iters) == (6, 3, 1)
    assert cfg.model.tokenizer_model == str(tmp_path / "d" / "tokenizer")


def test_dry_run_prints_the_data_steps_and_every_run_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert tpc.main(["--dry-run", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "[bench] data",
        "[bench] data",
        "[bench] bf16",
        "[bench] fp8",
    ]
    assert "make_demo_corpus.py --output" in lines[0] and "prepare-data" in lines[1]
    assert "GPUS_PER_NODE=1 TORCHDYNAMO_DISABLE=1 PRIMUS_MODEL=deepseek_v3_tiny" in lines[2]
    assert lines[3].endswith("--turbo_mega_moe_precision fp8")
    assert not out.exists()


# --------------------------------------------------------------------------- comparison and tables


def _run(
    precision: str, losses: list[float], valid: list[tuple[int, float]], **kw: object
) -> report.PrecisionRun:
    fields = {
        "returncode": 0,
        "moe_block": "MegaMoE",
        "moe_reason": f"TP=1, backend=auto, precision={precision}",
    }
    run = report.PrecisionRun(precision=precision, **{**fields, **kw})  # type: ignore[arg-type]
    run.summary = RunSummary(first_iteration=1, last_iteration=len(losses), first_loss=losses[0],
                             last_loss=losses[-1], step_ms=100.0, tokens_per_s=40960.0, tflops_per_gpu=1.0,
                             peak_mem_gib=0.5)  # fmt: skip
    run.training_log = "training_log.jsonl"
    run.train_curve = list(enumerate(losses, start=1))
    run.valid_curve = valid
    run.final_train_loss = sum(losses[-report.FINAL_WINDOW :]) / len(losses[-report.FINAL_WINDOW :])
    run.final_valid_loss = valid[-1][1] if valid else None
    return run


def test_compare_gives_relative_differences_against_bf16_and_the_verdict() -> None:
    base = _run("bf16", [4.0] * 12, [(6, 5.0), (12, 4.0)])
    close = _run("fp8", [4.04] * 12, [(6, 5.1), (12, 4.02)])
    far = _run("mxfp8", [4.0] * 12, [(6, 5.0), (12, 4.1)])
    comparisons = report.compare([base, close, far], tolerance=0.015)
    assert [(c.precision, c.within) for c in comparisons] == [("fp8", True), ("mxfp8", False)]
    assert comparisons[0].train_rel == pytest.approx(0.01) and comparisons[0].valid_rel == pytest.approx(
        0.005
    )
    assert comparisons[1].valid_rel == pytest.approx(0.025)
    assert report.compare([close], 0.015) == []  # no baseline, no comparison
    rows = report.table([base, close, far], comparisons).splitlines()
    assert rows[0].startswith("| precision | lm loss at 1 | final train loss (mean of last 10) | vs bf16 |")
    assert "within 1.5 % |" in rows[0]
    assert rows[2] == "| bf16 | 4.0000 | 4.0000 |  | 4.0000 |  |  | 100.0 | 40,960 | 0.50 | ok |"
    assert (
        rows[3] == "| fp8 | 4.0400 | 4.0400 | +1.00 % | 4.0200 | +0.50 % | yes | 100.0 | 40,960 | 0.50 | ok |"
    )
    assert rows[4].startswith("| mxfp8 | 4.0000 | 4.0000 | +0.00 % | 4.1000 | +2.50 % | no |")


def test_curves_table_has_the_windowed_train_loss_and_validation_at_each_evaluation() -> None:
    base = _run("bf16", [float(i) for i in range(20, 0, -1)], [(10, 5.0), (20, 4.0)])
    rows = report.curves_table([base]).splitlines()
    assert rows[0] == "| iteration | 10 | 20 |"
    assert rows[2] == "| bf16 train | 15.5000 | 5.5000 |"  # means of 20..11 and 10..1
    assert rows[3] == "| bf16 validation | 5.0000 | 4.0000 |"
    assert report.curves_table([_run("bf16", [1.0], [])]) == ""


def test_check_names_every_problem() -> None:
    run = _run("fp8", [4.0, float("nan")], [], returncode=1, moe_reason="backend=auto, precision=bf16")
    report.check(run, train_iters=5)
    assert run.problems == [
        "exit status 1",
        "built precision 'bf16', expected 'fp8'",
        "training_log.jsonl ends at iteration 2, expected 5",
        "non-finite loss in training_log.jsonl",
        "no validation loss in training_log.jsonl",
    ]
    stopped = report.PrecisionRun(precision="bf16", timed_out=True, timeout_s=160)
    report.check(stopped, train_iters=5)
    assert stopped.problems[0] == "timed out after 160 s"
    assert "no training_log.jsonl under the workspace" in stopped.problems


# --------------------------------------------------------------------------- main, with a stand-in


FAKE = r"""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
def value(flag):
    return args[args.index(flag) + 1]

if args[0].endswith("make_demo_corpus.py"):
    out = Path(value("--output"))
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    (out / "corpus.jsonl").write_text('{"text": "x"}\n')
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    sys.exit(0)
if "prepare-data" in args:
    if os.environ.get("FAKE_FAIL") == "prepare":
        sys.exit(4)
    prefix = value("--output-prefix")
    for ext in (".bin", ".idx"):
        Path(prefix + "_text_document" + ext).write_bytes(b"")
    sys.exit(0)

precision = value("--turbo_mega_moe_precision")
iters, interval = int(value("--train_iters")), int(value("--eval_interval"))
factor = float(os.environ.get("FAKE_FACTOR", "1.0")) if precision != "bf16" else 1.0
folder = Path(value("--workspace")) / "megamoe" / "demo" / "exp"
folder.mkdir(parents=True, exist_ok=True)
with (folder / "training_log.jsonl").open("a") as log:
    log.write(json.dumps({"event": "run_start", "start_iteration": 0}) + "\n")
    for i in range(1, iters + 1):
        log.write(json.dumps({"event": "train", "iteration": i, "lm_loss": (8.0 - 0.1 * i) * factor}) + "\n")
        if i % interval == 0 or i == iters:
            log.write(json.dumps({"event": "valid", "iteration": i, "lm_loss": (8.5 - 0.1 * i) * factor}) + "\n")
print(f"[default0]:INFO megamoe.train.loop: MoE block: MegaMoE (TP=1, backend=auto, precision={precision})")
if os.environ.get("FAKE_FAIL") == precision:
    sys.exit(3)
print(f"[default0]:INFO megamoe.train.loop: summary: trained iterations 1..{iters} | lm loss 7.9000 -> 7.0000 | "
      "step 100.0 ms | 40,960 tokens/s | 1.5 TFLOP/s/GPU | peak mem 0.50 GiB | checkpoint none | wall 9.0 s")
"""


def _fake_python(tmp_path: Path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\n{FAKE}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *argv: str, **env: str) -> tuple[int, Path]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    code = tpc.main(["--python", _fake_python(tmp_path), "--out", str(out), "--train-iters", "12",
                     "--eval-interval", "6", *argv])  # fmt: skip
    return code, out


def test_main_prepares_the_data_runs_both_and_writes_the_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _main(tmp_path, monkeypatch, FAKE_FACTOR="1.01")
    assert code == 0
    assert (out / "data" / "pydoc_text_document.idx").is_file()
    results = json.loads((out / "results.json").read_text())
    assert list(results["runs"]) == ["bf16", "fp8"] and all(r["ok"] for r in results["runs"].values())
    fp8 = results["runs"]["fp8"]
    assert fp8["final_train_loss"] == pytest.approx(sum((8.0 - 0.1 * i) * 1.01 for i in range(3, 13)) / 10)
    assert fp8["valid_curve"] == [[6, pytest.approx(7.9 * 1.01)], [12, pytest.approx(7.3 * 1.01)]]
    assert (fp8["step_ms"], fp8["tokens_per_s"], fp8["peak_mem_gib"]) == (100.0, 40960.0, 0.5)
    (comparison,) = results["comparisons"]
    assert comparison["precision"] == "fp8" and comparison["within"] is True
    assert comparison["train_rel"] == pytest.approx(0.01)
    table = (out / "table.md").read_text()
    assert "| fp8 | 7.9790 |" in table and "| +1.00 % | yes |" in table
    assert "| iteration | 6 | 12 |" in table
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| +1.00 % | yes |" in capsys.readouterr().out
    # A second run reuses the data and reads only its own launch from the appended training logs.
    code, _ = _main(tmp_path, monkeypatch, "--precisions", "fp8")
    assert code == 0
    assert "data: reusing" in capsys.readouterr().out
    again = json.loads((out / "results.json").read_text())
    assert len(again["runs"]["fp8"]["train_curve"]) == 12 and again["comparisons"] == []


def test_main_reports_a_loss_outside_the_tolerance_without_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = _main(tmp_path, monkeypatch, FAKE_FACTOR="1.03")
    assert code == 0
    assert json.loads((out / "results.json").read_text())["comparisons"][0]["within"] is False
    assert "| +3.00 % | no |" in (out / "table.md").read_text()


def test_main_fails_when_a_run_fails_but_still_runs_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = _main(tmp_path, monkeypatch, "--precisions", "fp8,bf16", FAKE_FAIL="fp8")
    assert code == 1
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert runs["fp8"]["problems"] == ["exit status 3", "no 'summary: trained iterations' line"]
    assert runs["bf16"]["ok"]


def test_main_stops_when_the_data_cannot_be_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _main(tmp_path, monkeypatch, FAKE_FAIL="prepare")
    assert code == 1
    assert "data step failed (exit status 4)" in capsys.readouterr().out
    assert not (out / "bf16").exists() and not (out / "results.json").exists()


# --------------------------------------------------------------------------- the real path


@pytest.mark.slow
def test_tiny_trains_bf16_and_fp8_on_the_demo_text_from_the_same_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """make_demo_corpus -> prepare-data -> python -m runner direct -> torchrun (1 CPU rank) -> train
    pretrain, once with MegaMoE's unquantised experts and once with the FP8 emulation."""
    if "OMP_NUM_THREADS" not in os.environ:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    assert tpc.main(["--tiny", "--out", str(out), "--timeout-s", "240"]) == 0
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert "precision=fp8 (exact emulation)" in runs["fp8"]["moe_reason"]
    for run in runs.values():
        assert [i for i, _ in run["train_curve"]] == list(range(1, 7))
        assert [i for i, _ in run["valid_curve"]] == [3, 6]
        assert all(math.isfinite(loss) for _, loss in run["train_curve"] + run["valid_curve"])
        assert 5.0 < run["final_train_loss"] < 8.5 and 5.0 < run["final_valid_loss"] < 8.5  # ln(2048) = 7.6
    # Same seed and data: the first loss agrees closely, and six steps of FP8 stay within 2 %.
    assert runs["fp8"]["train_curve"][0][1] == pytest.approx(runs["bf16"]["train_curve"][0][1], rel=2e-3)
    (comparison,) = results["comparisons"]
    assert abs(comparison["train_rel"]) < 0.02 and abs(comparison["valid_rel"]) < 0.02
    assert "| fp8 |" in (out / "table.md").read_text()
    assert (out / "loss_curves.png").stat().st_size > 10_000
