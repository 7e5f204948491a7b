"""direct: hooks, then `torchrun` on this node (or one plain python for a command that runs once).

Rendezvous: inside a Slurm step (srun), NNODES and NODE_RANK come from the step's node list and
this node's name, MASTER_ADDR is the first host of the node list (a user MASTER_ADDR that is not
that host is an error), MASTER_PORT is MASTER_PORT or 20000 + job id % 20000 (the same on every
node, different between jobs). Outside Slurm they come from the environment, then the launcher
config, with 1 node, rank 0, localhost; with no port given, one node gets a free port (two jobs
on one node never collide) and several nodes get 1234, which all of them can know. On one node a
given port that is already taken is an error before torchrun starts. `--nproc-per-node` is
GPUS_PER_NODE, else `direct.gpus_per_node`, else (from a Slurm submit host) the job's
`--gpus-per-node`, else the visible GPUs, else 1; a dry run says when it was read off this host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from runner import hooks as hooks_mod
from runner.chain import Request
from runner.errors import ConfigError
from runner.host import HostFacts, expand_nodelist
from runner.plan import LaunchPlan, Step


@dataclass(frozen=True, kw_only=True)
class NodeContext:
    """This node's place in the job; `<...>` strings stand for values only a node knows."""

    nnodes: str
    node_rank: str
    master_addr: str
    master_port: str
    nproc: str
    job_id: str
    guesses: tuple[str, ...] = ()
    """Values read off this host rather than set, each with how to set it (dry runs show them)."""

    def env(self) -> dict[str, str]:
        return {
            "NNODES": self.nnodes,
            "NODE_RANK": self.node_rank,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
            "GPUS_PER_NODE": self.nproc,
            "PRIMUS_JOB_ID": self.job_id,
        }


def _int(name: str, value: str, remedy: str) -> int:
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(f"{name}={value!r}: not an integer. {remedy}") from e


def in_slurm_step(env: dict[str, str] | object) -> bool:
    """True inside an srun step (not in a batch script, which runs on the first node only)."""
    return "SLURM_STEP_ID" in env and ("SLURM_STEP_NODELIST" in env or "SLURM_JOB_NODELIST" in env)  # type: ignore[operator]


def _short(host: str) -> str:
    return host.split(".", 1)[0]


MULTI_NODE_PORT = "1234"
"""The rendezvous port of a multi-node job outside Slurm when none is given: every node can know it."""
FREE_PORT = "<FREE_PORT>"


def _nproc(req: Request, host: HostFacts, *, symbolic_slurm: bool) -> tuple[str, str | None]:
    """(processes per node, the note saying it was guessed from this host when nobody set it).

    From a Slurm submit host, the job's own `--gpus-per-node [type:]N` says it before this host does.
    """
    configured = req.config.direct.gpus_per_node
    nproc = host.env.get("GPUS_PER_NODE") or (str(configured) if configured else "")
    slurm_gpus = dict(req.slurm_flags).get("gpus-per-node") if symbolic_slurm else None
    nproc = nproc or (slurm_gpus.rsplit(":", 1)[-1] if slurm_gpus else "")
    if nproc:
        if _int("GPUS_PER_NODE", nproc, "Set it to the number of processes per node.") < 1:
            raise ConfigError(f"GPUS_PER_NODE={nproc}: must be at least 1.")
        return nproc, None
    seen = f"{host.visible_gpus} GPUs visible" if host.visible_gpus else "no GPUs visible"
    nproc = str(max(host.visible_gpus, 1))
    note = f"nproc-per-node={nproc} guessed from this host ({seen}); set GPUS_PER_NODE or --gpus-per-node"
    return nproc, note


