"""Quantised expert weights, cached per weight and refreshed once per optimizer step.

The MXFP8 path multiplies every weight in two MX forms: *rowwise* (``w [G, Y, X]`` in blocks along X,
the forward operand) and *transposed* (``w^T [G, X, Y]`` stored contiguous, blocks along Y, the
dgrad operand). FP8's emulation keeps one form, ``w`` in 128×128 blocks, whose transpose is exactly
the blocks of ``w^T`` (:mod:`megamoe.quant.recipes`); its kernels keep ``w^T``'s as well (Hopper's FP8
MMA reads both operands K-major) and write the two in one pass. Quantising costs a pass over the
weights, so each form is kept per weight and served again while the weight is unchanged: from the
forward to the backward, across gradient-accumulation micro-batches, activation recompute, warm-up
and eval.

"Unchanged" is the stamp ``(weight_generation, w._version, w.data_ptr())``. ``w._version`` alone is
not enough: optimizers that write parameters through ``.data`` or through a flat buffer that aliases
them (megatron-core's distributed optimizer does) never bump it. So the trainer calls
:func:`advance_weight_generation` once per optimizer step, which makes every entry stale at once.
Until the first call, nothing is served from the cache (every use re-quantises): a caller that never
advances the generation can never see a stale weight, it only pays the quantisation.

Bugs of the design this replaces, and how this one avoids them:

* the transposed form lived in a second cache that was never invalidated, so dgrad used step-0
  weights for a whole run: here both forms share one stamp rule and one code path;
* re-allocating the cached tensors on refresh grew memory every step: here an entry's buffers are
  allocated once and rewritten in place (same ``data_ptr`` for the life of the weight);
* keying on ``data_ptr`` can serve a dead weight's entry to a new tensor at the same address: here an
  entry belongs to one live tensor object (weak reference) and dies with it.

During CUDA graph capture every use re-quantises (into the same buffers), so a replay after an
optimizer step reads the new weights.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megamoe.quant.fp8 import FP8Tensor
from megamoe.quant.mx import MXTensor, empty_mx, quantize_mx

QuantizedWeight = MXTensor | FP8Tensor
"""a cached form: quantised data and scales, with ``dequantize()``."""

_generation = 0


def advance_weight_generation() -> int:
    """Mark every cached quantised weight stale; call once after each optimizer step. Returns the new generation."""
    global _generation
    _generation += 1
    return _generation


def weight_generation() -> int:
    """How many times :func:`advance_weight_generation` has been called in this process."""
    return _generation


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stamp(w: Tensor) -> tuple[int, int, int] | None:
    """What must be equal for a cached form of ``w`` to be served; None when it must be re-quantised."""
    if _generation == 0 or w.is_inference() or _capturing(w.device):
        return None
    return (_generation, w._version, w.data_ptr())


@dataclass(slots=True)
class _Entry:
    ref: weakref.ref
    form: QuantizedWeight
    stamp: tuple[int, int, int] | None


def _quantize_torch(source: Tensor, out: MXTensor) -> None:
    quantize_mx(source, dim=-1, out=out)


def _empty_torch(shape: tuple[int, ...], device: torch.device) -> MXTensor:
    return empty_mx(shape, -1, device)


class WeightCache:
    """Quantised forms of weights ``[G, Y, X]``, one entry per (live weight tensor, form), rewritten in place.

    ``quantize(source, out)`` fills an entry (``source`` is ``w`` or the view ``w.transpose(1, 2)``)
    and ``empty(shape, device)`` allocates one. The defaults are the MX ones in PyTorch (blocks along
    the last dim, :func:`~megamoe.quant.mx.quantize_mx`); a kernel backend passes its own quantiser and
    scale layout (same values), and the FP8 recipe its 128×128 block quantiser. ``quantize_both(w,
    out, out_t)``, where a format has one, fills both forms in one pass over ``w``: a form that can be
    kept (the stamp is set) is then quantised with its twin, which the backward reads next.
    """

    def __init__(
        self,
        *,
        quantize: Callable[[Tensor, QuantizedWeight], object] = _quantize_torch,
        empty: Callable[[tuple[int, ...], torch.device], QuantizedWeight] = _empty_torch,
        quantize_both: Callable[[Tensor, QuantizedWeight, QuantizedWeight], object] | None = None,
    ) -> None:
        self._quantize = quantize
        self._empty = empty
        self._quantize_both = quantize_both
        self._entries: dict[tuple[int, bool], _Entry] = {}
        self.hits = 0
        """forms served without quantising (for tests and logs)."""
        self.misses = 0
        """forms (re)quantised."""

    def get(self, w: Tensor, *, transposed: bool) -> QuantizedWeight:
        """``w``'s quantised form, or (``transposed``) that of ``w^T [G, X, Y]``, stored contiguous."""
        if w.dim() != 3:
            raise ValueError(f"w: expected an expert weight [G, Y, X], got shape {tuple(w.shape)}")
        entry = self._entry(w, transposed)
        stamp = _stamp(w)
        if stamp is not None and stamp == entry.stamp:
            self.hits += 1
            return entry.form
        if stamp is not None and self._quantize_both is not None:
            twin = self._entry(w, not transposed)
            forward, backward = (twin, entry) if transposed else (entry, twin)
            self._quantize_both(w, forward.form, backward.form)
            forward.stamp = backward.stamp = stamp
            self.misses += 2
            return entry.form
        self._quantize(w.transpose(1, 2) if transposed else w, entry.form)
        entry.stamp = stamp
        self.misses += 1
        return entry.form

    def _entry(self, w: Tensor, transposed: bool) -> _Entry:
        """The entry of ``w``'s form, (re)allocated when missing or not ``w``'s (stamp None then)."""
        key = (id(w), transposed)
        shape = (w.shape[0], w.shape[2], w.shape[1]) if transposed else tuple(w.shape)
        entry = self._entries.get(key)
        if (
            entry is None
            or entry.ref() is not w
            or entry.form.shape != shape
            or entry.form.data.device != w.device
        ):
            entry = self._new_entry(key, w, shape)
        return entry

    def _new_entry(self, key: tuple[int, bool], w: Tensor, shape: tuple[int, ...]) -> _Entry:
        entries = self._entries

        def forget(ref: weakref.ref) -> None:
            if key in entries and entries[key].ref is ref:
                del entries[key]

        entry = _Entry(ref=weakref.ref(w, forget), form=self._empty(shape, w.device), stamp=None)
        entries[key] = entry
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held by all cached forms."""
        return sum(entry.form.nbytes for entry in list(self._entries.values()))  # a list: GC may drop entries

    def buffers(self) -> list[tuple[int, int]]:
        """``(data_ptr, scale_ptr)`` of every entry: constant while the cache rewrites in place."""
        return [(e.form.data.data_ptr(), e.form.scale.data_ptr()) for e in list(self._entries.values())]

    def clear(self) -> None:
        self._entries.clear()
