"""`train prepare-data`: a corpus to megatron indexed datasets (``PREFIX_<key>_document.bin/.idx``).

Megatron-LM's ``tools/preprocess_data.py`` flags, so commands carry over. Inputs are JSON lines
(``.jsonl``/``.json``, one object a line, the text under ``--json-keys``) or plain text (``.txt``:
one document a line), optionally gzipped. Worker processes tokenize batches of lines in order; the
main process writes with megatron-core's ``IndexedDatasetBuilder``. Output appears atomically: both
files are written under temporary names and renamed (``.bin`` first, the ``.idx`` last) only when
complete, so a killed run never leaves a pair that looks valid.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from megamoe.errors import InvalidConfigError
from megamoe.train import tokenizer as tokenizers

_BATCH_LINES = 256
_JSON_SUFFIXES = (".jsonl", ".json")
_TEXT_SUFFIXES = (".txt",)

_worker_tokenizer: Any = None
"""The tokenizer a forked worker inherits from the main process (set once before the pool starts)."""


@dataclass(frozen=True, kw_only=True)
class PrepareSettings:
    """What to read, how to tokenize it, where to write."""

    inputs: tuple[Path, ...]
    output_prefix: str
    json_keys: tuple[str, ...] = ("text",)
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    append_eod: bool = False
    workers: int = 1
    skip_bad_lines: bool = False
    log_interval: int = 10_000
    """Documents between progress lines when stderr is not a terminal."""


@dataclass(kw_only=True)
class PrepareSummary:
    """What a finished run wrote and skipped."""

    documents: int = 0
    tokens: int = 0
    empty: int = 0
    bad_lines: int = 0
    bytes_read: int = 0
    """Bytes of the lines tokenized so far (uncompressed)."""
    load_seconds: float = 0.0
    """Loading the tokenizer (its libraries included), before the first line."""
    seconds: float = 0.0
    """Reading, tokenizing and writing."""
    outputs: list[str] = field(default_factory=list)

    def text(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        mb_s = self.bytes_read / 2**20 / self.seconds if self.seconds else 0.0
        return (
            f"prepare-data: {self.documents:,} documents, {self.tokens:,} tokens -> {', '.join(self.outputs)} "
            f"(.bin/.idx) | skipped {self.empty:,} empty documents, {self.bad_lines:,} bad lines | "
            f"{self.seconds:.1f} s, {rate:,.0f} tokens/s, {mb_s:.2f} MB/s of input "
            f"(after {self.load_seconds:.1f} s loading the tokenizer)"
        )


def output_prefix(prefix: str, key: str) -> str:
    """Megatron-LM's naming: ``PREFIX_<json key>_document``."""
    return f"{prefix}_{key}_document"


def check_settings(s: PrepareSettings) -> None:
    """Every input and setting problem, by name, before any work starts."""
    if not s.inputs:
        raise InvalidConfigError("--input", "", "no input file", "Pass --input FILE.jsonl[,FILE2...]")
    for path in s.inputs:
        if not path.is_file():
            raise InvalidConfigError("--input", str(path), "no such file")
        if _format(path) is None:
            raise InvalidConfigError(
                "--input",
                str(path),
                "unknown format",
                "Use .jsonl/.json (JSON lines) or .txt (one document a line), optionally .gz",
            )
    if s.workers < 1:
        raise InvalidConfigError("--workers", s.workers, "must be >= 1")
    if not s.json_keys or any(not k for k in s.json_keys):
        raise InvalidConfigError(
            "--json-keys", ",".join(s.json_keys), "needs at least one key", "e.g. --json-keys text"
        )
    out_dir = Path(s.output_prefix).parent
    if out_dir.exists() and not out_dir.is_dir():
        raise InvalidConfigError("--output-prefix", s.output_prefix, f"{out_dir} is not a directory")
    tokenizers.check_tokenizer(s.tokenizer_type, s.tokenizer_model, s.vocab_size)


