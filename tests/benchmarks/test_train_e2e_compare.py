"""The end-to-end comparison script: the trainer's summary line parsed back, the table, the launch
argv and env, the variant argument, and ``main`` over a stand-in launcher (exit status, timeout,
files); one real 2-rank CPU run of all three variants (slow)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from benchmarks import train_e2e_compare as ab
from benchmarks import train_runs
from megamoe.train.loop import Summary

RANK0 = "[default0]:[15:35:21 rank 0] INFO megamoe.train.loop: "


def _summary(**kw: object) -> Summary:
    base = dict(first_iteration=0, last_iteration=15, first_loss=10.4, last_loss=9.87654, mean_step_s=1.23456,
                tokens_per_s=26543.21, tflops_per_gpu=412.345, peak_mem_gib=101.234, checkpoint=None,
                wall_s=80.0)  # fmt: skip
    base.update(kw)
    return Summary(**base)  # type: ignore[arg-type]


def test_the_trainers_summary_line_parses_back() -> None:
    parsed = train_runs.parse_summary(RANK0 + "summary: " + _summary().text())
    assert parsed == train_runs.RunSummary(
        first_iteration=1, last_iteration=15, first_loss=10.4, last_loss=9.8765, step_ms=1234.6,
        tokens_per_s=26543.0, tflops_per_gpu=412.0, peak_mem_gib=101.23,
    )  # fmt: skip


def test_the_last_summary_wins_and_missing_values_are_none() -> None:
    text = "\n".join(
        [
            RANK0 + "summary: " + _summary(tokens_per_s=1.0).text(),
            RANK0 + "summary: " + _summary(mean_step_s=None, tokens_per_s=None, tflops_per_gpu=None).text(),
        ]
    )
    parsed = train_runs.parse_summary(text)
    assert parsed is not None
    assert (parsed.step_ms, parsed.tokens_per_s, parsed.tflops_per_gpu) == (None, None, None)
    assert (
        train_runs.parse_summary("summary: " + _summary(last_iteration=0).text()) is None
    )  # nothing trained
    assert train_runs.parse_summary("no summary here") is None


def test_moe_block_line() -> None:
    text = RANK0 + "MoE block: MegaMoE (MegaMoE on: 32 experts/rank, backend=auto, precision=bf16)\n"
    assert train_runs.parse_moe_block(text) == (
        "MegaMoE",
        "MegaMoE on: 32 experts/rank, backend=auto, precision=bf16",
    )
    assert (
        train_runs.parse_moe_block(RANK0 + "MoE block: megatron-core MoELayer (off)")[0]
        == "megatron-core MoELayer"
    )
    assert train_runs.parse_moe_block("model: 1 chunk(s)") is None


MEGAMOE, GROUPED, SEQUENTIAL = (ab.BY_NAME[n] for n in ("megamoe", "grouped", "sequential"))


def _result(variant: ab.Variant, step_ms: float, tokens: float, tflops: float, mem: float) -> ab.Result:
    r = ab.Result(
        variant=variant.name, label=variant.label, returncode=0, moe_block=variant.moe_block,
        moe_reason=f"off; experts {variant.experts}" if variant.experts else "on",
    )  # fmt: skip
    r.summary = train_runs.RunSummary(
        first_iteration=0, last_iteration=15, first_loss=10.0, last_loss=9.0, step_ms=step_ms,
        tokens_per_s=tokens, tflops_per_gpu=tflops, peak_mem_gib=mem,
    )  # fmt: skip
    ab.check(r, variant)
    return r


def test_table_has_a_row_per_variant_mfu_and_a_ratio_per_baseline() -> None:
    rows = ab.table(
        [
            _result(MEGAMOE, 1000.0, 32768, 400, 100.0),
            _result(GROUPED, 1250.0, 26214, 320, 110.0),
            _result(SEQUENTIAL, 2000.0, 16384, 200, 100.0),
        ],
        dense_tflops=800.0,
    ).splitlines()
    assert rows[0].startswith(
        "| variant | MoE block | step (ms) | tokens/s | TFLOP/s/GPU | MFU | peak mem (GiB)"
    )
    assert (
        rows[2] == "| MegaMoE | MegaMoE | 1000.0 | 32,768 | 400 | 50.0 % | 100.00 | 10.0000 -> 9.0000 | ok |"
    )
    assert rows[3].startswith(
        "| megatron MoELayer, GroupedMLP on `torch._grouped_mm` | megatron-core MoELayer | 1250.0 | 26,214 | 320 | 40.0 %"
    )
    assert rows[5] == "| **MegaMoE / grouped** | | speed-up 1.250x | 1.250x | 1.250x | | 0.909x | | |"
    assert rows[6] == "| **MegaMoE / sequential** | | speed-up 2.000x | 2.000x | 2.000x | | 1.000x | | |"
    assert "| n/a |" in ab.table([_result(MEGAMOE, 1000.0, 1, 1, 1)])  # no dense rate: no MFU


def test_check_names_every_problem() -> None:
    r = ab.Result(variant="megamoe", label=MEGAMOE.label, returncode=1, moe_block=GROUPED.moe_block)
    ab.check(r, MEGAMOE)
    assert r.problems == [
        "exit status 1",
        "built 'megatron-core MoELayer', expected 'MegaMoE'",
        "no 'summary: trained iterations' line",
    ]
    assert "no summary" not in ab.table([r])  # a failed row still renders, without a ratio row
    assert len(ab.table([r]).splitlines()) == 3
    # megatron's MoELayer with the wrong expert module (the shim did not import, say) is a failure
    wrong = _result(GROUPED, 1.0, 1.0, 1.0, 1.0)
    wrong.problems.clear()
    wrong.moe_reason = "off; experts SequentialMLP"
    ab.check(wrong, GROUPED)
    assert wrong.problems == ["the MoE block does not say 'experts GroupedMLP'"]


def test_launch_argv_keeps_values_whole_and_the_switches_last(tmp_path: Path) -> None:
    odd = "Et|t*2,L $(touch /tmp/x) 'q'"
    argv = ab.launch_argv("py", Path("/c.yaml"), GROUPED, tmp_path, ["--pipeline_model_parallel_layout", odd])
    assert argv[:5] == ["py", "-m", "runner", "direct", "--log-dir"]
    assert argv[argv.index("--pipeline_model_parallel_layout") + 1] == odd
    assert argv[-6:] == [
        "--enable_primus_turbo", "True", "--moe_grouped_gemm", "True", "--use_turbo_mega_moe", "False"
    ]  # fmt: skip
    assert ab.launch_argv("py", Path("/c.yaml"), MEGAMOE, tmp_path, [])[-2:] == [
        "--use_turbo_mega_moe",
        "True",
    ]


def test_launch_env_puts_the_shim_first_only_where_it_is_used() -> None:
    base = {"MASTER_PORT": "4242", "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": "/mine"}
    env = ab.launch_env(base, MEGAMOE, 2)
    assert (env["GPUS_PER_NODE"], env["PRIMUS_JOB_ID"], env["MASTER_PORT"], env["NCCL_NVLS_ENABLE"]) == (
        "2",
        "megamoe",
        "4242",
        "0",
    )
    assert env["PYTHONPATH"] == "/mine"
    assert ab.launch_env(base, GROUPED, 1)["PYTHONPATH"] == os.pathsep.join(
        [str(ab.GROUPED_GEMM_SHIM), "/mine"]
    )
    assert ab.launch_env({}, GROUPED, 1)["PYTHONPATH"] == str(ab.GROUPED_GEMM_SHIM)
    assert (ab.GROUPED_GEMM_SHIM / "grouped_gemm" / "ops.py").is_file()


def test_variants_argument(capsys: pytest.CaptureFixture[str]) -> None:
    args, overrides = ab.parse_args(["--variants", "grouped, megamoe", "--", "--lr", "1"])
    assert [v.name for v in args.variants] == ["grouped", "megamoe"] and overrides == ["--lr", "1"]
    assert [v.name for v in ab.parse_args([])[0].variants] == ["megamoe", "grouped"]
    with pytest.raises(SystemExit):
        ab.parse_args(["--variants", "megamoe,alltoall"])
    assert (
        "unknown variant(s) ['alltoall']; choose from megamoe, grouped, sequential" in capsys.readouterr().err
    )


def _fake_launcher(tmp_path: Path, body: str) -> str:
    """A stand-in for the interpreter: prints what the trainer would, per variant."""
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


GOOD = f"""
case "$*" in
  *"--use_turbo_mega_moe True"*) block="MegaMoE"; why="on"; step=1000.0; tok=32,768 ;;
  *) block="megatron-core MoELayer"; why="off; experts GroupedMLP"; step=1250.0; tok=26,214 ;;
