"""Build the launch plan: the innermost layer (direct) first, then each outer mode wraps it."""

from __future__ import annotations

from dataclasses import replace

from runner import preflight
from runner.chain import Request
from runner.host import HostFacts
from runner.modes import container, direct, slurm
from runner.plan import LaunchPlan


def build_plan(req: Request, host: HostFacts, *, dry_run: bool) -> tuple[LaunchPlan, direct.NodeContext]:
    """The whole chain as seen from here, with the trainer's config check that runs before it.
    Pure: the same request and facts give the same plan.

    From a submit host (`slurm` first), per-node values are placeholders; on a node (the chain
    after srun), they are this node's.
    """
    outer = req.chain[0]
    symbolic = outer == "slurm"
    ctx, warnings = direct.node_context(req, host, dry_run=dry_run, symbolic_slurm=symbolic)
    check, check_warnings = preflight.plan_check(req, host, ctx, symbolic=symbolic)
    has_container = "container" in req.chain
    node_where = ("on each node" if req.command.distributed else "on one node") if symbolic else "here"
    inner_where = f"inside the container {node_where}" if has_container else node_where
    python = container.container_python(req, host) if has_container else host.python
    plan = direct.build(req, host, ctx, python=python, where=inner_where, warnings=warnings)
    if has_container:
        plan = container.build(req, host, ctx, plan, dry_run=dry_run, where=node_where)
    if symbolic:
        plan = slurm.build(req, host, plan)
    return replace(plan, preflight=check, warnings=(*plan.warnings, *check_warnings)), ctx
