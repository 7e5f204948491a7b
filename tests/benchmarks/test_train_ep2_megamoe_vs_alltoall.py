"""The end-to-end A/B script: the trainer's summary line parsed back, the table, the launch argv,
and ``main`` over a stand-in launcher (exit status, timeout, files); one real 2-rank CPU run (slow)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from benchmarks import train_ep2_megamoe_vs_alltoall as ab
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


def _result(variant: ab.Variant, step_ms: float, tokens: float, tflops: float, mem: float) -> ab.Result:
    r = ab.Result(variant=variant.name, label=variant.label, returncode=0, moe_block=variant.moe_block)
    r.summary = train_runs.RunSummary(
        first_iteration=0, last_iteration=15, first_loss=10.0, last_loss=9.0, step_ms=step_ms,
        tokens_per_s=tokens, tflops_per_gpu=tflops, peak_mem_gib=mem,
    )  # fmt: skip
    ab.check(r, variant)
    return r


def test_table_has_a_row_per_variant_and_the_ratios() -> None:
    on, off = ab.VARIANTS
    rows = ab.table(
        [_result(on, 1000.0, 32768, 400, 100.0), _result(off, 1250.0, 26214, 320, 110.0)]
    ).splitlines()
    assert rows[0].startswith("| variant | MoE block | step (ms) | tokens/s | TFLOP/s/GPU | peak mem (GiB)")
    assert rows[2] == (
        "| MegaMoE (`--use_turbo_mega_moe True`) | MegaMoE | 1000.0 | 32,768 | 400 | 100.00 | 10.0000 -> 9.0000 | ok |"
    )
    assert rows[3].startswith(
        "| megatron alltoall (`--use_turbo_mega_moe False`) | megatron-core MoELayer | 1250.0"
    )
    assert rows[4] == "| **MegaMoE / alltoall** | | speed-up 1.250x | 1.250x | 1.250x | 0.909x | | |"


def test_check_names_every_problem() -> None:
    on, off = ab.VARIANTS
    r = ab.Result(variant="megamoe", label=on.label, returncode=1, moe_block=off.moe_block)
    ab.check(r, on)
    assert r.problems == [
        "exit status 1",
        "built 'megatron-core MoELayer', expected 'MegaMoE'",
        "no 'summary: trained iterations' line",
    ]
    assert "no summary" not in ab.table([r])  # a failed row still renders, without a ratio row
    assert len(ab.table([r]).splitlines()) == 3


def test_launch_argv_keeps_values_whole_and_the_switch_last(tmp_path: Path) -> None:
    odd = "Et|t*2,L $(touch /tmp/x) 'q'"
    argv = ab.launch_argv(
        "py", Path("/c.yaml"), ab.VARIANTS[1], tmp_path, ["--pipeline_model_parallel_layout", odd]
    )
    assert argv[:5] == ["py", "-m", "runner", "direct", "--log-dir"]
    assert argv[argv.index("--pipeline_model_parallel_layout") + 1] == odd
    assert argv[-4:] == ["--enable_primus_turbo", "True", "--use_turbo_mega_moe", "False"]
    env = ab.launch_env({"MASTER_PORT": "4242", "NCCL_NVLS_ENABLE": "0"}, ab.VARIANTS[0], 2)
    assert (env["GPUS_PER_NODE"], env["PRIMUS_JOB_ID"], env["MASTER_PORT"], env["NCCL_NVLS_ENABLE"]) == (
        "2",
        "megamoe",
        "4242",
        "0",
    )


def _fake_launcher(tmp_path: Path, body: str) -> str:
    """A stand-in for the interpreter: prints what the trainer would, per variant."""
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


GOOD = f"""
case "$*" in
  *"--use_turbo_mega_moe True"*) block="MegaMoE"; step=1000.0; tok=32,768 ;;
  *) block="megatron-core MoELayer"; step=1250.0; tok=26,214 ;;
esac
echo "{RANK0}MoE block: $block (why)"
echo "{RANK0}summary: trained iterations 1..15 | lm loss 10.4000 -> 9.8000 | step $step ms | $tok tokens/s | 400 TFLOP/s/GPU | peak mem 100.00 GiB | checkpoint none | wall 80.0 s"
"""


def test_main_runs_both_and_writes_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = ab.main(["--python", _fake_launcher(tmp_path, GOOD), "--out", str(out), "--", "--lr", "1e-4"])
    assert code == 0
    table = (out / "table.md").read_text()
    assert "| **MegaMoE / alltoall** | | speed-up 1.250x | 1.250x |" in table
    assert "overrides: `--lr 1e-4`" in table
    results = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in results["results"]] == ["megamoe", "alltoall"]
    assert all(r["ok"] for r in results["results"])
    assert (out / "alltoall" / "console.log").read_text().count("summary:") == 1
    assert "speed-up 1.250x" in capsys.readouterr().out


def test_main_fails_when_a_run_fails_but_still_runs_the_other(tmp_path: Path) -> None:
    body = GOOD + '\ncase "$*" in *"--use_turbo_mega_moe True"*) exit 3 ;; esac\n'
    out = tmp_path / "out"
    assert ab.main(["--python", _fake_launcher(tmp_path, body), "--out", str(out)]) == 1
    results = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert results["megamoe"]["problems"] == ["exit status 3"]
    assert results["alltoall"]["ok"]


def test_main_stops_a_run_past_its_timeout(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fake = _fake_launcher(tmp_path, "echo started\nexec sleep 60\n")
    assert ab.main(["--python", fake, "--out", str(out), "--only", "alltoall", "--timeout-s", "1"]) == 1
    (result,) = json.loads((out / "results.json").read_text())["results"]
    assert result["timed_out"] and result["seconds"] < 30
    assert result["problems"][0] == "timed out after 1 s"


@pytest.mark.slow
def test_tiny_model_trains_both_ways_on_two_cpu_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real path: python -m runner direct -> torchrun (2 ranks, gloo) -> train pretrain, twice."""
    for name in ("TORCHDYNAMO_DISABLE", "OMP_NUM_THREADS"):
        if name not in os.environ:
            monkeypatch.setenv(name, "1")
    out = tmp_path / "out"
    assert ab.main(["--tiny", "--out", str(out), "--timeout-s", "240"]) == 0
    results = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert results["megamoe"]["moe_block"] == "MegaMoE"
    assert results["alltoall"]["moe_block"] == "megatron-core MoELayer"
    # Same seed, same forced routing: both paths start from the same loss.
    assert results["megamoe"]["summary"]["first_loss"] == pytest.approx(
        results["alltoall"]["summary"]["first_loss"]
    )
    assert (out / "megamoe" / "logs" / "megamoe-node0.log").is_file()
    assert (out / "alltoall" / "workspace").is_dir()
