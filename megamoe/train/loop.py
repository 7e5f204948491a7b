"""The pretraining run: process groups, model, optimizer, resume, the step loop, checkpoints, summary.

One step = megatron-core's forward/backward schedule (no pipelining, 1F1B, or interleaved 1F1B when
the layout has virtual stages) over ``num_microbatches`` micro-batches, then the (distributed)
optimizer step, the LR schedule, metrics. Every ``eval_interval`` steps, and once at the end, the
validation split is evaluated (then saved checkpoints hold the RNG state after it, as in
Megatron-LM); the test split once at the end. Rank 0 shows a progress bar on a terminal (a line
every ``log_interval`` steps otherwise), feeds the metrics sinks (``sinks.py``) and ends with a
summary.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from megamoe.backends import QUANTIZED
from megamoe.backends.symm.workspace import check_capacity
from megamoe.quant import advance_weight_generation
from megamoe.train import checkpoint, data, distributed, metrics, model
from megamoe.train.config import export_yaml
from megamoe.train.evaluate import evaluate
from megamoe.train.forward import forward_step
from megamoe.train.schema import PretrainConfig
from megamoe.train.signals import Interrupted, Preempted, StopRequests
from megamoe.train.sinks import EvalStats, Sinks
from megamoe.train.validate import RunPlan, plan_run

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Summary:
    """What a finished run reports (rank 0 logs it; tests read it)."""

    first_iteration: int
    last_iteration: int
    first_loss: float | None
    last_loss: float | None
    mean_step_s: float | None
    tokens_per_s: float | None
    tflops_per_gpu: float | None
    peak_mem_gib: float
    checkpoint: str | None
    wall_s: float
    valid: EvalStats | None = None
    """The last validation (the end-of-training one when training finished)."""
    test: EvalStats | None = None

    def text(self) -> str:
        def fmt(value: float | None, spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        if self.last_iteration == self.first_iteration:
            return f"nothing trained: resumed at iteration {self.first_iteration} | wall {self.wall_s:.1f} s"
        return (
            f"trained iterations {self.first_iteration + 1}..{self.last_iteration} | "
            f"lm loss {fmt(self.first_loss, '.4f')} -> {fmt(self.last_loss, '.4f')} | "
            f"step {fmt(self.mean_step_s and self.mean_step_s * 1000, '.1f')} ms | "
            f"{fmt(self.tokens_per_s, ',.0f')} tokens/s | {fmt(self.tflops_per_gpu, '.3g')} TFLOP/s/GPU | "
            f"peak mem {self.peak_mem_gib:.2f} GiB | {self._evals()}checkpoint {self.checkpoint or 'none'} | "
            f"wall {self.wall_s:.1f} s"
        )

    def _evals(self) -> str:
        out = ""
        for name, stats in (("validation", self.valid), ("test", self.test)):
            if stats is not None:
                out += f"{name} loss {stats.lm_loss:.4f} (ppl {stats.ppl:.2f}) | "
        return out


def before_optimizer_step(switch: model.MoESwitch) -> None:
    """Once per step, before the update: a rank whose fused expert-parallel pool overflowed left rows
    out of this step's outputs, so :func:`megamoe.check_capacity` raises then, before any weight (or a
    later checkpoint) takes the wrong gradients. One small host read; a no-op off the GPU path."""
    if switch.use_mega_moe:
        check_capacity()


def after_optimizer_step(switch: model.MoESwitch) -> None:
    """Once per optimizer step: MegaMoE's quantised experts (mxfp8, fp8) cache their quantised weights
    per weight generation (the optimizer updates weights in place without bumping ``Tensor._version``),
    so a step starts a new generation. Recompute and warm-up forwards within a step reuse the cache."""
    if switch.use_mega_moe and switch.options.precision in QUANTIZED:
        advance_weight_generation()


def pretrain(cfg: PretrainConfig, environ: Mapping[str, str]) -> Summary:
    """Run the whole job on this rank; every rank calls it (under torchrun, or alone)."""
    started = time.perf_counter()
    info = distributed.rank_info(environ)
    plan = plan_run(cfg, world_size=info.world_size, has_cuda=torch.cuda.is_available())
    if info.rank == 0:
        for note in plan.notes:
            logger.warning(note)
    distributed.cpu_threads(environ)
    distributed.init_distributed(info, environ)
    try:
        summary = _train(cfg, plan, info, started)
    except (Preempted, Interrupted):  # every rank stops at the same boundary: leave in order
        _release_cuda_graphs()
        distributed.teardown(wait_for_peers=True)
        raise
    except BaseException:
        _release_cuda_graphs()
        distributed.teardown(wait_for_peers=False)  # peers may be gone: no barrier
        raise
    _release_cuda_graphs()
    distributed.teardown(wait_for_peers=True)
    return summary


@dataclass(kw_only=True)
class _Run:
    """What the step loop works on, built once."""

    tconfig: Any
    switch: model.MoESwitch
    chunks: list[Any]
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    vocab_size: int
    """The embedding's rows before padding."""


