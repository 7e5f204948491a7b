"""End to end on one node: ``train pretrain`` with MegaMoE, then with megatron-core's own MoE layer.

    python -m benchmarks.train_e2e_compare [--config YAML] [--gpus N] [--out DIR] [--train-iters N]
        [--variants megamoe,grouped[,sequential]] [--dense-tflops X] [--timeout-s S] [--tiny]
        [--dry-run] [-- trainer overrides ...]

Each variant is a fresh ``primus-cli direct -- train pretrain --config <experiment>`` (run as
``python -m runner``, so the checkout needs no pip install) with ``GPUS_PER_NODE`` ranks:

* ``megamoe``: ``--use_turbo_mega_moe True``, MegaMoE's fused expert path;
* ``grouped``: ``--use_turbo_mega_moe False --moe_grouped_gemm True``, megatron-core's ``MoELayer`` with
  the alltoall token dispatcher and its grouped-GEMM experts (``GroupedMLP``, megatron's best expert
  path without Transformer Engine), whose ``grouped_gemm.ops.gmm`` is ``benchmarks/grouped_gemm_shim``
  on ``torch._grouped_mm`` (put first on the run's ``PYTHONPATH``);
* ``sequential``: ``--use_turbo_mega_moe False --moe_grouped_gemm False``, the same ``MoELayer`` with
  ``SequentialMLP`` (a Python loop over the experts), for reference only.

The default experiment is a 4-layer DeepSeek-V3 on one GPU (mock data, uniform forced routing):
``examples/megatron/configs/H200/deepseek_v3_4layer-BF16-pretrain.yaml``; its EP=2 twin is
``deepseek_v3_4layer_ep2-BF16-pretrain.yaml`` with ``--gpus 2``. Trainer overrides after ``--`` go to
every run (before the variant's switches, which stay last). ``--tiny`` shrinks the model to seconds on
2 CPU ranks (gloo; MegaMoE then runs its reference backend): a check of the whole path before GPU
time is spent.

Every variant runs, each under ``--timeout-s``. The trainer's closing ``summary:`` line (mean step
after its ``log_avg_skip_iterations`` warm-up steps, tokens/s of the job, model TFLOP/s per GPU, peak
memory over ranks) is parsed from each run's console output, and the ``MoE block:`` line shows which
MoE path and expert module were built. MFU is the TFLOP/s per GPU over the dense bf16 matmul rate:
``--dense-tflops``, else measured here on the GPU after the runs (8192^3 ``torch.matmul``). Written
under ``--out`` (default ``$MEGAMOE_BENCH_OUT``, else ``./output/bench/train_e2e_compare/<time>``):
``table.md`` (also printed), ``results.json``, and per variant ``<variant>/console.log``, the
launcher's node and rank logs in ``<variant>/logs/`` and the trainer's ``training_log.jsonl`` under
``<variant>/workspace/``. Exit status 0 only when every run succeeded, trained, built the expected
MoE path and printed a summary.

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

DEFAULT_CONFIG = ROOT / "examples/megatron/configs/H200/deepseek_v3_4layer-BF16-pretrain.yaml"
GROUPED_GEMM_SHIM = ROOT / "benchmarks/grouped_gemm_shim"
OUT_ENV = "MEGAMOE_BENCH_OUT"


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    switch_args: tuple[str, ...]  # last on the command line, so no override can undo them
    moe_block: str  # what the trainer's "MoE block:" line must name
    experts: str | None = None  # the expert module its reason must name (megatron's MoELayer only)
    grouped_gemm_shim: bool = False

    def env(self, base: dict[str, str]) -> dict[str, str]:
        if not self.grouped_gemm_shim:
            return base
        path = [str(GROUPED_GEMM_SHIM), *filter(None, [base.get("PYTHONPATH")])]
        return {**base, "PYTHONPATH": os.pathsep.join(path)}


def _switch(mega_moe: bool, *extra: str) -> tuple[str, ...]:
    return ("--enable_primus_turbo", "True", *extra, "--use_turbo_mega_moe", str(mega_moe))


VARIANTS = (
    Variant("megamoe", "MegaMoE", _switch(True), "MegaMoE"),
    Variant(
        "grouped",
        "megatron MoELayer, GroupedMLP on `torch._grouped_mm`",
        _switch(False, "--moe_grouped_gemm", "True"),
        "megatron-core MoELayer",
        experts="GroupedMLP",
        grouped_gemm_shim=True,
    ),
    Variant(
        "sequential",
        "megatron MoELayer, SequentialMLP",
        _switch(False, "--moe_grouped_gemm", "False"),
        "megatron-core MoELayer",
        experts="SequentialMLP",
    ),
)
BY_NAME = {v.name: v for v in VARIANTS}
DEFAULT_VARIANTS = "megamoe,grouped"

# The CPU smoke size: DeepSeek-V3's structure (MLA, 1 dense + 3 MoE layers, group-limited sigmoid top-k,
# shared expert) at toy widths, a few steps, 2 ranks with EP=2. bf16, as megatron's GroupedMLP requires.
TINY_ARGS = (
    "--hidden_size", "64", "--ffn_hidden_size", "128", "--num_attention_heads", "4",
    "--q_lora_rank", "32", "--kv_lora_rank", "16", "--qk_head_dim", "16", "--qk_pos_emb_head_dim", "8",
    "--v_head_dim", "16", "--num_experts", "8", "--moe_ffn_hidden_size", "32",
    "--moe_shared_expert_intermediate_size", "32", "--moe_router_topk", "2", "--moe_router_num_groups", "4",
    "--moe_router_group_topk", "2", "--vocab_size", "128", "--make_vocab_size_divisible_by", "32",
    "--seq_length", "64", "--max_position_embeddings", "64", "--original_max_position_embeddings", "64",
    "--rotary_scaling_factor", "1.0", "--init_method_std", "0.02", "--expert_model_parallel_size", "2",
    "--train_iters", "4", "--log_avg_skip_iterations", "1",
)  # fmt: skip
TINY_GPUS = 2


@dataclass
class Result(train_runs.RunRecord):
    variant: str
    label: str


def check(result: Result, variant: Variant) -> None:
    """Fill ``result.problems``: failed, timed out, wrong MoE path or expert module, no summary."""
    if result.timed_out:
        result.problems.append(f"timed out after {result.timeout_s:.0f} s")
    elif result.returncode != 0:
        result.problems.append(f"exit status {result.returncode}")
    if result.moe_block is None:
        result.problems.append("no 'MoE block:' line (the model was not built)")
    elif result.moe_block != variant.moe_block:
        result.problems.append(f"built {result.moe_block!r}, expected {variant.moe_block!r}")
    elif variant.experts and f"experts {variant.experts}" not in (result.moe_reason or ""):
        result.problems.append(f"the MoE block does not say 'experts {variant.experts}'")
    if result.summary is None:
        result.problems.append("no 'summary: trained iterations' line")
    elif result.summary.tokens_per_s is None:
        result.problems.append("the summary has no timed steps")


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.3f}x"


def _mfu(tflops: float | None, dense_tflops: float | None) -> str:
    return "n/a" if tflops is None or not dense_tflops else f"{100 * tflops / dense_tflops:.1f} %"


def table(results: list[Result], dense_tflops: float | None = None) -> str:
    """Markdown: one row per variant, then MegaMoE over each baseline that has numbers."""
    lines = [
        "| variant | MoE block | step (ms) | tokens/s | TFLOP/s/GPU | MFU | peak mem (GiB) | "
        "lm loss first -> last | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        s = r.summary
        loss = "n/a" if s is None else f"{fmt(s.first_loss, '.4f')} -> {fmt(s.last_loss, '.4f')}"
        lines.append(
            f"| {r.label} | {r.moe_block or 'n/a'} | {fmt(s and s.step_ms, '.1f')} | "
            f"{fmt(s and s.tokens_per_s, ',.0f')} | {fmt(s and s.tflops_per_gpu, '.3g')} | "
            f"{_mfu(s and s.tflops_per_gpu, dense_tflops)} | {fmt(s and s.peak_mem_gib, '.2f')} | {loss} | "
            f"{'ok' if r.ok else '; '.join(r.problems)} |"
        )
    on = next((r for r in results if r.variant == "megamoe"), None)
    for off in results:
        if on is None or off is on or not (on.summary and off.summary):
            continue
        a, b = on.summary, off.summary
        lines.append(
            f"| **MegaMoE / {off.variant}** | | speed-up {_ratio(b.step_ms, a.step_ms)} | "
            f"{_ratio(a.tokens_per_s, b.tokens_per_s)} | {_ratio(a.tflops_per_gpu, b.tflops_per_gpu)} | | "
            f"{_ratio(a.peak_mem_gib, b.peak_mem_gib)} | | |"
        )
    return "\n".join(lines)


def launch_argv(python: str, config: Path, variant: Variant, vdir: Path, overrides: list[str]) -> list[str]:
    """``primus-cli direct --log-dir <vdir>/logs -- train pretrain --config ... <overrides> <switch>``."""
    return train_runs.runner_argv(
        python,
        vdir / "logs",
        ["--config", str(config), "--workspace", str(vdir / "workspace"), *overrides, *variant.switch_args],
    )


def launch_env(base: dict[str, str], variant: Variant, gpus: int) -> dict[str, str]:
    """The node log: ``<vdir>/logs/<variant>-node0.log``; the shim on ``PYTHONPATH`` where it is used."""
    return train_runs.launch_env(variant.env(base), variant.name, gpus)


def dense_bf16_tflops(n: int = 8192, repeats: int = 20) -> float | None:
    """The GPU's dense bf16 rate, ``torch.matmul`` of ``n x n x n`` (None without a GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) * 1e-3) / 1e12


