"""`python -m runner.node`: run the rest of the chain on this node (after srun, or in a container).

The chain arrives as JSON in PRIMUS_LAUNCH_REQUEST (config and command, no environment values),
so nothing is parsed again and no config file has to exist here.
"""

from __future__ import annotations

import json
import os
import sys

from runner import env as env_mod
from runner import execute
from runner import host as host_mod
from runner.chain import Request
from runner.errors import ConfigError, LaunchError
from runner.logs import setup_logging
from runner.modes import build_plan


def main() -> int:
    data = os.environ.get(env_mod.REQUEST_VAR)
    if not data:
        sys.stderr.write(f"runner.node: {env_mod.REQUEST_VAR} is not set; start jobs with primus-cli.\n")
        return 2
    req = Request.from_dict(json.loads(data))
    env = {k: v for k, v in os.environ.items() if k != env_mod.REQUEST_VAR}
    where = env.get("SLURMD_NODENAME") or (f"node-rank{env['NODE_RANK']}" if "NODE_RANK" in env else None)
    setup_logging(req.config.main.debug, node=where)
    host = host_mod.gather(env)
    try:
        plan, ctx = build_plan(req, host, dry_run=False)
        return execute.execute(plan, req, ctx, env)
    except (ConfigError, LaunchError) as e:
        sys.stderr.write(f"Error: {e.format_message()}\n")
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
