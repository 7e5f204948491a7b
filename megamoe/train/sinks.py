"""Where rank 0's metrics go: ``training_log.jsonl`` always, TensorBoard and W&B when configured.

Every record of ``training_log.jsonl`` carries an ``event``: ``run_start`` (one per launch, fresh
or resumed, so two runs into one workspace are told apart), ``train`` (one per iteration),
``valid`` and ``test`` (one per evaluation). TensorBoard scalars use Megatron-LM's tag names
(``lm loss``, ``learning-rate``, ``grad-norm``, ``lm loss validation``, ``lm loss validation ppl``)
so existing dashboards read them; W&B runs offline (``wandb sync`` uploads later).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from megamoe.train.metrics import StepStats
from megamoe.train.schema import PretrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EvalStats:
    """One evaluation: the split, the iteration it followed, its mean LM loss."""

    split: str
    iteration: int
    lm_loss: float
    seconds: float

    @property
    def ppl(self) -> float:
        return math.exp(min(self.lm_loss, 20.0))

    def line(self) -> str:
        name = "validation" if self.split == "valid" else self.split
        return (
            f"{name} loss at iteration {self.iteration} | lm loss {self.lm_loss:.6f} | "
            f"lm loss PPL {self.ppl:.3f} | {self.seconds * 1000:.0f} ms"
        )


class Sink(Protocol):
    def train(self, stats: StepStats) -> None: ...
    def evaluation(self, stats: EvalStats) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object a line, appended (a resumed run adds to the same file)."""

    def __init__(self, path: Path, start: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        self._write({"event": "run_start", **start})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def train(self, stats: StepStats) -> None:
        self._write({"event": "train", **asdict(stats)})

    def evaluation(self, stats: EvalStats) -> None:
        self._write(
            {"event": stats.split, "iteration": stats.iteration, "lm_loss": stats.lm_loss, "ppl": stats.ppl}
        )

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars by iteration, with torch.utils.tensorboard."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=log_dir, max_queue=100)

    def train(self, s: StepStats) -> None:
        scalars = {
            "lm loss": s.lm_loss,
            "aux loss": s.aux_loss,
            "learning-rate": s.lr,
            "grad-norm": s.grad_norm,
            "tokens-per-second": s.tokens_per_s,
            "throughput-tflops-per-gpu": s.tflops_per_gpu,
            "mem-max-allocated-gib": s.peak_mem_gib,
            "iteration-time": s.seconds,
        }
        for tag, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(tag, value, s.iteration)

    def evaluation(self, s: EvalStats) -> None:
        name = "validation" if s.split == "valid" else s.split
        self._writer.add_scalar(f"lm loss {name}", s.lm_loss, s.iteration)
        self._writer.add_scalar(f"lm loss {name} ppl", s.ppl, s.iteration)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """An offline Weights & Biases run (no network; ``wandb sync <dir>`` uploads it)."""

    def __init__(self, cfg: PretrainConfig, resumed: bool) -> None:
        import wandb

        save_dir = Path(cfg.logging.wandb_save_dir or f"{cfg.output_dir}/wandb")
        save_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.logging.wandb_project,
            name=cfg.logging.wandb_exp_name or cfg.exp_name,
            dir=str(save_dir),
            mode="offline",
            config=cfg.params(),
            resume="allow" if resumed else None,
            settings=wandb.Settings(silent=True),
        )

    def train(self, s: StepStats) -> None:
        data = {"lm loss": s.lm_loss, "learning-rate": s.lr, "tokens-per-second": s.tokens_per_s,
                "throughput-tflops-per-gpu": s.tflops_per_gpu, "mem-max-allocated-gib": s.peak_mem_gib}  # fmt: skip
        if s.aux_loss is not None:
            data["aux loss"] = s.aux_loss
        if s.grad_norm is not None:
            data["grad-norm"] = s.grad_norm
        self._run.log(data, step=s.iteration)

    def evaluation(self, s: EvalStats) -> None:
        name = "validation" if s.split == "valid" else s.split
        self._run.log({f"lm loss {name}": s.lm_loss, f"lm loss {name} ppl": s.ppl}, step=s.iteration)

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """Every configured sink on rank 0; nothing elsewhere."""

    def __init__(self, sinks: list[Sink]) -> None:
        self._sinks = sinks

    @classmethod
    def open(cls, cfg: PretrainConfig, *, rank: int, start_iteration: int, world_size: int) -> Sinks:
        if rank != 0:
            return cls([])
        start = {
            "start_iteration": start_iteration,
            "resumed": start_iteration > 0,
            "train_iters": cfg.training.train_iters,
            "world_size": world_size,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        sinks: list[Sink] = [JsonlSink(Path(cfg.output_dir) / "training_log.jsonl", start)]
        if cfg.logging.tensorboard_dir:
            sinks.append(TensorBoardSink(cfg.logging.tensorboard_dir))
            logger.info("TensorBoard scalars -> %s", cfg.logging.tensorboard_dir)
        if cfg.logging.wandb_project and importlib.util.find_spec("wandb"):  # else start-up warned
            sinks.append(WandbSink(cfg, resumed=start_iteration > 0))
        return cls(sinks)

    def train(self, stats: StepStats) -> None:
        for sink in self._sinks:
            sink.train(stats)

    def evaluation(self, stats: EvalStats) -> None:
        for sink in self._sinks:
            sink.evaluation(stats)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
