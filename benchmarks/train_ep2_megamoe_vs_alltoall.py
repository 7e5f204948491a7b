"""End to end on one node: ``train pretrain`` with MegaMoE on, then off, in one script; one table.

    python -m benchmarks.train_ep2_megamoe_vs_alltoall [--out DIR] [--gpus N] [--train-iters N]
        [--timeout-s S] [--only megamoe|alltoall] [--tiny] [--dry-run] [-- trainer overrides ...]

Each variant is a fresh ``primus-cli direct -- train pretrain --config <experiment>`` (run as
``python -m runner``, so the checkout needs no pip install) with ``GPUS_PER_NODE`` ranks:

* ``megamoe``:  ``--enable_primus_turbo True --use_turbo_mega_moe True`` (MegaMoE's fused expert path);
* ``alltoall``: ``--enable_primus_turbo True --use_turbo_mega_moe False`` (megatron-core's ``MoELayer``:
  the alltoall token dispatcher and its SequentialMLP experts; no grouped-GEMM package is installed).

The default experiment is a 4-layer DeepSeek-V3 for 2 GPUs (EP=2, mock data, uniform forced routing):
``examples/megatron/configs/H200/deepseek_v3_4layer_ep2-BF16-pretrain.yaml``. Trainer overrides after
``--`` go to both runs (before the MegaMoE switch, which stays last). ``--tiny`` shrinks the model
to seconds on 2 CPU ranks (gloo; MegaMoE then runs its reference backend): a check of the whole
path before GPU time is spent.

Both variants always run, each under ``--timeout-s``. The trainer's closing ``summary:`` line (mean
step after its ``log_avg_skip_iterations`` warm-up steps, tokens/s of the job, model TFLOP/s per
GPU, peak memory over ranks) is parsed from each run's console output, and the ``MoE block:`` line
shows which MoE path was built. Written under ``--out`` (default ``$MEGAMOE_BENCH_OUT``, else
``./output/bench/train_ep2_megamoe_vs_alltoall/<time>``): ``table.md`` (also printed),
``results.json``, and per variant ``<variant>/console.log``, the launcher's node and rank logs in
``<variant>/logs/`` and the trainer's ``training_log.jsonl`` under ``<variant>/workspace/``.
Exit status 0 only when both runs succeeded, trained, built the expected MoE path and printed a
summary.

No value is ever evaluated by a shell: every command is an argument list.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import train_runs
from benchmarks.train_runs import ROOT, fmt, run_logged

DEFAULT_CONFIG = ROOT / "examples/megatron/configs/H200/deepseek_v3_4layer_ep2-BF16-pretrain.yaml"
OUT_ENV = "MEGAMOE_BENCH_OUT"


@dataclass(frozen=True)
class Variant:
    name: str
    mega_moe: bool
    label: str
    moe_block: str  # what the trainer's "MoE block:" line must name

    def switch_args(self) -> tuple[str, ...]:
        return ("--enable_primus_turbo", "True", "--use_turbo_mega_moe", str(self.mega_moe))


VARIANTS = (
    Variant("megamoe", True, "MegaMoE (`--use_turbo_mega_moe True`)", "MegaMoE"),
    Variant("alltoall", False, "megatron alltoall (`--use_turbo_mega_moe False`)", "megatron-core MoELayer"),
)

# The CPU smoke size: DeepSeek-V3's structure (MLA, 1 dense + 3 MoE layers, group-limited sigmoid top-k,
# shared expert) at toy widths, fp32 (CPU matmuls), a few steps.
TINY_ARGS = (
    "--hidden_size", "64", "--ffn_hidden_size", "128", "--num_attention_heads", "4",
    "--q_lora_rank", "32", "--kv_lora_rank", "16", "--qk_head_dim", "16", "--qk_pos_emb_head_dim", "8",
    "--v_head_dim", "16", "--num_experts", "8", "--moe_ffn_hidden_size", "32",
    "--moe_shared_expert_intermediate_size", "32", "--moe_router_topk", "2", "--moe_router_num_groups", "4",
    "--moe_router_group_topk", "2", "--vocab_size", "128", "--make_vocab_size_divisible_by", "32",
    "--seq_length", "64", "--max_position_embeddings", "64", "--original_max_position_embeddings", "64",
    "--rotary_scaling_factor", "1.0", "--init_method_std", "0.02", "--bf16", "False",
    "--train_iters", "4", "--log_avg_skip_iterations", "1",
)  # fmt: skip


@dataclass
class Result(train_runs.RunRecord):
    variant: str
    label: str


def check(result: Result, variant: Variant) -> None:
    """Fill ``result.problems``: failed, timed out, wrong MoE path, no summary."""
    if result.timed_out:
        result.problems.append(f"timed out after {result.timeout_s:.0f} s")
    elif result.returncode != 0:
        result.problems.append(f"exit status {result.returncode}")
    if result.moe_block is None:
        result.problems.append("no 'MoE block:' line (the model was not built)")
    elif result.moe_block != variant.moe_block:
        result.problems.append(f"built {result.moe_block!r}, expected {variant.moe_block!r}")
    if result.summary is None:
        result.problems.append("no 'summary: trained iterations' line")
    elif result.summary.tokens_per_s is None:
        result.problems.append("the summary has no timed steps")


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.3f}x"


def table(results: list[Result]) -> str:
    """Markdown: one row per variant, then MegaMoE / alltoall when both have numbers."""
    lines = [
        "| variant | MoE block | step (ms) | tokens/s | TFLOP/s/GPU | peak mem (GiB) | lm loss first -> last | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        s = r.summary
        loss = "n/a" if s is None else f"{fmt(s.first_loss, '.4f')} -> {fmt(s.last_loss, '.4f')}"
        lines.append(
            f"| {r.label} | {r.moe_block or 'n/a'} | {fmt(s and s.step_ms, '.1f')} | "
            f"{fmt(s and s.tokens_per_s, ',.0f')} | {fmt(s and s.tflops_per_gpu, '.3g')} | "
            f"{fmt(s and s.peak_mem_gib, '.2f')} | {loss} | {'ok' if r.ok else '; '.join(r.problems)} |"
        )
    by_name = {r.variant: r for r in results}
    on, off = by_name.get("megamoe"), by_name.get("alltoall")
    if on and off and on.summary and off.summary:
        a, b = on.summary, off.summary
        lines.append(
            f"| **MegaMoE / alltoall** | | speed-up {_ratio(b.step_ms, a.step_ms)} | "
            f"{_ratio(a.tokens_per_s, b.tokens_per_s)} | {_ratio(a.tflops_per_gpu, b.tflops_per_gpu)} | "
            f"{_ratio(a.peak_mem_gib, b.peak_mem_gib)} | | |"
        )
    return "\n".join(lines)


def launch_argv(python: str, config: Path, variant: Variant, vdir: Path, overrides: list[str]) -> list[str]:
    """``primus-cli direct --log-dir <vdir>/logs -- train pretrain --config ... <overrides> <switch>``."""
    return train_runs.runner_argv(
        python,
        vdir / "logs",
        ["--config", str(config), "--workspace", str(vdir / "workspace"), *overrides, *variant.switch_args()],
    )


def launch_env(base: dict[str, str], variant: Variant, gpus: int) -> dict[str, str]:
    """The node log: ``<vdir>/logs/<variant>-node0.log``."""
    return train_runs.launch_env(base, variant.name, gpus)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, overrides = train_runs.split_overrides(argv)
    p = argparse.ArgumentParser(
        prog="train_ep2_megamoe_vs_alltoall.py",
        description="train pretrain with MegaMoE on and off (megatron alltoall); one table.",
    )
    p.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="experiment YAML (default: %(default)s)"
    )
    p.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default: ${OUT_ENV}, else ./output/bench/...)"
    )
    p.add_argument("--gpus", type=int, default=2, help="ranks on this node, GPUS_PER_NODE (default: 2)")
    p.add_argument(
        "--train-iters", type=int, default=None, help="override train_iters (default: the experiment's)"
    )
    p.add_argument("--timeout-s", type=float, default=240.0, help="per variant (default: %(default)s)")
    p.add_argument("--only", choices=[v.name for v in VARIANTS], default=None, help="run one variant")
    p.add_argument("--tiny", action="store_true", help="toy widths, fp32, 4 steps: a CPU check of the path")
    p.add_argument(
        "--python", default=sys.executable, help="interpreter for the launcher (default: this one)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p.parse_args(argv), overrides


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or Path(
        os.environ.get(OUT_ENV)
        or ROOT / "output/bench/train_ep2_megamoe_vs_alltoall" / time.strftime("%Y%m%d-%H%M%S")
    )
    out = out.resolve()
    config = args.config.resolve()
    overrides = [*(TINY_ARGS if args.tiny else ()), *extra]
    if args.train_iters is not None:
        overrides += ["--train_iters", str(args.train_iters)]
    variants = [v for v in VARIANTS if args.only in (None, v.name)]
    results: list[Result] = []
    for variant in variants:
        vdir = out / variant.name
        cmd = launch_argv(args.python, config, variant, vdir, overrides)
        result = Result(
            variant=variant.name, label=variant.label, command=cmd, console_log=str(vdir / "console.log"),
            timeout_s=args.timeout_s,
        )  # fmt: skip
        results.append(result)
        print(f"[bench] {variant.name}: GPUS_PER_NODE={args.gpus} {' '.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        vdir.mkdir(parents=True, exist_ok=True)
        env = launch_env(dict(os.environ), variant, args.gpus)
        result.returncode, result.timed_out, result.seconds = run_logged(
            cmd, env, vdir / "console.log", args.timeout_s
        )
        result.read_console((vdir / "console.log").read_text(errors="replace"))
        check(result, variant)
        print(
            f"[bench] {variant.name}: {'ok' if result.ok else '; '.join(result.problems)} ({result.seconds:.0f} s)",
            flush=True,
        )
    if args.dry_run:
        return 0

    header = [
        f"{train_runs.machine()}, {args.gpus} ranks, commit {train_runs.commit()}, "
        + ", ".join(f"{k} {v}" for k, v in train_runs.versions().items()),
        f"experiment: `{config.relative_to(ROOT) if config.is_relative_to(ROOT) else config}`"
        + (f", overrides: `{' '.join(overrides)}`" if overrides else ""),
        "",
    ]
    text = "\n".join([*header, table(results), ""])
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(
            {
                "config": str(config),
                "overrides": overrides,
                "gpus": args.gpus,
                "machine": train_runs.machine(),
                "commit": train_runs.commit(),
                "versions": train_runs.versions(),
                "results": [{**asdict(r), "ok": r.ok} for r in results],
            },
            indent=2,
        )
    )
    print("\n" + text)
    print(f"[bench] written: {out / 'table.md'}, {out / 'results.json'}, logs under {out}/<variant>/")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