def prepare(s: PrepareSettings, *, progress: IO[str] = sys.stderr) -> PrepareSummary:
    """Tokenize every input into one indexed dataset per JSON key; returns what was written."""
    global _worker_tokenizer
    check_settings(s)
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    loading = time.perf_counter()
    tokenizer = tokenizers.build_tokenizer(s.tokenizer_type, s.tokenizer_model, s.vocab_size)
    started = time.perf_counter()
    eod = tokenizers.end_of_document_id(tokenizer, s.tokenizer_model) if s.append_eod else None
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    Path(s.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    finals = {key: output_prefix(s.output_prefix, key) for key in s.json_keys}
    partials = {key: f"{final}.partial-{os.getpid()}" for key, final in finals.items()}
    summary = PrepareSummary(load_seconds=started - loading)
    _worker_tokenizer = tokenizer
    try:
        builders = {key: IndexedDatasetBuilder(partials[key] + ".bin", dtype=dtype) for key in s.json_keys}
        with _encoded_batches(s) as batches, _Progress(progress, s.log_interval, summary) as bar:
            for batch in batches:
                for result in batch:
                    _write(result, s, builders, eod, summary)
                    bar.update()
        for key, builder in builders.items():
            builder.finalize(partials[key] + ".idx")
        for key in s.json_keys:
            _publish(partials[key], finals[key])
    finally:
        _worker_tokenizer = None
        for partial in partials.values():
            for suffix in (".bin", ".idx"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(partial + suffix)
    summary.seconds = time.perf_counter() - started
    summary.outputs = list(finals.values())
    return summary


def _publish(partial: str, final: str) -> None:
    """The old ``.idx`` goes first and the new one comes last: between the renames no valid pair exists."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(final + ".idx")
    os.replace(partial + ".bin", final + ".bin")
    os.replace(partial + ".idx", final + ".idx")


def _write(
    result: tuple, s: PrepareSettings, builders: dict[str, Any], eod: int | None, summary: PrepareSummary
) -> None:
    kind, size = result[0], result[1]
    summary.bytes_read += size
    if kind == "bad":
        _, _, source, line_no, reason = result
        if not s.skip_bad_lines:
            raise InvalidConfigError(
                "--input",
                f"{source}:{line_no}",
                reason,
                "Fix the line, or pass --skip-bad-lines to skip and count such lines",
            )
        summary.bad_lines += 1
        return
    for key, ids in result[2].items():
        if ids is None:
            summary.empty += 1
            continue
        if eod is not None:
            ids = np.append(ids, eod)
        builders[key].add_document(ids, [ids.size])
        summary.documents += 1
        summary.tokens += int(ids.size)


@contextlib.contextmanager
def _encoded_batches(s: PrepareSettings) -> Iterator[Iterator[list[tuple]]]:
    """Tokenized batches of lines in input order: in this process, or in forked workers."""
    lines = _batches(s.inputs)
    if s.workers == 1:
        yield (_encode_batch(batch, s.json_keys) for batch in lines)
        return
    context = mp.get_context("fork")  # workers inherit the loaded tokenizer instead of loading it again
    pool = context.Pool(s.workers, initializer=_quiet_worker)
    try:
        yield pool.imap(functools.partial(_encode_batch, keys=s.json_keys), lines)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _quiet_worker() -> None:
    """Ctrl-C is the main process's to handle; the Rust tokenizer must not start threads in a fork."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _batches(inputs: tuple[Path, ...]) -> Iterator[list[tuple[str, str, int, str]]]:
    batch: list[tuple[str, str, int, str]] = []
    for path in inputs:
        fmt = _format(path)
        with _open(path) as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                batch.append((fmt, str(path), line_no, line))
                if len(batch) == _BATCH_LINES:
                    yield batch
                    batch = []
    if batch:
        yield batch


def _encode_batch(batch: list[tuple[str, str, int, str]], keys: tuple[str, ...]) -> list[tuple]:
    out: list[tuple] = []
    for fmt, source, line_no, line in batch:
        size = len(line.encode("utf-8"))
        if fmt == "text":
            texts: dict[str, Any] = dict.fromkeys(keys, line.rstrip("\n"))
        else:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                out.append(("bad", size, source, line_no, f"not valid JSON ({e.msg}, column {e.colno})"))
                continue
            missing = [k for k in keys if not isinstance(record, dict) or k not in record]
            if missing:
                out.append(("bad", size, source, line_no, f"no key {missing[0]!r} in the JSON object"))
                continue
            texts = {k: record[k] for k in keys}
            wrong = next((k for k, v in texts.items() if not isinstance(v, str)), None)
            if wrong is not None:
                out.append(("bad", size, source, line_no, f"the value of {wrong!r} is not a string"))
                continue
        ids = {
            k: np.asarray(_worker_tokenizer.tokenize(t), dtype=np.int64) if t.strip() else None
            for k, t in texts.items()
        }
        out.append(("ok", size, {k: v if v is not None and v.size else None for k, v in ids.items()}))
    return out


def _format(path: Path) -> str | None:
    name = path.name.removesuffix(".gz")
    if name.endswith(_JSON_SUFFIXES):
        return "json"
    if name.endswith(_TEXT_SUFFIXES):
        return "text"
    return None


def _open(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


class _Progress:
    """A tqdm bar (documents, tokens, MB/s) on a terminal; otherwise a line every ``interval`` documents."""

    def __init__(self, stream: IO[str], interval: int, summary: PrepareSummary) -> None:
        self.stream, self.interval, self.summary = stream, interval, summary
        self.started = time.perf_counter()
        self.count = 0
        self.bar: Any = None

    def __enter__(self) -> _Progress:
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc="prepare-data", unit=" docs", file=self.stream, dynamic_ncols=True)
        return self

    def update(self) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.update(1)
            if self.count % 64 == 0:
                self.bar.set_postfix_str(self._rates(), refresh=False)
        elif self.count % self.interval == 0:
            print(f"prepare-data: {self.count:,} lines | {self._rates()}", file=self.stream, flush=True)

    def _rates(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        s = self.summary
        return f"{s.tokens:,} tokens | {s.tokens / seconds:,.0f} tokens/s | {s.bytes_read / 2**20 / seconds:.2f} MB/s"

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
