"""One logging setup for the launcher's entry points: stderr, with the node in every line."""

from __future__ import annotations

import logging
import socket
import sys


def setup_logging(debug: bool, node: str | None = None) -> None:
    where = node or socket.gethostname()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"[primus-cli %(asctime)s {where}] %(levelname)s %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("runner")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False