def _train(cfg: PretrainConfig, plan: RunPlan, info: distributed.RankInfo, started: float) -> Summary:
    if info.rank == 0:  # what this run resolved to, next to its log (each checkpoint holds its own copy)
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "config.yaml").write_text(export_yaml(cfg))
    run = _build(cfg, plan)
    start = _resume(cfg, plan, run)
    datasets = data.build_datasets(cfg, plan, run.tokenizer)
    sinks = Sinks.open(cfg, rank=info.rank, start_iteration=start, world_size=info.world_size)
    t = cfg.training
    stops = StopRequests(handle_signals=t.exit_signal_handler, exit_duration_in_mins=t.exit_duration_in_mins)
    try:
        history, saved, valid = _steps(cfg, plan, info, run, start, datasets, sinks, stops)
        last = history[-1].iteration if history else start
        test = None
        if history and cfg.training.eval_iters:
            if datasets.valid is not None and (valid is None or valid.iteration != last):
                valid = _evaluate(cfg, plan, run, datasets.valid, "valid", last, sinks, info)
            if datasets.test is not None:
                test = _evaluate(cfg, plan, run, datasets.test, "test", last, sinks, info)
    finally:
        stops.close()
        sinks.close()
    if (
        history
        and not cfg.checkpoint.disable_last_saving
        and saved != str(checkpoint.iteration_dir(plan.save_dir, last))
    ):
        saved = str(_save(cfg, plan, last, run))
    summary = _summarize(cfg, start, last, history, saved, started, valid, test)
    if info.rank == 0:
        logger.info("summary: %s", summary.text())
    return summary


def _evaluate(
    cfg: PretrainConfig, plan: RunPlan, run: _Run, dataset: Any, split: str, iteration: int, sinks: Sinks,
    info: distributed.RankInfo,
) -> EvalStats:  # fmt: skip
    stats = evaluate(cfg, plan, run.chunks, dataset, split=split, iteration=iteration)
    before_optimizer_step(run.switch)  # a fused EP pool that overflowed left rows out of the loss too
    if info.rank == 0:
        logger.info(stats.line())
    sinks.evaluation(stats)
    return stats


