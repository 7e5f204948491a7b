"""One ``train pretrain`` run per expert precision, read back and compared: what
``benchmarks/train_precision_compare.py`` tables and plots.

* :class:`PrecisionRun` holds a run's outcome; :func:`read_back` fills it from the console log (the
  ``MoE block:`` and ``summary:`` lines) and the trainer's ``training_log.jsonl`` (the curves);
  :func:`check` lists what is wrong with it (failed, timed out, wrong MoE path or precision, short or
  non-finite curves).
* :func:`compare` puts each precision's final losses against the baseline's (bf16) as relative
  differences; :func:`table` and :func:`curves_table` are the Markdown, :func:`plot` the PNG.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import train_runs
from benchmarks.train_runs import fmt

BASELINE = "bf16"
FINAL_WINDOW = 10
"""The final train loss is the mean lm loss of this many last iterations."""


@dataclass
class PrecisionRun(train_runs.RunRecord):
    precision: str
    training_log: str | None = None
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    """(iteration, lm loss) of every iteration."""
    valid_curve: list[tuple[int, float]] = field(default_factory=list)
    """(iteration, lm loss) of every validation."""
    test_loss: float | None = None
    final_train_loss: float | None = None
    """Mean lm loss of the last ``FINAL_WINDOW`` iterations."""
    final_valid_loss: float | None = None
    """The last validation (the one at the end of training)."""

    @property
    def step_ms(self) -> float | None:
        return self.summary.step_ms if self.summary else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.summary.tokens_per_s if self.summary else None

    @property
    def peak_mem_gib(self) -> float | None:
        return self.summary.peak_mem_gib if self.summary else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ok": self.ok,
            "step_ms": self.step_ms,
            "tokens_per_s": self.tokens_per_s,
            "peak_mem_gib": self.peak_mem_gib,
        }


def read_back(run: PrecisionRun, console_text: str, workspace: Path) -> None:
    """Fill ``run`` from its console output and the trainer's ``training_log.jsonl``."""
    run.read_console(console_text)
    path = train_runs.find_training_log(workspace)
    if path is None:
        return
    run.training_log = str(path)
    log = train_runs.read_training_log(path)
    run.train_curve = [(int(r["iteration"]), float(r["lm_loss"])) for r in log.train]
    run.valid_curve = [(int(r["iteration"]), float(r["lm_loss"])) for r in log.valid]
    run.test_loss = float(log.test[-1]["lm_loss"]) if log.test else None
    if run.train_curve:
        window = [loss for _, loss in run.train_curve[-FINAL_WINDOW:]]
        run.final_train_loss = sum(window) / len(window)
    run.final_valid_loss = run.valid_curve[-1][1] if run.valid_curve else None


PRECISION_RE = re.compile(r"\bprecision=(\w+)")


def check(run: PrecisionRun, train_iters: int) -> None:
    """Fill ``run.problems``: failed, timed out, wrong MoE path or precision, short or non-finite curves."""
    if run.timed_out:
        run.problems.append(f"timed out after {run.timeout_s:.0f} s")
    elif run.returncode is None:
        run.problems.append("interrupted")
    elif run.returncode != 0:
        run.problems.append(f"exit status {run.returncode}")
    if run.moe_block is None:
        run.problems.append("no 'MoE block:' line (the model was not built)")
    elif run.moe_block != "MegaMoE":
        run.problems.append(f"built {run.moe_block!r}, expected 'MegaMoE'")
    else:
        built = PRECISION_RE.search(run.moe_reason or "")
        if built is None or built.group(1) != run.precision:
            run.problems.append(f"built precision {built and built.group(1)!r}, expected {run.precision!r}")
    if run.summary is None:
        run.problems.append("no 'summary: trained iterations' line")
    if run.training_log is None:
        run.problems.append("no training_log.jsonl under the workspace")
    elif not run.train_curve or run.train_curve[-1][0] != train_iters:
        last = run.train_curve[-1][0] if run.train_curve else 0
        run.problems.append(f"training_log.jsonl ends at iteration {last}, expected {train_iters}")
    losses = [loss for _, loss in run.train_curve + run.valid_curve]
    if any(not math.isfinite(loss) for loss in losses):
        run.problems.append("non-finite loss in training_log.jsonl")
    if run.training_log is not None and not run.valid_curve:
        run.problems.append("no validation loss in training_log.jsonl")


