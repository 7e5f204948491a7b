"""FP8 against bf16 in training: ``train pretrain`` on the demo's real text, once per expert precision.

    python -m benchmarks.train_precision_compare [--out DIR] [--precisions bf16,fp8[,mxfp8]]
        [--train-iters N] [--eval-interval N] [--eval-iters N] [--seed S] [--gpus N] [--timeout-s S]
        [--data-dir DIR] [--tolerance 0.015] [--tiny] [--dry-run] [-- trainer overrides ...]

1. The data: the demo's corpus (the Python Language Reference from CPython's ``pydoc_data``), its
   local BPE tokenizer and the megatron indexed dataset, made as ``make demo-data`` makes them
   (``examples/data/make_demo_corpus.py``, then ``python -m megamoe.train prepare-data``) into
   ``--data-dir`` (default ``<out>/data``) unless they are there already.
2. One run per precision, each a fresh ``primus-cli direct -- train pretrain`` (``python -m runner``,
   so the checkout needs no pip install) under ``--timeout-s``: the same experiment, seed and data
   order, MegaMoE on (``--enable_primus_turbo True --use_turbo_mega_moe True``) with
   ``--turbo_mega_moe_precision P`` last. The model is the toy DeepSeek-V3 (``PRIMUS_MODEL=
   deepseek_v3_tiny`` in ``examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml``: MLA,
   MTP, 16 experts top-4 in 4 groups, shared expert; hidden 256 and expert FFN 128, multiples of 16
   as the FP8 Triton kernels need) on one GPU, bf16 parameters, learned routing, seq 512,
   micro-batch 8 = global batch 8, 300 iterations, validation every 50 (3 batches).
   ``--tiny`` is the CPU check of the same path: the demo's ``moe_tiny`` for 6 iterations of 4
   sequences of 64 tokens per rank, EP over the ``--gpus`` gloo ranks; its parameters are fp32, so
   "bf16" there is the unquantised path in fp32, and fp8 / mxfp8 run the exact CPU emulation.
   Every run gets ``TORCHDYNAMO_DISABLE=1`` unless it is set: megatron-core's few torch.compile'd
   fusions cost seconds a process and do not change what is compared.
3. Read back (``benchmarks/train_precision_report.py``): each run's ``training_log.jsonl``
   (per-iteration lm loss, validation loss at every evaluation) and its closing ``summary:`` line
   (mean step after warm-up, tokens/s, peak memory).

Written under ``--out`` (default ``$MEGAMOE_BENCH_OUT``, else
``./output/bench/train_precision_compare/<time>``): ``results.json`` (per precision: the curves, the
final train loss as the mean of the last 10 iterations, the final validation loss, speed, memory;
each precision against bf16), ``table.md`` (also printed: the relative differences of the final
losses against bf16 and whether they are within ``--tolerance``, and the curves at the evaluation
points), ``loss_curves.png``, and per precision ``<precision>/console.log``, the launcher's logs in
``<precision>/logs/`` and the trainer's files under ``<precision>/workspace/``.

Exit status 0 when every run trained to the end with the expected MoE path and precision and finite
losses; a loss outside the tolerance is a result (the table says "no"), not a failure.
Results and how they were measured: docs/fp8.md, "Training: FP8 against bf16".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import train_runs
from benchmarks.train_precision_report import (
    BASELINE,
    FINAL_WINDOW,
    PrecisionRun,
    check,
    compare,
    curves_table,
    plot,
    read_back,
    table,
)
from benchmarks.train_runs import ROOT

OUT_ENV = "MEGAMOE_BENCH_OUT"
PRECISIONS = ("bf16", "fp8", "mxfp8")
GPU_CONFIG = ROOT / "examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml"
GPU_MODEL = "deepseek_v3_tiny"
TINY_CONFIG = ROOT / "examples/megatron/configs/cpu/moe_tiny-pretrain.yaml"
DATA_PREFIX = "pydoc"  # -> pydoc_text_document.{bin,idx}

# One GPU, EP=1, no pipeline, no recompute (docs/training.md, "On a GPU (measured)"); the demo's
# tokenizer (2,048 ids, above the preset's 1,024); learned routing (the seed file forces uniform
# routing for speed runs, which would take the router out of an accuracy comparison).
GPU_ARGS = (
    "--pipeline_model_parallel_size", "1", "--pipeline_model_parallel_layout", "null",
    "--expert_model_parallel_size", "1", "--recompute_granularity", "null", "--recompute_num_layers", "0",
    "--micro_batch_size", "8", "--global_batch_size", "8", "--seq_length", "512", "--lr", "1e-3",
    "--moe_router_force_load_balancing", "False", "--log_interval", "10", "--log_avg_skip_iterations", "5",
)  # fmt: skip
# The demo model on CPU: one micro-batch of 4 per rank, EP over all ranks (build_plan adds both).
TINY_ARGS = (
    "--micro_batch_size", "4", "--seq_length", "64", "--log_interval", "1", "--log_avg_skip_iterations", "1",
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Everything a run of this script does, decided before anything runs (what ``--dry-run`` prints)."""

    out: Path
    data_dir: Path
    config: Path
    precisions: tuple[str, ...]
    gpus: int
    overrides: tuple[str, ...]
    """Trainer arguments shared by every run (before the MegaMoE switch)."""
    env: dict[str, str]
    """Set for every run (``PRIMUS_MODEL``, ...)."""
    python: str

    def data_commands(self) -> list[list[str]]:
        """``make demo-data``'s two steps, into ``data_dir``."""
        d = self.data_dir
        return [
            [self.python, str(ROOT / "examples/data/make_demo_corpus.py"), "--output", str(d), "--vocab-size", "2048"],
            [self.python, "-m", "megamoe.train", "prepare-data", "--input", str(d / "corpus.jsonl"),
             "--output-prefix", str(d / DATA_PREFIX), "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", str(d / "tokenizer"), "--json-keys", "text", "--append-eod", "--workers", "2"],
        ]  # fmt: skip

    def run_dir(self, precision: str) -> Path:
        return self.out / precision

    def train_command(self, precision: str) -> list[str]:
        rdir = self.run_dir(precision)
        return train_runs.runner_argv(
            self.python,
            rdir / "logs",
            [
                "--config", str(self.config), "--workspace", str(rdir / "workspace"), *self.overrides,
                *switch_args(precision),
            ],
        )  # fmt: skip


