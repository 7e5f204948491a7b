"""The preflight: the trainer's config checked once, here, before any hook runs or any rank starts.

`train pretrain --config X ...` is checked by `python -m megamoe.train check --world-size N
--cuda|--no-cuda <the same arguments>`, one quick process that prints one JSON verdict. A config
that cannot start then costs one line and exit code 2, in a dry run too, instead of one error per
rank after torchrun started them all. An accepted config names the run directory
(`<workspace>/<work_group>/<user_name>/<exp_name>`), where the node logs go by default.

The world size is nodes x processes per node as the plan has them. From a Slurm submit host the
node count is -N (else the allocation's SLURM_NNODES for srun, else Slurm's default of 1) and the
processes per node may be read off this host; the plan says what was assumed, and so does a
failure. The check runs with this host's python, so it needs megamoe importable here; where it
is not, the check is skipped with a plan warning (the trainer still checks when its ranks start).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.chain import Request
from runner.command import TRAIN_MODULE
from runner.errors import ConfigError
from runner.host import HostFacts
from runner.plan import Preflight

if TYPE_CHECKING:  # runner.modes builds the plan with this module
    from runner.modes.direct import NodeContext


def _nodes(req: Request, host: HostFacts, ctx: NodeContext, *, symbolic: bool) -> tuple[int, str | None]:
    """(node count, how it was assumed when this host cannot know it)."""
    if not symbolic:
        return int(ctx.nnodes), None
    given = dict(req.slurm_flags).get("nodes")
    if given:
        return int(given), None
    allocation = host.env.get("SLURM_NNODES")
    if req.launcher == "srun" and allocation and allocation.isdigit():
        return int(allocation), f"{allocation} nodes from this allocation's SLURM_NNODES (no -N)"
    return 1, "1 node, Slurm's default (no -N)"


def _has_cuda(req: Request, host: HostFacts, *, symbolic: bool) -> tuple[bool, str | None]:
    """Whether the ranks will see GPUs: this host's answer, or assumed yes for Slurm nodes."""
    if "container" in req.chain and req.config.container.gpu == "none":
        return False, None
    if symbolic and not host.visible_gpus:
        return True, "GPUs on the nodes"
    return host.visible_gpus > 0, None


def plan_check(
    req: Request, host: HostFacts, ctx: NodeContext, *, symbolic: bool
) -> tuple[Preflight | None, list[str]]:
    """The check for `train pretrain` (None for the commands that run once, `--help` included)."""
    cmd = req.command
    if cmd.kind != "train" or not cmd.distributed:
        return None, []
    if not host.trainer_importable:
        return None, [
            f"preflight skipped: megamoe and torch are not importable by {host.python} on this host; "
            "the trainer checks its config when its ranks start"
        ]
    nodes, node_note = _nodes(req, host, ctx, symbolic=symbolic)
    has_cuda, cuda_note = _has_cuda(req, host, symbolic=symbolic)
    world = nodes * int(ctx.nproc)
    argv = (
        host.python, "-m", TRAIN_MODULE, "check",
        "--world-size", str(world), "--cuda" if has_cuda else "--no-cuda",
        *cmd.argv[2:],
    )  # fmt: skip
    assumed = "; ".join(n for n in (node_note, *ctx.guesses, cuda_note) if n)
    basis = f"{nodes} node{'s' * (nodes > 1)} x {ctx.nproc} processes"
    return Preflight(argv=argv, world_size=world, basis=basis, assumed=assumed), []


def conclude(check: Preflight, verdict: dict[str, Any] | None, req: Request) -> Request:
    """Stop the launch on a rejected config; otherwise the request with the run directory known."""
    if verdict is None:
        return req
    if not verdict.get("ok"):
        assumed = f" (checked for world size {check.world_size}: {check.assumed})" if check.assumed else ""
        raise ConfigError(f"{verdict.get('error')}{assumed}")
    output_dir = verdict.get("output_dir")
    return replace(req, run_dir=str(Path(req.cwd) / output_dir)) if output_dir else req
