"""primus-cli: click commands only; parsing lives in chain.py, plans in modes/, processes in execute.py."""

from __future__ import annotations

import inspect
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import click

from runner import __version__, chain, execute, preflight, templates
from runner import config as config_mod
from runner import host as host_mod
from runner.logs import setup_logging
from runner.modes import build_plan

logger = logging.getLogger(__name__)

CMD_HELP = """
\b
<cmd> is one of:
  train pretrain --config FILE [--key value ...]   the trainer (torchrun -m megamoe.train ...);
                                                    its config is checked once first (the preflight)
  train <other> [args ...]                          run once as one process (train prepare-data ...)
  --script FILE [args ...]                          any script under torchrun
\b
Every mode also takes --dry-run (run the preflight, print the plan, run nothing else),
--plan-json (the plan as JSON), --debug and --config FILE (launcher config) before <cmd>.
"""


@dataclass(kw_only=True)
class GlobalOpts:
    config: str | None
    debug: bool
    dry_run: bool
    plan_json: bool


class ChainCommand(click.Command):
    """A mode: its tokens go to chain.parse_chain untouched (click would eat `--` and slurm flags)."""

    def __init__(self, *args: object, usage: str = "", **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.usage = usage

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [self.usage]

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["chain_args"] = list(args)
        return []


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False),
    help="Launcher config YAML (layered on top of ~/.primus.yaml and ./.primus.yaml).",
)
@click.option("--debug", is_flag=True, help="Verbose launcher logs.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print every command of the chain; run nothing (no hook, container or job).",
)
@click.option("--plan-json", is_flag=True, help="Print the plan as JSON; run nothing.")
@click.version_option(__version__, prog_name="primus-cli")
@click.pass_context
def main(ctx: click.Context, config: str | None, debug: bool, dry_run: bool, plan_json: bool) -> None:
    """Launch MegaMoE trainings directly, in containers, or on Slurm (Primus-compatible grammar).

    \b
    primus-cli direct [opts] [--] <cmd>
    primus-cli container [--image I] [--runtime docker|podman] [opts] [--] [direct opts] [--] <cmd>
    primus-cli slurm [srun|sbatch] [slurm flags] -- [container|direct] [opts] [--] <cmd>
    """
    ctx.obj = GlobalOpts(config=config, debug=debug, dry_run=dry_run, plan_json=plan_json)
    setup_logging(debug)


def _launch(mode: str) -> None:
    ctx = click.get_current_context()
    glob: GlobalOpts = ctx.obj
    parsed = chain.parse_chain(mode, ctx.meta["chain_args"])
    if parsed.help_for:
        cmd = main.commands[parsed.help_for]
        with click.Context(cmd, info_name=parsed.help_for, parent=ctx.parent) as sub:
            click.echo(cmd.get_help(sub))
        return
    if parsed.debug:
        setup_logging(True)
    cli_layer = list(parsed.cli_layer)
    env = dict(os.environ)
    env_layer = [("container.image", env["DOCKER_IMAGE"])] if env.get("DOCKER_IMAGE") else []
    config_file = glob.config or parsed.config_file
    resolved = config_mod.resolve(
        home=Path.home(),
        cwd=Path.cwd(),
        config_file=Path(config_file) if config_file else None,
        env_layer=env_layer,
        cli_layer=cli_layer,
    )
    for name, value in parsed.env_values.items():
        if value is not None:
            env[name] = value
        elif name not in env:
            logger.warning("--env %s: not set in this environment; nothing to forward", name)
    req = chain.make_request(parsed, resolved.config, env, cwd=str(Path.cwd()))
    dry_run = glob.dry_run or parsed.dry_run or req.config.main.dry_run
    plan_json = glob.plan_json or parsed.plan_json
    host = host_mod.gather(env)
    plan, node = build_plan(req, host, dry_run=dry_run or plan_json)
    if plan.preflight:  # the trainer's config, checked once before any hook: exit 2 if it cannot start
        verdict = execute.run_preflight(plan.preflight, env, req.cwd)
        req = preflight.conclude(plan.preflight, verdict, req)
        plan, node = build_plan(req, host, dry_run=dry_run or plan_json)
    if dry_run or plan_json:
        click.echo(json.dumps(plan.to_dict(), indent=2, sort_keys=True) if plan_json else str(plan))
        if req.chain == ("direct",):
            execute.preview_hooks(plan.hooks, env, host.python)
        return
    for warning in plan.warnings:
        logger.warning("%s", warning)
    ctx.exit(execute.execute(plan, req, node, env))