def _variants(text: str) -> list[Variant]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown variant(s) {unknown or text!r}; choose from {', '.join(BY_NAME)}"
        )
    return [BY_NAME[n] for n in names]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, overrides = train_runs.split_overrides(argv)
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.train_e2e_compare",
        description="train pretrain with MegaMoE and with megatron-core's MoELayer; one table.",
    )
    p.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="experiment YAML (default: %(default)s)"
    )
    p.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default: ${OUT_ENV}, else ./output/bench/...)"
    )
    p.add_argument("--gpus", type=int, default=None, help="ranks on this node, GPUS_PER_NODE (default: 1)")
    p.add_argument(
        "--train-iters", type=int, default=None, help="override train_iters (default: the experiment's)"
    )
    p.add_argument(
        "--variants", type=_variants, default=_variants(DEFAULT_VARIANTS),
        help=f"comma-separated, from {', '.join(BY_NAME)} (default: {DEFAULT_VARIANTS})",
    )  # fmt: skip
    p.add_argument(
        "--dense-tflops", type=float, default=None,
        help="the dense bf16 rate MFU is taken against (default: measured on this GPU)",
    )  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=300.0, help="per variant (default: %(default)s)")
    p.add_argument(
        "--tiny", action="store_true", help="toy widths, 4 steps, 2 CPU ranks: a check of the path"
    )
    p.add_argument(
        "--python", default=sys.executable, help="interpreter for the launcher (default: this one)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p.parse_args(argv), overrides


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or Path(
        os.environ.get(OUT_ENV) or ROOT / "output/bench/train_e2e_compare" / time.strftime("%Y%m%d-%H%M%S")
    )
    out = out.resolve()
    config = args.config.resolve()
    gpus = args.gpus or (TINY_GPUS if args.tiny else 1)
    overrides = [*(TINY_ARGS if args.tiny else ()), *extra]
    if args.train_iters is not None:
        overrides += ["--train_iters", str(args.train_iters)]
    results: list[Result] = []
    for variant in args.variants:
        vdir = out / variant.name
        cmd = launch_argv(args.python, config, variant, vdir, overrides)
        result = Result(
            variant=variant.name, label=variant.label, command=cmd, console_log=str(vdir / "console.log"),
            timeout_s=args.timeout_s,
        )  # fmt: skip
        results.append(result)
        shim = f"PYTHONPATH={GROUPED_GEMM_SHIM}:... " if variant.grouped_gemm_shim else ""
        print(f"[bench] {variant.name}: GPUS_PER_NODE={gpus} {shim}{' '.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        vdir.mkdir(parents=True, exist_ok=True)
        env = launch_env(dict(os.environ), variant, gpus)
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

    dense = args.dense_tflops or (None if args.tiny else dense_bf16_tflops())
    header = [
        f"{train_runs.machine()}, {gpus} ranks, commit {train_runs.commit()}, "
        + ", ".join(f"{k} {v}" for k, v in train_runs.versions().items()),
        f"experiment: `{config.relative_to(ROOT) if config.is_relative_to(ROOT) else config}`"
        + (f", overrides: `{' '.join(overrides)}`" if overrides else ""),
        f"MFU against dense bf16 {dense:.0f} TFLOP/s" if dense else "MFU: no dense rate (no GPU)",
        "",
    ]
    text = "\n".join([*header, table(results, dense), ""])
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(
            {
                "config": str(config),
                "overrides": overrides,
                "gpus": gpus,
                "dense_bf16_tflops": dense,
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