def _build(cfg: PretrainConfig, plan: RunPlan) -> _Run:
    """Parallel state, the model chunks in megatron DDP, the optimizer and LR schedule."""
    from megatron.core import tensor_parallel

    tconfig = model.transformer_config(cfg, plan)
    distributed.init_model_parallel(cfg, tconfig.virtual_pipeline_model_parallel_size)
    _seed(cfg.training.seed, tensor_parallel, cuda_graphs=plan.cuda_graph_impl != "none")
    switch = model.decide_moe_switch(cfg, tconfig)
    logger.info(
        "MoE block: %s (%s)", "MegaMoE" if switch.use_mega_moe else "megatron-core MoELayer", switch.reason
    )
    tokenizer = data.tokenizer_for(cfg)
    vocab_size = data.model_vocab_size(cfg, tokenizer)
    chunks = model.build_model_chunks(cfg, tconfig, switch, vocab_size)
    if switch.use_mega_moe and model.allocate_symm_workspaces(cfg, chunks):
        logger.info("MegaMoE symmetric workspace: %d tokens per rank", model.symm_max_tokens(cfg))
    p = cfg.parallel
    logger.info(
        "model: %d chunk(s), %s parameters on rank 0; TP=%d PP=%d VPP=%s EP=%d DP=%d, %d micro-batches/step",
        len(chunks), f"{model.count_parameters(chunks):,}", p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size, tconfig.virtual_pipeline_model_parallel_size,
        p.expert_model_parallel_size, plan.data_parallel_size, plan.num_microbatches,
    )  # fmt: skip
    ddp_chunks = model.wrap_ddp(cfg, tconfig, chunks)
    optimizer = _optimizer(cfg, tconfig, ddp_chunks)
    scheduler = _scheduler(cfg, plan, optimizer)
    _wire_config(cfg, tconfig, ddp_chunks, optimizer)
    return _Run(tconfig=tconfig, switch=switch, chunks=ddp_chunks, optimizer=optimizer, scheduler=scheduler,
                tokenizer=tokenizer, vocab_size=vocab_size)  # fmt: skip


def _resume(cfg: PretrainConfig, plan: RunPlan, run: _Run) -> int:
    """The iteration to continue from: the newest complete checkpoint's, or 0 (validate.py's rule
    decides whether a save folder's checkpoints are continued or replaced)."""
    c = cfg.checkpoint
    if c.overwrite_checkpoints:
        _replace_checkpoints(plan.save_dir)
    if not c.auto_continue_train or (c.overwrite_checkpoints and plan.load_dir == plan.save_dir):
        return 0
    start = checkpoint.load(plan.load_dir, run.chunks, run.optimizer, run.scheduler, facts=_facts(cfg, plan, run),
                            strict=c.strict_resume, finetune=c.finetune, with_optimizer=not c.no_load_optim,
                            with_rng=not c.no_load_rng)  # fmt: skip
    if start >= cfg.training.train_iters and dist.get_rank() == 0:
        logger.warning(
            "the checkpoint in %s is at iteration %d >= train_iters=%d: nothing to train. Raise train_iters "
            "(--override_opt_param_scheduler true for its new LR schedule), or pass --overwrite_checkpoints "
            "true to train afresh",
            plan.load_dir, start, cfg.training.train_iters,
        )  # fmt: skip
    return start


def _replace_checkpoints(save_dir: Path) -> None:
    """overwrite_checkpoints: the save folder's checkpoints go before the run writes its own."""
    if dist.get_rank() == 0:
        latest = checkpoint.latest_iteration(save_dir) if save_dir.is_dir() else None
        if latest is not None:
            logger.warning(
                "overwrite_checkpoints: removing the checkpoints in %s (up to iteration %d)", save_dir, latest
            )
            (save_dir / checkpoint.TRACKER).unlink()
            for folder in save_dir.glob("iter_*"):
                shutil.rmtree(folder)
    dist.barrier()


def _facts(cfg: PretrainConfig, plan: RunPlan, run: _Run) -> checkpoint.Facts:
    settings = {**asdict(cfg.model), **asdict(cfg.moe)}
    p = cfg.parallel
    return checkpoint.Facts(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        data_parallel_size=plan.data_parallel_size,
        vocab_size=run.vocab_size,
        model={name: settings[name] for name in checkpoint.SHAPE_SETTINGS},
    )


