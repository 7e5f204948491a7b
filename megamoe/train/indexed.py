"""Megatron indexed datasets on disk (``PREFIX.bin`` + ``PREFIX.idx``): blends, splits, integrity checks.

The file format is megatron-core's (``megatron.core.datasets.indexed_dataset``); this module only
reads the ``.idx`` header and the last pointer, so a missing, truncated or mismatched pair is found
at start-up, by name, before any rank builds a dataset. Blend and split strings follow Megatron-LM:
``data_path: "0.7 a 0.3 b"`` (or one prefix), ``split: "969,30,1"``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megamoe.errors import InvalidConfigError

_HEADER = b"MMIDIDX\x00\x00"
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 8, 8: 2}
"""megatron-core's DType codes -> bytes per token (uint8, int8, int16, int32, int64, float64,
float32, uint16)."""


@dataclass(frozen=True, kw_only=True)
class Blend:
    """Dataset prefixes and their weights (None: in proportion to their sizes, as Megatron does)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None

    def as_megatron(self) -> tuple[list[str], list[float] | None]:
        return list(self.prefixes), list(self.weights) if self.weights is not None else None


def parse_blend(text: str, setting: str) -> Blend:
    """``"prefix"``, ``"prefix1 prefix2"`` or ``"w1 prefix1 w2 prefix2 ..."``."""
    items = text.split()
    if not items:
        raise InvalidConfigError(
            setting, text, "empty", "Give a dataset prefix or a blend such as '0.7 a 0.3 b'"
        )
    weighted = _is_number(items[0])
    if not weighted:
        bad = next((item for item in items if _is_number(item)), None)
        if bad is not None:
            raise InvalidConfigError(
                setting,
                text,
                f"{bad!r} looks like a weight but the blend starts with a prefix",
                "Write 'w1 prefix1 w2 prefix2 ...' or only prefixes",
            )
        return Blend(prefixes=tuple(items), weights=None)
    if len(items) % 2:
        raise InvalidConfigError(
            setting,
            text,
            "a weighted blend needs a weight before every prefix",
            "Write 'w1 prefix1 w2 prefix2 ...'",
        )
    weights, prefixes = items[0::2], items[1::2]
    for weight in weights:
        if not _is_number(weight):
            raise InvalidConfigError(
                setting, text, f"weight {weight!r} is not a number", "Write 'w1 prefix1 w2 prefix2 ...'"
            )
    values = tuple(float(w) for w in weights)
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise InvalidConfigError(
            setting, text, "the weights must be >= 0 and sum to more than 0", "Fix the weights"
        )
    return Blend(prefixes=tuple(prefixes), weights=values)


def parse_split(text: str) -> tuple[float, float, float]:
    """``"969,30,1"`` (also ``/``-separated, fewer than three parts padded with 0) -> train/valid/test."""
    parts = [p for p in text.replace("/", ",").split(",") if p.strip()]
    if not 1 <= len(parts) <= 3 or not all(_is_number(p) for p in parts):
        raise InvalidConfigError(
            "split", text, "not up to three numbers", "Write e.g. 969,30,1 (train,valid,test)"
        )
    values = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise InvalidConfigError(
            "split", text, "the parts must be >= 0 and sum to more than 0", "Write e.g. 969,30,1"
        )
    return values[0], values[1], values[2]


def check_prefix(prefix: str, setting: str) -> None:
    """Raise, naming the file, unless ``prefix.bin`` and ``prefix.idx`` exist and belong together."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    missing = [p.name for p in (bin_, idx) if not p.is_file()]
    if missing:
        where = f" in {idx.parent}" if idx.parent.is_dir() else f"; the folder {idx.parent} does not exist"
        found = (
            sorted(p.name.removesuffix(".idx") for p in idx.parent.glob("*.idx"))
            if idx.parent.is_dir()
            else []
        )
        hint = (
            f"Prefixes there: {', '.join(found)}"
            if found
            else "Make it with `train prepare-data --output-prefix ...`"
        )
        raise InvalidConfigError(setting, prefix, f"{' and '.join(missing)} missing{where}", hint)
    problem = _pair_problem(idx, bin_)
    if problem:
        raise InvalidConfigError(setting, prefix, problem, "Re-run `train prepare-data` for it")


def _pair_problem(idx: Path, bin_: Path) -> str | None:
    size = idx.stat().st_size
    with idx.open("rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != _HEADER:
        return f"{idx.name} is not a megatron index file"
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in _DTYPE_SIZES:
        return f"{idx.name} has an unknown version or token type"
    if size < 34 + sequences * 12 + documents * 8:
        return f"{idx.name} is truncated"
    bin_size = bin_.stat().st_size
    if sequences == 0:
        return None if bin_size == 0 else f"{bin_.name} holds data but {idx.name} lists no sequences"
    index = np.memmap(idx, mode="r", dtype=np.uint8, offset=34, shape=(sequences * 12,))
    last_length = int(index[(sequences - 1) * 4 : sequences * 4].view(np.int32)[0])
    last_pointer = int(index[sequences * 4 + (sequences - 1) * 8 : sequences * 12].view(np.int64)[0])
    expected = last_pointer + last_length * _DTYPE_SIZES[code]
    if expected != bin_size:
        return f"{bin_.name} is {bin_size:,} bytes but {idx.name} describes {expected:,}: the pair does not match"
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