def switch_args(precision: str) -> tuple[str, ...]:
    """MegaMoE on, at ``precision``: always the last arguments, so no override can turn it off."""
    return (
        "--enable_primus_turbo", "True", "--use_turbo_mega_moe", "True", "--turbo_mega_moe_precision", precision,
    )  # fmt: skip


def data_args(data_dir: Path) -> tuple[str, ...]:
    """docs/training.md "Your own data": the prepared text, its tokenizer and the demo's split."""
    return (
        "--mock_data", "False", "--data_path", str(data_dir / f"{DATA_PREFIX}_text_document"),
        "--split", "85,10,5", "--tokenizer_type", "HuggingFaceTokenizer",
        "--tokenizer_model", str(data_dir / "tokenizer"), "--vocab_size", "null",
    )  # fmt: skip


def data_ready(data_dir: Path) -> bool:
    prefix = data_dir / f"{DATA_PREFIX}_text_document"
    files = (
        prefix.with_suffix(".bin"),
        prefix.with_suffix(".idx"),
        data_dir / "tokenizer" / "tokenizer.json",
    )
    return all(p.is_file() for p in files)


def write_outputs(plan: Plan, runs: list[PrecisionRun], tolerance: float, header: list[str]) -> str:
    """``results.json``, ``table.md`` and ``loss_curves.png`` under ``plan.out``; returns the table text."""
    comparisons = compare(runs, tolerance)
    plan.out.mkdir(parents=True, exist_ok=True)
    not_drawn = plot(runs, plan.out / "loss_curves.png", header[0])
    parts = [*header, "", table(runs, comparisons), ""]
    curves = curves_table(runs)
    if curves:
        parts += ["Loss at the evaluation points:", "", curves, ""]
    if not comparisons:
        parts.append(f"No {BASELINE} run: nothing to compare against.\n")
    if not_drawn:
        parts.append(not_drawn + "\n")
    text = "\n".join(parts)
    (plan.out / "table.md").write_text(text)
    results = {
        "config": str(plan.config),
        "env": plan.env,
        "overrides": list(plan.overrides),
        "gpus": plan.gpus,
        "machine": train_runs.machine(),
        "commit": train_runs.commit(),
        "versions": train_runs.versions(),
        "baseline": BASELINE,
        "tolerance": tolerance,
        "final_train_loss": f"mean lm loss of the last {FINAL_WINDOW} iterations",
        "runs": {r.precision: r.to_dict() for r in runs},
        "comparisons": [{**asdict(c), "within": c.within} for c in comparisons],
        "plot": None if not_drawn else str(plan.out / "loss_curves.png"),
    }
    (plan.out / "results.json").write_text(json.dumps(results, indent=2))
    return text