def _steps(
    cfg: PretrainConfig, plan: RunPlan, info: distributed.RankInfo, run: _Run, start: int,
    datasets: data.Datasets, sinks: Sinks, stops: StopRequests,
) -> tuple[list[metrics.StepStats], str | None, EvalStats | None]:  # fmt: skip
    """Iterations ``start + 1 ..`` with logging, evaluations and periodic checkpoints; the stats, the
    last save and the last validation. A stop request ends it at an iteration boundary: preemption
    after a checkpoint of that iteration (:class:`Preempted`), SIGINT at once (:class:`Interrupted`)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = cfg.training
    dp_rank = parallel_state.get_data_parallel_rank()
    iterators = [data.batches(datasets.train, plan, t.micro_batch_size, dp_rank, start) for _ in run.chunks]
    forward_backward = get_forward_backward_func()
    step_flops = metrics.flops_per_iteration(cfg, plan.global_batch_size, run.vocab_size)
    history: list[metrics.StepStats] = []
    saved: str | None = None
    valid: EvalStats | None = None
    stop = min(t.train_iters, t.exit_interval or t.train_iters)
    show_bar = info.rank == 0 and cfg.logging.progress_bar and sys.stderr.isatty()
    bar = tqdm(total=t.train_iters, initial=start, desc="train", unit="it", file=sys.stderr,
               disable=not show_bar, dynamic_ncols=True)  # fmt: skip
    for step in range(start, stop):
        stats = _one_step(cfg, plan, step, run, iterators, forward_backward, step_flops)
        history.append(stats)
        sinks.train(stats)
        if info.rank == 0:
            bar.update(1)
            bar.set_postfix(loss=f"{stats.lm_loss:.4f}", refresh=False)
            if stats.iteration % cfg.logging.log_interval == 0 or stats.iteration == stop:
                logger.info(stats.line(t.train_iters))
        if not math.isfinite(stats.lm_loss):
            raise FloatingPointError(f"lm loss is {stats.lm_loss} at iteration {stats.iteration}")
        if datasets.valid is not None and t.eval_interval and stats.iteration % t.eval_interval == 0:
            valid = _evaluate(cfg, plan, run, datasets.valid, "valid", stats.iteration, sinks, info)
        interval = cfg.checkpoint.save_interval
        if interval and stats.iteration % interval == 0:
            saved = str(_save(cfg, plan, stats.iteration, run))
        verdict = stops.agree()
        if verdict.interrupt:
            bar.close()
            raise Interrupted(stats.iteration)
        if verdict.save_and_exit and stats.iteration < stop:
            if saved != str(checkpoint.iteration_dir(plan.save_dir, stats.iteration)):
                _save(cfg, plan, stats.iteration, run)
            bar.close()
            raise Preempted(verdict.save_and_exit, stats.iteration)
    bar.close()
    return history, saved, valid


def _seed(seed: int, tensor_parallel: Any, *, cuda_graphs: bool) -> None:
    """CPU generator, then megatron's CUDA RNG tracker (dropout, expert-parallel init); CPU uses compat's.

    Captured CUDA graphs need the graph-safe tracker, or megatron refuses to capture.
    """
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs)


def _optimizer(cfg: PretrainConfig, tconfig: Any, ddp_chunks: list[Any]) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o, t = cfg.optimizer, cfg.training
    config = OptimizerConfig(
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum,
        clip_grad=o.clip_grad,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=tconfig.params_dtype,
        loss_scale=o.loss_scale,
        initial_loss_scale=o.initial_loss_scale,
        use_distributed_optimizer=o.use_distributed_optimizer,
        overlap_param_gather=o.overlap_param_gather,
    )
    return get_megatron_optimizer(config, ddp_chunks)


def _scheduler(cfg: PretrainConfig, plan: RunPlan, optimizer: Any) -> Any:
    """LR/WD schedule stepped in samples, like Megatron (warm-up and decay given in iterations)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, gbs = cfg.optimizer, plan.global_batch_size
    decay_iters = o.lr_decay_iters or cfg.training.train_iters
    start_wd = o.start_weight_decay if o.start_weight_decay is not None else o.weight_decay
    end_wd = o.end_weight_decay if o.end_weight_decay is not None else o.weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=o.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters * gbs,
        lr_decay_steps=decay_iters * gbs,
        lr_decay_style=o.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=cfg.training.train_iters * gbs,
        wd_incr_style=o.weight_decay_incr_style,
        wsd_decay_steps=decay_iters * gbs if o.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if o.lr_decay_style == "WSD" else None,
        override_opt_param_scheduler=o.override_opt_param_scheduler,
        # megatron-core refuses both switches at once; the explicit override wins over the default
        use_checkpoint_opt_param_scheduler=o.use_checkpoint_opt_param_scheduler
        and not o.override_opt_param_scheduler,
    )


