"""Logging for the trainer entry: rank in every line, INFO on rank 0 only, WARNING and up everywhere.

Lines go to stderr through tqdm's writer so they never tear the progress bar; megatron-core's own
INFO chatter is lowered to WARNING unless ``stderr_sink_level: DEBUG``.
"""

from __future__ import annotations

import logging
import sys
import warnings

from tqdm import tqdm


class _TqdmHandler(logging.StreamHandler):
    """Writes above a live progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never take the run down; same contract as StreamHandler
            self.handleError(record)


def setup_logging(rank: int, level: str = "INFO") -> None:
    """Configure the root logger once for this process."""
    handler = _TqdmHandler()
    handler.setFormatter(
        logging.Formatter(
            f"[%(asctime)s rank {rank}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    wanted = getattr(logging, level.upper(), logging.INFO)
    root.setLevel(wanted if rank == 0 else max(wanted, logging.WARNING))
    if wanted > logging.DEBUG:
        _quiet_third_party()


_NOISE = (
    r".*(Transformer Engine|Apex|apex).*not installed.*",
    r".*\.grad attribute of a Tensor that is not a leaf.*",
    r".*Consider using tensor\.detach\(\) first.*",
    r".*full scope is deprecated.*",
)


def _quiet_third_party() -> None:
    """megatron-core and torch warn about optional GPU packages and API renames on every rank."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)  # "Unable to save ... indexes"
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for pattern in _NOISE:
        warnings.filterwarnings("ignore", message=pattern)
