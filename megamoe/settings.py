"""Typed settings of the expert-parallel paths, read from the environment in one place only.

The layer, the ops and the trainer take an :class:`EPSettings`; :meth:`EPSettings.from_env` is the
documented default for users who set variables (``MEGAMOE_EP_TRANSPORT``, ``MEGAMOE_SYMM_*``, listed
in docs/multigpu.md). Nothing below this module reads ``os.environ``: a backend gets its settings when
it is built, and the symmetric workspace keeps the ones it was allocated with.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from megamoe.errors import InvalidConfigError

EP_TRANSPORTS = ("symm", "nccl")
DISPATCH_MODES = ("push", "pull", "broadcast")
_FOREVER = 2**31 - 1
_DEBUG_SPINS = 5_000_000  # a few seconds of polling on a GPU


@dataclass(frozen=True, slots=True)
class SymmSettings:
    """The fused symmetric-memory EP path (one node). Each field's variable is in :data:`SYMM_ENV`."""

    dispatch: str | None = None
    """``push`` (sources write into the destinations' pools), ``pull`` (destinations read what the
    sources staged) or ``broadcast`` (each source copies its whole ``x``/``dy`` to every peer with the
    copy engines, the GEMM tiles gather from the copies); None: ``broadcast`` at EP = 2, else ``push``
    (measured in docs/benchmarks.md)."""
    max_tokens: int | None = None
    """Tokens per rank the workspace holds; None: the largest count over the group at the first op.
    torch.compile needs it set (it traces before the first op allocates the workspace)."""
    capacity_factor: float = 2.0
    """Rows a rank's pool holds, in balanced shares (``max_tokens * K``); ``math.inf`` is the worst case."""
    comm_programs: int = 40
    """Programs of the fused kernel that move rows before they join the GEMM."""
    flat_wait: bool = True
    """Run the first tiles of a launch with a comm role in a fixed-stride loop with loop-free waits."""
    tail_percent: int = 25
    """With ``flat_wait``: per cent of the tiles claimed from the device counter."""
    wait_spins: int | None = None
    """Polls before a wait gives up and records itself; None: 5e6 in debug mode, else unbounded."""
    debug: bool = False
    """Bounded waits and a host check after each op (slower; for hangs)."""
    trace: bool = False
    """Record the fused kernel's per-program timeline (``launch.program_timeline``; measurement only)."""

    def __post_init__(self) -> None:
        if self.dispatch is not None and self.dispatch not in DISPATCH_MODES:
            _bad(
                "dispatch", self.dispatch, "unknown dispatch mode", f"Use one of {', '.join(DISPATCH_MODES)}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            _bad("max_tokens", self.max_tokens, "must be at least 1 token per rank (or unset)")
        if not self.capacity_factor > 0:
            _bad(
                "capacity_factor",
                self.capacity_factor,
                "must be a positive number of balanced shares or 'max'",
                "Use e.g. 2 (the default) or max",
            )
        if self.comm_programs < 1:
            _bad("comm_programs", self.comm_programs, "must be at least 1")
        if not 0 <= self.tail_percent <= 100:
            _bad("tail_percent", self.tail_percent, "must be a per cent in [0, 100]")
        if self.wait_spins is not None and self.wait_spins < 1:
            _bad("wait_spins", self.wait_spins, "must be at least 1 (or unset)")

    def dispatch_mode(self, world: int) -> str:
        return self.dispatch or ("broadcast" if world == 2 else "push")

    def max_spins(self) -> int:
        if self.wait_spins is not None:
            return self.wait_spins
        return _DEBUG_SPINS if self.debug else _FOREVER

    def to_json(self) -> str:
        """The settings as text, how the ``torch.library`` ops of the fused path take them."""
        return json.dumps(
            {k: ("max" if v == math.inf else v) for k, v in asdict(self).items()}, sort_keys=True
        )

    @staticmethod
    def from_json(text: str) -> SymmSettings:
        return _symm_from_json(text)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SymmSettings:
        env = os.environ if environ is None else environ
        values = {}
        for name, var in SYMM_ENV.items():  # (plain dicts, not dataclasses.fields: torch.compile traces this)
            raw = env.get(var, "").strip()
            if raw:
                values[name] = _parse(var, raw, _KINDS[name])
        return cls(**values)


SYMM_ENV = {
    "dispatch": "MEGAMOE_SYMM_DISPATCH",
    "max_tokens": "MEGAMOE_SYMM_MAX_TOKENS",
    "capacity_factor": "MEGAMOE_SYMM_CAPACITY",
    "comm_programs": "MEGAMOE_SYMM_COMM_PROGRAMS",
    "flat_wait": "MEGAMOE_SYMM_FLAT_WAIT",
    "tail_percent": "MEGAMOE_SYMM_TAIL",
    "wait_spins": "MEGAMOE_SYMM_WAIT_SPINS",
    "debug": "MEGAMOE_SYMM_DEBUG",
    "trace": "MEGAMOE_SYMM_TRACE",
}
"""The variable :meth:`SymmSettings.from_env` reads for each field."""
_KINDS = {
    "dispatch": str, "max_tokens": int, "capacity_factor": float, "comm_programs": int, "flat_wait": bool,
    "tail_percent": int, "wait_spins": int, "debug": bool, "trace": bool,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class EPSettings:
    """How tokens move between EP ranks, and the fused path's settings."""

    transport: str | None = None
    """``symm`` (the exchange fused into the grouped GEMMs over symmetric memory, one node) or
    ``nccl`` (``all_to_all_single`` around the expert kernels; any process group); None: ``symm`` on
    CUDA, ``nccl`` elsewhere. Only the Triton backends have ``symm``."""
    symm: SymmSettings = field(default_factory=SymmSettings)

    def __post_init__(self) -> None:
        if self.transport is not None and self.transport not in EP_TRANSPORTS:
            raise InvalidConfigError(
                "ep_transport",
                self.transport,
                "unknown EP transport",
                f"Use one of {', '.join(EP_TRANSPORTS)}",
            )

    def transport_for(self, device_type: str) -> str:
        return self.transport or ("symm" if device_type == "cuda" else "nccl")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EPSettings:
        env = os.environ if environ is None else environ
        return _ep_settings_from(tuple(env.get(var, "") for var in _EP_VARS))

    @classmethod
    def _parse_env(cls, env: Mapping[str, str]) -> EPSettings:
        transport = env.get("MEGAMOE_EP_TRANSPORT", "").strip() or None
        if transport is not None and transport not in EP_TRANSPORTS:
            raise InvalidConfigError(
                "MEGAMOE_EP_TRANSPORT",
                transport,
                "unknown EP transport",
                f"Use one of {', '.join(EP_TRANSPORTS)}",
            )
        return cls(transport=transport, symm=SymmSettings.from_env(env))


_EP_VARS = ("MEGAMOE_EP_TRANSPORT", *SYMM_ENV.values())


@lru_cache(maxsize=16)
def _ep_settings_from(raw: tuple[str, ...]) -> EPSettings:
    """The settings of these raw values of :data:`_EP_VARS`, parsed once: the layer reads them on every
    call that is given no settings (a bad value raises, and is not cached)."""
    return EPSettings._parse_env(dict(zip(_EP_VARS, raw, strict=True)))


def _bad(name: str, value: object, problem: str, remedy: str | None = None) -> None:
    raise InvalidConfigError(f"symm.{name} ({SYMM_ENV[name]})", value, problem, remedy or "")


def _parse(var: str, raw: str, kind: type) -> object:
    """``raw`` as ``kind``; a bad value names the variable."""
    try:
        if kind is bool:
            if raw not in ("0", "1"):
                raise ValueError
            return raw == "1"
        if kind is float:
            return math.inf if raw == "max" else float(raw)
        if kind is int:
            return int(raw)
    except ValueError:
        expected = {bool: "0 or 1", float: "a number or 'max'", int: "a number"}[kind]
        raise InvalidConfigError(var, raw, f"must be {expected}") from None
    return raw


@lru_cache(maxsize=64)
def _symm_from_json(text: str) -> SymmSettings:
    values = json.loads(text)
    if values.get("capacity_factor") == "max":
        values["capacity_factor"] = math.inf
    return SymmSettings(**values)