esac
echo "{RANK0}MoE block: $block ($why)"
echo "{RANK0}summary: trained iterations 1..15 | lm loss 10.4000 -> 9.8000 | step $step ms | $tok tokens/s | 400 TFLOP/s/GPU | peak mem 100.00 GiB | checkpoint none | wall 80.0 s"
"""


def test_main_runs_every_variant_and_writes_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--python", _fake_launcher(tmp_path, GOOD), "--out", str(out), "--dense-tflops", "800"]
    assert ab.main([*argv, "--", "--lr", "1e-4"]) == 0
    table = (out / "table.md").read_text()
    assert "| **MegaMoE / grouped** | | speed-up 1.250x | 1.250x |" in table
    assert "overrides: `--lr 1e-4`" in table and "MFU against dense bf16 800 TFLOP/s" in table
    results = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in results["results"]] == ["megamoe", "grouped"]
    assert all(r["ok"] for r in results["results"]) and results["dense_bf16_tflops"] == 800
    assert (out / "grouped" / "console.log").read_text().count("summary:") == 1
    assert "speed-up 1.250x" in capsys.readouterr().out


def test_main_fails_when_a_run_fails_but_still_runs_the_other(tmp_path: Path) -> None:
    body = GOOD + '\ncase "$*" in *"--use_turbo_mega_moe True"*) exit 3 ;; esac\n'
    out = tmp_path / "out"
    assert (
        ab.main(["--python", _fake_launcher(tmp_path, body), "--out", str(out), "--dense-tflops", "1"]) == 1
    )
    results = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert results["megamoe"]["problems"] == ["exit status 3"]
    assert results["grouped"]["ok"]


def test_main_stops_a_run_past_its_timeout(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fake = _fake_launcher(tmp_path, "echo started\nexec sleep 60\n")
    argv = ["--python", fake, "--out", str(out), "--variants", "sequential", "--timeout-s", "1", "--tiny"]
    assert ab.main(argv) == 1
    (result,) = json.loads((out / "results.json").read_text())["results"]
    assert result["timed_out"] and result["seconds"] < 30
    assert result["problems"][0] == "timed out after 1 s"


def test_dry_run_prints_the_commands_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert ab.main(["--python", "/nonexistent/python", "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "[bench] megamoe: GPUS_PER_NODE=1 /nonexistent/python -m runner direct" in printed
    assert f"[bench] grouped: GPUS_PER_NODE=1 PYTHONPATH={ab.GROUPED_GEMM_SHIM}:... " in printed
    assert not out.exists()


@pytest.mark.slow
def test_tiny_model_trains_every_way_on_two_cpu_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real path: python -m runner direct -> torchrun (2 ranks, gloo) -> train pretrain, three times;
    the grouped run imports megatron's GroupedMLP through the shim."""
    for name in ("TORCHDYNAMO_DISABLE", "OMP_NUM_THREADS"):
        if name not in os.environ:
            monkeypatch.setenv(name, "1")
    out = tmp_path / "out"
    assert ab.main(["--tiny", "--out", str(out), "--variants", "megamoe,grouped,sequential"]) == 0
    results = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert results["megamoe"]["moe_block"] == "MegaMoE"
    assert "experts GroupedMLP" in results["grouped"]["moe_reason"]
    assert "experts SequentialMLP" in results["sequential"]["moe_reason"]
    # Same seed, same forced routing: MegaMoE and SequentialMLP start from the same loss; GroupedMLP
    # initialises its weights in another layout, so only close to it.
    first = {name: r["summary"]["first_loss"] for name, r in results.items()}
    assert first["megamoe"] == pytest.approx(first["sequential"])
    assert first["grouped"] == pytest.approx(first["megamoe"], rel=1e-2)
    assert (out / "megamoe" / "logs" / "megamoe-node0.log").is_file()
    assert (out / "grouped" / "workspace").is_dir()