USAGES = {
    "direct": "[OPTIONS] [--] <cmd>",
    "container": "[CONTAINER OPTIONS] [--] [DIRECT OPTIONS] [--] <cmd>",
    "slurm": "[srun|sbatch] [SLURM FLAGS] -- [container|direct] [OPTIONS] [--] <cmd>",
}
HELPS = {
    "direct": """Run <cmd> under torchrun on this node, hooks first (`train <other>` runs once, without it).

    \b
    direct options:
      --env NAME=VALUE      set a variable for the hooks and the training (never logged)
      --gpus-per-node N     torchrun --nproc-per-node (default: GPUS_PER_NODE, visible GPUs, 1)
      --master-port P       rendezvous port when MASTER_PORT is unset (default: a free port)
      --log-dir DIR         node logs: DIR/<job>-node<rank>.log (default: <run dir>/logs, else logs)
      --log-ranks all|first_last   which ranks reach the console (default first_last)
      --skip-hook NAME      do not run this hook (repeatable; also PRIMUS_SKIP_HOOKS=a,b)
      --hook-timeout S      per-hook timeout in seconds
      --hooks-dir DIR       hooks directory (default: hooks/ in the checkout)
    """,
    "container": """Run the direct layer inside docker or podman on this node.

    \b
    container options:
      --image IMAGE         image (DOCKER_IMAGE and container.image otherwise)
      --runtime R           docker | podman (auto-detected)
      --gpu V               auto | amd | nvidia | none
      -v, --volume SRC:DST  extra mount (repeatable); the checkout is always mounted
      --device PATH         extra device (repeatable)
      -e, --env NAME[=V]    forward NAME (by name only; =V sets it first)
      --ulimit TYPE=S:H     replaces the configured limit of that type
      --ipc, --network, --shm-size, --privileged, --cap-add, --security-opt, --name PREFIX, --python PATH
      --clean               remove containers left by earlier primus-cli runs (ours only, by label)
    then `--`, the direct options (see primus-cli direct --help), `--` and <cmd>.
    """,
    "slurm": """Start the chain on every node of a Slurm job, with srun (default) or sbatch.

    \b
    slurm flags: any srun/sbatch flag (-N 4, --nodes 4, --nodes=4, -p gpu, ...), merged over
    slurm.* in the launcher config; the command line wins; one task per node.
      --follow              sbatch: stream the job's logs until it ends, exit with its code
    The entry after `--` defaults to slurm.entry (container).
    """,
}


def _help(mode: str) -> str:
    return inspect.cleandoc(HELPS[mode]) + "\n\n" + inspect.cleandoc(CMD_HELP)


for _mode in HELPS:
    main.command(
        _mode,
        cls=ChainCommand,
        usage=USAGES[_mode],
        help=_help(_mode),
        context_settings={"ignore_unknown_options": True},
    )(lambda _m=_mode: _launch(_m))


@main.group("config")
def config_group() -> None:
    """Inspect the launcher config."""


@config_group.command("show")
@click.pass_obj
def config_show(glob: GlobalOpts) -> None:
    """Print the effective launcher config and the layer each value came from."""
    env_image = os.environ.get("DOCKER_IMAGE")
    resolved = config_mod.resolve(
        home=Path.home(),
        cwd=Path.cwd(),
        config_file=Path(glob.config) if glob.config else None,
        env_layer=[("container.image", env_image)] if env_image else [],
        cli_layer=[],
    )
    click.echo(resolved.show())


@main.group("template")
def template_group() -> None:
    """Job templates: the seed's EP8, EP8 + CUDA graph and 8-node PP8 jobs as runnable scripts."""


@template_group.command("list")
def template_list() -> None:
    """List the templates and their --set keys."""
    for t in templates.TEMPLATES.values():
        click.echo(f"{t.name:15} {t.description}")
        click.echo(f"{'':15} keys: {', '.join(sorted(t.defaults))}")


@template_group.command("render")
@click.argument("name")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), help="Write the script here (default: stdout)."
)
@click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a template value (repeatable)."
)
def template_render(name: str, output: str | None, sets: tuple[str, ...]) -> None:
    """Render template NAME into a runnable bash script (also a valid sbatch script)."""
    text = templates.render_job(name, templates.parse_sets(sets))
    if output is None:
        click.echo(text, nl=False)
        return
    path = Path(output)
    path.write_text(text)
    path.chmod(0o755)
    click.echo(str(path))
