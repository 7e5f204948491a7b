"""Lets megatron-core's non-Transformer-Engine paths run on a CPU-only torch (gloo), for tests and the demo.

megatron-core hard-codes CUDA where the code is otherwise device-agnostic. Each part below patches one
such habit; every CUDA part is a no-op when CUDA is available, so the same code runs unchanged on a GPU:

* ``device``  ``torch.cuda.current_device()`` used as an allocation target (router weight, DDP buffers);
* ``streams`` ``torch.cuda.Stream/Event/current_stream`` (DDP comm stream, dispatcher side streams);
* ``a2a``     tensor split sizes passed to ``all_to_all_single`` (only converted to lists for GPU tensors);
* ``mode``    literal ``device="cuda"``, ``.cuda()`` and ``param.type() == 'torch.cuda.FloatTensor'``
              checks in the optimizers, grad clipping and pipeline schedules;
* ``rng``     the CUDA RNG tracker (dropout, GPU-style init) replaced by the no-op inference tracker;
* ``te_gemm`` megatron-core 0.16: ``moe_utils.te_general_gemm`` is undefined without Transformer Engine
              (a version bug, so this part is applied on GPUs too).

Call :func:`apply_cpu_compat` once per process, after ``torch.distributed`` is initialised and before
any model is built.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

_APPLIED: set[str] = set()
ALL_PARTS = ("device", "streams", "a2a", "mode", "rng", "te_gemm")


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: CPU ops are synchronous, so every event is complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``; one shared instance so "same stream" checks pass."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()


_STREAM = _CpuStream()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Maps ``device="cuda"`` to CPU, makes ``Tensor.cuda()`` a no-op, reports ``torch.cuda.*`` types."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if (
            func is torch.Tensor.type
            and len(args) == 1
            and not kwargs
            and isinstance(out, str)
            and not out.startswith("torch.cuda.")
        ):
            out = out.replace("torch.", "torch.cuda.", 1)
        return out


def _patch_streams() -> None:
    torch.cuda.Stream = lambda *a, **k: _STREAM
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.default_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.Event = _CpuEvent
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, s: None


def _patch_all_to_all() -> None:
    import torch.distributed as dist

    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if torch.is_tensor(output_split_sizes):
            output_split_sizes = output_split_sizes.tolist()
        if torch.is_tensor(input_split_sizes):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single


def stub_missing_triton() -> None:
    """megatron-core >= 0.19 imports triton unguarded in one MoE module; stand in for it when absent."""
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return
    stub = types.ModuleType(name)
    stub.GLOBAL_BLOCK_SIZE = 1024

    def _unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("moe_paged_stash needs triton and a GPU")

    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _unavailable
    sys.modules[name] = stub


def _define_te_general_gemm() -> None:
    """megatron-core 0.16 references ``te_general_gemm`` without Transformer Engine (GPU or not)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_cpu_compat(parts: tuple[str, ...] = ALL_PARTS) -> None:
    """Patch megatron-core's CUDA habits for this CPU-only process.

    On a GPU only the version bugs are fixed (the missing-triton stub and ``te_general_gemm``); the
    CUDA parts do nothing there.
    """
    stub_missing_triton()
    if "te_gemm" in parts:
        _define_te_general_gemm()
    if torch.cuda.is_available():
        return
    todo = [p for p in parts if p not in _APPLIED and p != "te_gemm"]
    if "device" in todo:
        torch.cuda.current_device = lambda: torch.device("cpu")
    if "streams" in todo:
        _patch_streams()
    if "a2a" in todo:
        _patch_all_to_all()
    if "mode" in todo:
        _CudaToCpuMode().__enter__()  # stays active for the rest of this process
    if "rng" in todo:
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        # The inference tracker's add()/fork() are no-ops: dropout and init use the CPU generator.
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _APPLIED.update(todo)
    if todo:
        logger.debug("megatron-core CPU compatibility applied: %s", ", ".join(todo))