def _precisions(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in PRECISIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(PRECISIONS)} (e.g. bf16,fp8)"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a precision is listed twice")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, overrides = train_runs.split_overrides(argv)
    p = argparse.ArgumentParser(
        prog="train_precision_compare.py",
        description="train pretrain on the demo's real text once per MegaMoE expert precision, same seed; "
        "final train and validation loss against bf16, one table and one plot. "
        "Arguments after -- go to every run's trainer.",
    )
    p.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default: ${OUT_ENV}, else ./output/bench/...)"
    )
    p.add_argument(
        "--data-dir", type=Path, default=None,
        help="the demo data (corpus, tokenizer/, pydoc_text_document.*): reused when complete, else made "
        "(default: <out>/data)",
    )  # fmt: skip
    p.add_argument(
        "--precisions", type=_precisions, default=("bf16", "fp8"),
        help=f"comma-separated, from {', '.join(PRECISIONS)} (default: bf16,fp8); bf16 is the baseline",
    )  # fmt: skip
    p.add_argument("--train-iters", type=_positive, default=None, help="default: 300 (--tiny: 6)")
    p.add_argument("--eval-interval", type=_positive, default=None, help="default: 50 (--tiny: 3)")
    p.add_argument(
        "--eval-iters", type=_positive, default=None, help="global batches per evaluation (default: 3, --tiny: 1)"
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1234, help="the trainer's seed, the same for every run")
    p.add_argument(
        "--gpus", type=_positive, default=1,
        help="ranks on this node, GPUS_PER_NODE (default: 1; --tiny runs EP over all of them)",
    )  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=600.0, help="per run and per data step (default: 600)")
    p.add_argument(
        "--tolerance", type=float, default=0.015, help="relative, of the final losses (default: 0.015 = 1.5 %%)"
    )  # fmt: skip
    p.add_argument("--config", type=Path, default=None, help=f"experiment YAML (default: {GPU_CONFIG.name})")
    p.add_argument(
        "--model", default=GPU_MODEL, help="PRIMUS_MODEL for the GPU experiment (default: %(default)s)"
    )
    p.add_argument(
        "--tiny", action="store_true", help="the CPU demo model (moe_tiny, fp32), 6 steps: a check of the path"
    )  # fmt: skip
    p.add_argument(
        "--python", default=sys.executable, help="interpreter for the launcher and data steps (default: this one)"
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p.parse_args(argv), overrides


def build_plan(args: argparse.Namespace, extra: list[str], environ: dict[str, str]) -> Plan:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or environ.get(OUT_ENV) or ROOT / "output/bench/train_precision_compare" / stamp)
    out = out.resolve()
    data_dir = (args.data_dir or out / "data").resolve()
    iters = args.train_iters or (6 if args.tiny else 300)
    interval = args.eval_interval or (3 if args.tiny else 50)
    eval_iters = args.eval_iters or (1 if args.tiny else 3)
    env = {"TORCHDYNAMO_DISABLE": environ.get("TORCHDYNAMO_DISABLE", "1")}
    if args.tiny:
        config = args.config or TINY_CONFIG
        gpus = str(args.gpus)
        shape = (*TINY_ARGS, "--global_batch_size", str(4 * args.gpus), "--expert_model_parallel_size", gpus)
    else:
        config = args.config or GPU_CONFIG
        shape = GPU_ARGS
        env["PRIMUS_MODEL"] = args.model
    overrides = (
        *shape,
        *data_args(data_dir),
        "--train_iters", str(iters), "--eval_interval", str(interval), "--eval_iters", str(eval_iters),
        "--seed", str(args.seed), "--data_cache_path", str(out / "data_cache"), "--disable_last_saving", "True",
        *extra,
    )  # fmt: skip
    return Plan(
        out=out,
        data_dir=data_dir,
        config=config.resolve(),
        precisions=args.precisions,
        gpus=args.gpus,
        overrides=overrides,
        env=env,
        python=args.python,
    )


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _print(text: str) -> None:
    print(f"[bench] {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    plan = build_plan(args, extra, dict(os.environ))
    env_text = " ".join(f"{k}={v}" for k, v in plan.env.items())
    need_data = not data_ready(plan.data_dir)
    for cmd in plan.data_commands() if need_data else ():
        _print(f"data: {' '.join(cmd)}")
    if not need_data:
        _print(f"data: reusing {plan.data_dir}")
    for precision in plan.precisions:
        _print(f"{precision}: GPUS_PER_NODE={plan.gpus} {env_text} {' '.join(plan.train_command(precision))}")
    if args.dry_run:
        return 0

    previous = signal.signal(
        signal.SIGTERM, _stop_on_sigterm
    )  # stop the run under way, then write what we have
    try:
        return _run(plan, args, need_data)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(plan: Plan, args: argparse.Namespace, need_data: bool) -> int:
    plan.out.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, **plan.env, "PYTHONUNBUFFERED": "1"}
    try:
        if need_data and not _prepare_data(plan, base_env, args.timeout_s):
            return 1
    except KeyboardInterrupt:
        _print("interrupted while preparing the data")
        return 1
    ov = " ".join(plan.overrides)
    config = plan.config.relative_to(ROOT) if plan.config.is_relative_to(ROOT) else plan.config
    header = [
        f"{train_runs.machine()}, {plan.gpus} rank(s), commit {train_runs.commit()}, "
        + ", ".join(f"{k} {v}" for k, v in train_runs.versions().items()),
        f"experiment: `{config}` ({' '.join(f'{k}={v}' for k, v in plan.env.items())}), overrides: `{ov}`",
    ]
    train_iters = int(plan.overrides[plan.overrides.index("--train_iters") + 1])
    runs: list[PrecisionRun] = []
    try:
        for precision in plan.precisions:
            rdir = plan.run_dir(precision)
            cmd = plan.train_command(precision)
            run = PrecisionRun(
                precision=precision,
                command=cmd,
                console_log=str(rdir / "console.log"),
                timeout_s=args.timeout_s,
            )
            runs.append(run)
            _print(f"{precision}: training ({' '.join(switch_args(precision))})")
            rdir.mkdir(parents=True, exist_ok=True)
            env = train_runs.launch_env(base_env, precision, plan.gpus)
            try:
                run.returncode, run.timed_out, run.seconds = train_runs.run_logged(
                    cmd, env, rdir / "console.log", args.timeout_s
                )
            finally:  # also when interrupted: the curves so far
                read_back(run, (rdir / "console.log").read_text(errors="replace"), rdir / "workspace")
                check(run, train_iters)
            _print(f"{precision}: {'ok' if run.ok else '; '.join(run.problems)} ({run.seconds:.0f} s)")
            write_outputs(plan, runs, args.tolerance, header)  # what a later kill would leave
    except KeyboardInterrupt:
        interrupted = True
        _print(f"interrupted; not run: {', '.join(plan.precisions[len(runs) :]) or 'none'}")
    else:
        interrupted = False
    text = write_outputs(plan, runs, args.tolerance, header)
    print("\n" + text, flush=True)
    _print(
        f"written: {plan.out / 'table.md'}, results.json, loss_curves.png; logs under {plan.out}/<precision>/"
    )
    return 1 if interrupted or not all(r.ok for r in runs) else 0


def _prepare_data(plan: Plan, env: dict[str, str], timeout_s: float) -> bool:
    """``make demo-data``'s steps into ``plan.data_dir``; False (and why, printed) when one failed."""
    plan.data_dir.mkdir(parents=True, exist_ok=True)
    for i, cmd in enumerate(plan.data_commands()):
        log = plan.data_dir / f"prepare-{i}.log"
        status, timed_out, _ = train_runs.run_logged(cmd, env, log, timeout_s)
        if status != 0 or timed_out:
            why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit status {status}"
            _print(f"data step failed ({why}): {' '.join(cmd)}; its output: {log}")
            return False
    if not data_ready(plan.data_dir):
        _print(
            f"the data steps ran but {plan.data_dir} lacks {DATA_PREFIX}_text_document.bin/.idx or tokenizer/"
        )
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