def node_context(
    req: Request, host: HostFacts, *, dry_run: bool, symbolic_slurm: bool = False
) -> tuple[NodeContext, list[str]]:
    """Derive and check this node's rendezvous settings; return them with warnings."""
    env, cfg = host.env, req.config
    warnings: list[str] = []
    nproc, guess = _nproc(req, host, symbolic_slurm=symbolic_slurm)
    guesses = (guess,) if guess and req.command.distributed else ()
    if dry_run:
        warnings += guesses
    user_port = env.get("MASTER_PORT") or (str(cfg.direct.master_port) if cfg.direct.master_port else "")

    if symbolic_slurm:
        nodes = dict(req.slurm_flags).get("nodes") or "<SLURM_NNODES>"
        ctx = NodeContext(
            nnodes=nodes,
            node_rank="<NODE_RANK>",
            master_addr=env.get("MASTER_ADDR") or "<FIRST_NODE>",
            master_port=user_port or "<20000+SLURM_JOB_ID%20000>",
            nproc=nproc,
            job_id="<SLURM_JOB_ID>",
            guesses=guesses,
        )
        return ctx, warnings

    slurm_step = in_slurm_step(env)
    if slurm_step:
        hosts = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        me = env.get("SLURMD_NODENAME", "")
        rank = str(hosts.index(me)) if me in hosts else env.get("SLURM_NODEID", "0")
        master = hosts[0]
        user_master = env.get("MASTER_ADDR", "")
        if user_master and _short(user_master) != _short(master):
            raise ConfigError(
                f"MASTER_ADDR={user_master}: not the first node of this Slurm job ({master}); every node must "
                "rendezvous at the first node. Unset MASTER_ADDR (primus-cli derives it) or set it to "
                f"{master}."
            )
        job = env.get("SLURM_JOB_ID", host.job_id)
        port = user_port or str(20000 + _int("SLURM_JOB_ID", job, "") % 20000)
        ctx = NodeContext(
            nnodes=str(len(hosts)),
            node_rank=rank,
            master_addr=master,
            master_port=port,
            nproc=nproc,
            job_id=job,
            guesses=guesses,
        )
    else:
        if int(env.get("SLURM_NNODES", "1") or 1) > 1 and "NNODES" not in env:
            warnings.append(
                f"in a {env['SLURM_NNODES']}-node Slurm allocation but not in an srun step: only this node "
                "runs. Use `primus-cli slurm srun -- direct ...` to start every node."
            )
        nnodes = env.get("NNODES") or "1"
        ctx = NodeContext(
            nnodes=nnodes,
            node_rank=env.get("NODE_RANK") or "0",
            master_addr=env.get("MASTER_ADDR") or "localhost",
            master_port=user_port or _default_port(nnodes, host, dry_run=dry_run),
            nproc=nproc,
            job_id=host.job_id,
            guesses=guesses,
        )

    nnodes = _int("NNODES", ctx.nnodes, "Set NNODES to the number of nodes.")
    rank = _int("NODE_RANK", ctx.node_rank, "Set NODE_RANK to this node's index, 0..NNODES-1.")
    if nnodes < 1:
        raise ConfigError(f"NNODES={nnodes}: must be at least 1.")
    if not 0 <= rank < nnodes:
        raise ConfigError(f"NODE_RANK={rank}: must be in 0..{nnodes - 1} for NNODES={nnodes}.")
    if ctx.master_port != FREE_PORT:
        port = _int("MASTER_PORT", ctx.master_port, "Set MASTER_PORT to a free port in 1024-65535.")
        if not 1024 <= port <= 65535:
            raise ConfigError(f"MASTER_PORT={port}: out of range. Use a free port in 1024-65535.")
        torchrun_here = req.command.distributed and "container" not in req.chain
        if nnodes == 1 and torchrun_here and host.port_in_use(port):
            msg = _port_taken(port, host, slurm_step=slurm_step)
            if not dry_run:
                raise ConfigError(msg)
            warnings.append(msg)
    if nnodes > 1 and ctx.master_addr in ("localhost", "127.0.0.1"):
        warnings.append(f"MASTER_ADDR={ctx.master_addr} with NNODES={nnodes}: other nodes cannot reach it.")
    if not host.resolves(ctx.master_addr):
        msg = f"MASTER_ADDR={ctx.master_addr}: does not resolve on {host.hostname}. Set it to a reachable host name."
        if not dry_run:
            raise ConfigError(msg)
        warnings.append(msg)
    return ctx, warnings


def _port_taken(port: int, host: HostFacts, *, slurm_step: bool) -> str:
    remedy = (
        "Set MASTER_PORT to a free port"
        if slurm_step
        else "Give none (no MASTER_PORT, --master-port or direct.master_port) to get a free one, or pick another"
    )
    return f"MASTER_PORT={port}: already in use on {host.hostname} (another job on this node?). {remedy}."


def _default_port(nnodes: str, host: HostFacts, *, dry_run: bool) -> str:
    """No port given: a free one on one node (a dry run shows a placeholder), else MULTI_NODE_PORT."""
    if nnodes != "1":
        return MULTI_NODE_PORT
    return FREE_PORT if dry_run else str(host.free_port())


def log_dir(req: Request) -> Path:
    """`direct.log_dir` when set, else the run directory's `logs/` (known for `train pretrain`), else `logs`."""
    chosen = req.config.direct.log_dir
    if chosen is None:
        chosen = str(Path(req.run_dir) / "logs") if req.run_dir else "logs"
    return Path(req.cwd) / chosen


def log_file(req: Request, ctx: NodeContext) -> str:
    """One file per node, named by job and node rank, so no node overwrites another's."""
    return str(log_dir(req) / f"{ctx.job_id}-node{ctx.node_rank}.log")


def build(
    req: Request, host: HostFacts, ctx: NodeContext, *, python: str, where: str, warnings: list[str]
) -> LaunchPlan:
    """The direct layer: hooks and the command's step, for the node described by `ctx`."""
    cfg = req.config
    skip = [*cfg.hooks.skip, *req.skip_hooks, *host.env.get(hooks_mod.SKIP_VAR, "").split(",")]
    hook_calls, skipped = hooks_mod.discover(
        Path(host.checkout) / cfg.hooks.dir, req.command.hook_group(), req.command.argv, skip
    )
    plan = LaunchPlan(
        chain=req.chain,
        steps=(),
        hooks=hook_calls,
        hooks_where=where,
        skipped_hooks=skipped,
        warnings=tuple(warnings),
    )
    if not req.command.distributed:
        step = Step(kind="python", argv=(python, *req.command.target()), where=where)
        return replace(plan, steps=(step,))
    node_log = log_file(req, ctx)
    argv = (
        python, "-m", "torch.distributed.run",
        "--nproc-per-node", ctx.nproc,
        "--nnodes", ctx.nnodes,
        "--node-rank", ctx.node_rank,
        "--master-addr", ctx.master_addr,
        "--master-port", ctx.master_port,
        "--tee", "3",
        "--log-dir", node_log.removesuffix(".log") + "-ranks",
        *req.command.target(),
    )  # fmt: skip
    step = Step(kind="torchrun", argv=argv, where=where)
    return replace(plan, steps=(step,), log_file=node_log)
