"""Which environment variables cross into a container: an explicit whitelist plus name prefixes.

Variables are forwarded by name only (`-e NAME`): the runtime copies the value from its own
environment, so no value is ever on a command line, in a plan or in a log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from runner.config import EnvOpts

REQUEST_VAR = "PRIMUS_LAUNCH_REQUEST"
"""Carries the rest of the chain (JSON, no environment values) to each node and into containers."""

DISTRIBUTED_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "PRIMUS_JOB_ID")
"""Set by the layer that knows them (srun on a node, the container layer) for the layer inside."""


def forwarded_names(opts: EnvOpts, env: Mapping[str, str], extra: Iterable[str] = ()) -> tuple[str, ...]:
    """Whitelisted names that are set, then prefix matches, then `extra` (explicit), de-duplicated.

    A whitelisted name that is unset is left out (as Primus does), so a container never sees an
    empty value where the image had a default.
    """
    names: list[str] = [n for n in opts.forward if n in env]
    names += sorted(n for n in env if n.startswith(tuple(opts.prefixes)))
    names += list(extra)
    return tuple(dict.fromkeys(names))