def _wire_config(cfg: PretrainConfig, tconfig: Any, ddp_chunks: list[Any], optimizer: Any) -> None:
    """What megatron's schedules call back into: loss scaling, grad finalisation, overlapped syncs."""
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(funcs: list[Any]) -> Any:
        return funcs[0] if len(funcs) == 1 else funcs

    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.finalize_model_grads_func = finalize_model_grads
    if cfg.optimizer.overlap_grad_reduce:
        tconfig.no_sync_func = one_or_list([c.no_sync for c in ddp_chunks])
        tconfig.grad_sync_func = one_or_list([c.start_grad_sync for c in ddp_chunks])
    if cfg.optimizer.overlap_param_gather and len(ddp_chunks) > 1:
        tconfig.param_sync_func = one_or_list([c.start_param_sync for c in ddp_chunks])


def _one_step(
    cfg: PretrainConfig, plan: RunPlan, step: int, run: _Run, iterators: list[Any], forward_backward: Any,
    step_flops: float,
) -> metrics.StepStats:  # fmt: skip
    t0 = time.perf_counter()
    for chunk in run.chunks:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=run.chunks,
        num_microbatches=plan.num_microbatches,
        seq_length=cfg.training.seq_length,
        micro_batch_size=cfg.training.micro_batch_size,
        decoder_seq_length=cfg.training.seq_length,
        forward_only=False,
    )
    before_optimizer_step(run.switch)
    _, grad_norm, _ = run.optimizer.step()
    after_optimizer_step(run.switch)
    run.scheduler.step(increment=plan.global_batch_size)
    lm_loss = metrics.gather_loss(losses)
    aux = metrics.aux_loss(cfg, plan.num_microbatches)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return metrics.StepStats(
        iteration=step + 1,
        lm_loss=lm_loss,
        aux_loss=aux,
        lr=run.optimizer.param_groups[0]["lr"],
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        seconds=seconds,
        tokens_per_s=plan.global_batch_size * cfg.training.seq_length / seconds,
        tflops_per_gpu=step_flops / seconds / plan.world_size / 1e12,
        peak_mem_gib=metrics.peak_memory_gib(),
    )


def _save(cfg: PretrainConfig, plan: RunPlan, iteration: int, run: _Run) -> Path:
    c = cfg.checkpoint
    t0 = time.perf_counter()
    path = checkpoint.save(plan.save_dir, iteration, run.chunks, run.optimizer, run.scheduler,
                           config_yaml=export_yaml(cfg), facts=_facts(cfg, plan, run),
                           with_optimizer=not c.no_save_optim, with_rng=not c.no_save_rng)  # fmt: skip
    logger.info("saved checkpoint %s in %.1f s", path, time.perf_counter() - t0)
    return path


def _summarize(
    cfg: PretrainConfig,
    start: int,
    last: int,
    history: list[metrics.StepStats],
    saved: str | None,
    started: float,
    valid: EvalStats | None,
    test: EvalStats | None,
) -> Summary:
    skip = min(cfg.logging.log_avg_skip_iterations, max(len(history) - 1, 0))
    timed = history[skip:]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    peak = torch.tensor([metrics.peak_memory_gib()], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return Summary(
        first_iteration=start,
        last_iteration=last,
        first_loss=history[0].lm_loss if history else None,
        last_loss=history[-1].lm_loss if history else None,
        mean_step_s=mean([s.seconds for s in timed]),
        tokens_per_s=mean([s.tokens_per_s for s in timed]),
        tflops_per_gpu=mean([s.tflops_per_gpu for s in timed]),
        peak_mem_gib=float(peak),
        checkpoint=saved,
        wall_s=time.perf_counter() - started,
        valid=valid,
        test=test,
    )


def _release_cuda_graphs() -> None:
    if torch.cuda.is_available():
        from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

        delete_cuda_graphs()
