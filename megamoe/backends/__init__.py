"""Expert backends behind one interface (:class:`~megamoe.backends.base.ExpertBackend`), and selection.

``auto`` picks the fastest backend that supports the device and dtype: Triton for bf16 on CUDA,
Primus-Turbo's FlyDSL kernels for bf16 on ROCm when ``primus_turbo`` is installed, and the exact
PyTorch reference everywhere else.

``precision`` picks the number format of the expert GEMMs: ``bf16`` (the inputs' own dtype),
``mxfp8`` (OCP MX, :mod:`megamoe.quant.mx`) or ``fp8`` (DeepSeek-V3's blockwise FP8,
:mod:`megamoe.quant.fp8`). Both have Triton kernels (:mod:`megamoe.backends.triton_mx`,
:mod:`megamoe.backends.triton_fp8`, composed with a transport by
:mod:`megamoe.backends.quantized_triton`), which ``auto`` picks for bf16 on CUDA, and the exact
emulation (:mod:`megamoe.backends.quantized_reference`), the choice everywhere else. FP8 at EP > 1
runs over the NCCL transport unless the symmetric-memory one is asked for
(:mod:`megamoe.backends.triton_fp8.ep_symm`).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from megamoe.backends.base import ExpertBackend
from megamoe.backends.hardware import warn_mxfp8_speed_once
from megamoe.backends.reference import ReferenceBackend
from megamoe.errors import InvalidConfigError, UnsupportedSettingError
from megamoe.settings import EP_TRANSPORTS, EPSettings

BACKEND_NAMES = ("auto", "reference", "triton", "primus_turbo")
PRECISIONS = ("bf16", "mxfp8", "fp8")
QUANTIZED = ("mxfp8", "fp8")
"""the precisions whose weights are quantised and cached per optimizer step."""


def _require_triton() -> None:
    if not _importable("triton"):
        raise UnsupportedSettingError(
            "backend",
            "triton",
            "triton is not installed",
            "pip install 'megamoe[cuda]' or use backend='reference'",
        )


def _triton(precision: str, transport: str, settings: EPSettings) -> ExpertBackend:
    """The Triton expert math of ``precision`` over ``transport`` (``local``, ``nccl`` or ``symm``)."""
    _require_triton()
    if transport == "symm":
        if precision == "fp8":
            from megamoe.backends.triton_fp8.ep_symm import FP8SymmBackend

            return FP8SymmBackend(settings.symm)
        if precision == "mxfp8":
            from megamoe.backends.triton_mx.ep_symm import MXFP8SymmBackend

            return MXFP8SymmBackend(settings.symm)
        from megamoe.backends.symm.experts import SymmTritonBackend

        return SymmTritonBackend(settings.symm)
    from megamoe.backends.triton.rows import AllToAllTransport, LocalTransport

    rows = LocalTransport() if transport == "local" else AllToAllTransport()
    if precision in QUANTIZED:
        from megamoe.backends.quantized_triton import QuantizedTritonBackend

        if precision == "mxfp8":
            from megamoe.backends.triton_mx.experts import MXExperts

            return QuantizedTritonBackend(rows, MXExperts())
        from megamoe.backends.triton_fp8.experts import FP8Experts

        return QuantizedTritonBackend(rows, FP8Experts())
    from megamoe.backends.triton.backend import TritonBackend

    return TritonBackend(rows)


def _load(name: str, precision: str, transport: str, settings: EPSettings) -> ExpertBackend:
    if name == "triton":
        return _triton(precision, transport, settings)
    if precision in QUANTIZED:
        if name == "reference":
            from megamoe.backends.quantized_reference import FP8ReferenceBackend, MXFP8ReferenceBackend

            return MXFP8ReferenceBackend() if precision == "mxfp8" else FP8ReferenceBackend()
        raise UnsupportedSettingError(
            "precision",
            precision,
            f"backend {name!r} has no {precision.upper()} kernels",
            "Use backend='reference' or 'auto'",
        )
    if name == "reference":
        return ReferenceBackend()
    from megamoe.backends.primus_turbo import PrimusTurboBackend

    return PrimusTurboBackend()


def resolve_backend_name(
    name: str, *, device: torch.device, dtype: torch.dtype, precision: str = "bf16"
) -> str:
    """Turn ``auto`` into a concrete backend name for tensors on ``device`` of ``dtype``."""
    if name != "auto":
        return name
    if precision in QUANTIZED:
        cuda = device.type == "cuda" and dtype == torch.bfloat16 and torch.version.hip is None
        return "triton" if cuda and _importable("triton") else "reference"
    if device.type == "cuda" and dtype == torch.bfloat16:
        if torch.version.hip is not None:
            return "primus_turbo" if _importable("primus_turbo") else "reference"
        if _importable("triton") and _importable("megamoe.backends.triton.backend"):
            return "triton"
    return "reference"


@functools.cache
def _importable(module: str) -> bool:
    """Whether ``module`` can be imported, looked up once: the layer resolves ``auto`` on every call, and
    a module search costs more host time than some of its kernels take on the GPU."""
    return importlib.util.find_spec(module) is not None


def transport_name(
    name: str, *, device: torch.device, ep_size: int, settings: EPSettings, precision: str = "bf16"
) -> str:
    """How backend ``name`` moves tokens: ``local`` (one rank), ``symm`` or ``nccl`` (the Triton
    backends take ``settings.transport``, FP8 ``nccl`` unless one is set; the others exchange through
    ``all_to_all_single``)."""
    if ep_size == 1:
        return "local"
    if name != "triton":
        return "nccl"
    if precision == "fp8" and settings.transport is None:
        return "nccl"
    return settings.transport_for(device.type)


_CACHE: dict[tuple, ExpertBackend] = {}
_ONE_RANK = EPSettings()


def get_backend(
    name: str = "auto",
    *,
    device: torch.device,
    dtype: torch.dtype,
    precision: str = "bf16",
    ep_size: int = 1,
    settings: EPSettings | None = None,
) -> ExpertBackend:
    """The backend for ``name`` and ``precision`` (``auto`` resolved for ``device``/``dtype``) with its
    transport for ``ep_size`` ranks, created once per combination; ``settings`` default to
    :meth:`EPSettings.from_env` at ``ep_size > 1``."""
    if precision not in PRECISIONS:
        raise InvalidConfigError(
            "precision", precision, "unknown expert precision", f"Use one of {', '.join(PRECISIONS)}"
        )
    if name not in BACKEND_NAMES:
        raise InvalidConfigError("backend", name, "unknown backend", f"Use one of {', '.join(BACKEND_NAMES)}")
    if settings is None:  # one rank moves no tokens: no variable to read on every call
        settings = _ONE_RANK if ep_size == 1 else EPSettings.from_env()
    concrete = resolve_backend_name(name, device=device, dtype=dtype, precision=precision)
    transport = transport_name(
        concrete, device=device, ep_size=ep_size, settings=settings, precision=precision
    )
    key = (concrete, precision, transport, settings.symm if transport == "symm" else None)
    if key not in _CACHE:
        _CACHE[key] = _load(concrete, precision, transport, settings)
        if (
            precision == "mxfp8"
            and concrete == "triton"
            and device.type == "cuda"
            and torch.version.hip is None
        ):
            warn_mxfp8_speed_once(torch.cuda.get_device_capability(device))
    return _CACHE[key]


__all__ = [
    "BACKEND_NAMES",
    "EP_TRANSPORTS",
    "PRECISIONS",
    "QUANTIZED",
    "EPSettings",
    "ExpertBackend",
    "get_backend",
    "resolve_backend_name",
    "transport_name",
]