@dataclass(frozen=True)
class Comparison:
    """One precision's final losses against the baseline's: ``(x - baseline) / baseline``."""

    precision: str
    train_rel: float | None
    valid_rel: float | None
    tolerance: float

    @property
    def within(self) -> bool | None:
        if self.train_rel is None or self.valid_rel is None:
            return None
        return abs(self.train_rel) <= self.tolerance and abs(self.valid_rel) <= self.tolerance


def _rel(x: float | None, base: float | None) -> float | None:
    return None if x is None or base is None or base == 0 else (x - base) / base


def compare(runs: list[PrecisionRun], tolerance: float) -> list[Comparison]:
    """Every precision but the baseline against the baseline (none without a baseline run)."""
    base = next((r for r in runs if r.precision == BASELINE), None)
    if base is None:
        return []
    return [
        Comparison(
            precision=r.precision,
            train_rel=_rel(r.final_train_loss, base.final_train_loss),
            valid_rel=_rel(r.final_valid_loss, base.final_valid_loss),
            tolerance=tolerance,
        )
        for r in runs
        if r.precision != BASELINE
    ]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.2f} %"


def table(runs: list[PrecisionRun], comparisons: list[Comparison]) -> str:
    """Markdown: one row per precision (final losses, their difference from bf16, speed, status)."""
    by_precision = {c.precision: c for c in comparisons}
    tol = f"{comparisons[0].tolerance * 100:g} %" if comparisons else "tolerance"
    lines = [
        f"| precision | lm loss at 1 | final train loss (mean of last {FINAL_WINDOW}) | vs {BASELINE} | "
        f"final validation loss | vs {BASELINE} | within {tol} | step (ms) | tokens/s | peak mem (GiB) | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        c = by_precision.get(r.precision)
        within = "" if c is None else {True: "yes", False: "no", None: "n/a"}[c.within]
        first = r.train_curve[0][1] if r.train_curve else None
        lines.append(
            f"| {r.precision} | {fmt(first, '.4f')} | {fmt(r.final_train_loss, '.4f')} | "
            f"{'' if c is None else _pct(c.train_rel)} | {fmt(r.final_valid_loss, '.4f')} | "
            f"{'' if c is None else _pct(c.valid_rel)} | {within} | {fmt(r.step_ms, '.1f')} | "
            f"{fmt(r.tokens_per_s, ',.0f')} | {fmt(r.peak_mem_gib, '.2f')} | "
            f"{'ok' if r.ok else '; '.join(r.problems)} |"
        )
    return "\n".join(lines)


def curves_table(runs: list[PrecisionRun]) -> str:
    """Markdown: the train loss (mean of the ``FINAL_WINDOW`` iterations up to it) and the validation
    loss at every evaluation point, one column per point."""
    points = sorted({i for r in runs for i, _ in r.valid_curve})
    if not points:
        return ""
    lines = [
        "| iteration | " + " | ".join(str(i) for i in points) + " |",
        "| --- |" + " --- |" * len(points),
    ]
    for r in runs:
        train = dict(r.train_curve)
        valid = dict(r.valid_curve)
        means = []
        for i in points:
            window = [train[j] for j in range(i - FINAL_WINDOW + 1, i + 1) if j in train]
            means.append(sum(window) / len(window) if window else None)
        lines.append(f"| {r.precision} train | " + " | ".join(fmt(m, ".4f") for m in means) + " |")
        lines.append(
            f"| {r.precision} validation | " + " | ".join(fmt(valid.get(i), ".4f") for i in points) + " |"
        )
    return "\n".join(lines)


def plot(runs: list[PrecisionRun], path: Path, title: str) -> str | None:
    """``loss_curves.png``: train loss by iteration and validation loss, one line per precision; the
    reason when it cannot be drawn (None when it was)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"{path.name} not drawn: {e} (pip install matplotlib)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for r in runs:
        if r.train_curve:
            left.plot(*zip(*r.train_curve, strict=True), label=r.precision, linewidth=1.0)
        if r.valid_curve:
            right.plot(*zip(*r.valid_curve, strict=True), marker="o", label=r.precision)
    left.set(title="train lm loss", xlabel="iteration", ylabel="lm loss")
    right.set(title="validation lm loss", xlabel="iteration", ylabel="lm loss")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
