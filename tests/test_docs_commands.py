"""The commands of README.md's and docs/*.md's ```bash blocks run as written.

Each block is cut into commands (continuation lines joined, comments dropped) and run in order,
in a scratch copy of the checkout (its entries symlinked; what the commands write stays there),
which already holds what the docs assume: the demo's data (`output/data`, as `make demo` leaves
it) and the user's own files (`corpus.jsonl`, `more.jsonl.gz`, `tokenizer/`, made from the demo
text). A command that needs no GPU, cluster, registry or container runs for real (`train
prepare-data`, `make_demo_corpus.py`, a hook's `--help`/`--dry-run`). One that does, or that would
train for long, runs as a dry run: `primus-cli --dry-run ...`, the trainer's `pretrain --dry-run`,
`images/build.sh ... --dry-run`; a dry run of `primus-cli ... train pretrain` stands for the
machine its config is written for (NODE_FOR_CONFIGS). Every one must exit 0.

Placeholders become real values (PLACEHOLDERS; `...` after `train pretrain` is the seed job, SEED;
`[...]` is optional and dropped). Commands that are not run are in EXEMPT with the reason. A
command that matches no rule fails the test: add a rule, or show the block as ```text.
"""

from __future__ import annotations

import gzip
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
MOCK = "examples/megatron/configs/cpu/moe_tiny-mock-pretrain.yaml"
SEED = (
    "--config", "examples/megatron/configs/MI355X/deepseek_v3-BF16-pretrain.yaml",
    "--num_layers", "4", "--micro_batch_size", "2", "--global_batch_size", "1024",
    "--tensor_model_parallel_size", "1", "--pipeline_model_parallel_size", "1", "--expert_model_parallel_size", "8",
    "--moe_layer_freq", "1", "--moe_shared_expert_intermediate_size", "None", "--pipeline_model_parallel_layout", "null",
    "--recompute_granularity", "null", "--recompute_num_layers", "0", "--recompute_layer_ids", "null",
    "--moe_router_force_load_balancing_type", "uniform", "--enable_primus_turbo", "True", "--use_turbo_mega_moe", "True",
    "--mock_data", "True",
)  # fmt: skip
"""What `...` after `train pretrain` stands for: the seed job (README.md, examples/ep8.sh)."""

PLACEHOLDERS = {
    "<image>": "localhost/megamoe-cpu:latest",
    "<sha>": "0123456789abcdef0123456789abcdef01234567",
    "<sha|branch|tag>": "main",
    "X": MOCK,  # an experiment config
}
EXEMPT = {
    r"^make (demo|test|unit)$": "the demo training / the test suite (minutes): CI runs them",
    r"^make image-cpu\b": "builds an image; it is images/build.sh cpu, run here as a dry run",
    r"^podman run\b": "needs a container runtime and the built image",
    r"^torchrun --nproc_per_node N\b": "a schematic of what primus-cli runs (N, X, [--key value ...])",
    r"hooks/00_rebuild_primus_turbo\.sh$": "clones and builds Primus-Turbo; its --dry-run line is run",
    r"^python -m benchmarks\.": "a GPU benchmark (CUDA; run from the checkout's root)",
    r"^(BENCH=0 TIMELINE=1 ROUTING=uniform )?benchmarks/run_sonic_compare\.sh\b": "installs SonicMoE's carried wheels, then a GPU benchmark",
    r"^MEGAMOE_EP_TRANSPORT=nccl python -m megamoe\.train pretrain \.\.\.$": "an EP>1 job on GPUs: `...` is a multi-rank launch",
}
NODE_FOR_CONFIGS = {
    "examples/megatron/configs/cpu/": {"GPUS_PER_NODE": "2"},  # the demo's 2 CPU ranks
    "examples/megatron/configs/MI355X/": {"HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},  # 8 GPUs
}
"""The machine a dry run of `primus-cli ... train pretrain --config C` stands for, by C's folder,
unless the command sets GPUS_PER_NODE or --gpus-per-node itself."""


@dataclass(frozen=True)
class DocCommand:
    where: str
    """`docs/training.md:23`: the block's first line."""
    words: tuple[str, ...]
    """As the shell reads it: continuation lines joined, comments dropped, quotes removed."""

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass(kw_only=True)
class Run:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    dry: bool = False


def _blocks() -> list[tuple[str, list[DocCommand]]]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
            where = f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
            joined = re.sub(r"\\\n\s*", " ", m.group(1))
            commands = []
            for line in joined.splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    commands.append(DocCommand(where=where, words=tuple(words)))
            out.append((where, commands))
    return out


def _fill(words: list[str]) -> list[str]:
    """Placeholders to values; `[...]` dropped; `...` = the rest (a config where one is needed)."""
    out: list[str] = []
    optional = 0
    for word in words:
        optional += word.startswith("[")
        if not optional:
            out.append(PLACEHOLDERS.get(word, word))
        optional -= word.endswith("]")
    if "..." in out:  # `--config ...`, `train pretrain ...`, `--config C --key v ...`
        at = out.index("...")
        given = "--config" in out[:at]
        start = at - 1 if out[at - 1] == "--config" else at
        out[start : at + 1] = SEED[2:] if given and start == at else SEED
    return out


def plan(cmd: DocCommand) -> Run | str:
    """How the test runs `cmd`, or why it does not (the EXEMPT reason)."""
    for pattern, reason in EXEMPT.items():
        if re.search(pattern, cmd.text):
            return reason
    words = list(cmd.words)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = PLACEHOLDERS.get(value, value)
    words = _fill(words)
    prog, args = words[0], words[1:]
    if prog == "primus-cli":
        dry = "--dry-run" in args or any(w in args for w in ("slurm", "container", "pretrain"))
        if dry and "--dry-run" not in args:
            args.insert(0, "--dry-run")
        node = {}
        if "pretrain" in args and "GPUS_PER_NODE" not in env and "--gpus-per-node" not in args:
            config = args[args.index("--config") + 1]
            node = next(v for folder, v in NODE_FOR_CONFIGS.items() if config.startswith(folder))
        return Run(argv=[str(BIN / "primus-cli"), *args], env={**node, **env}, dry=dry)
    if prog in ("python", "python3") and args[:2] == ["-m", "megamoe.train"]:
        if args[2] == "pretrain" and "--dry-run" not in args:
            args.insert(3, "--dry-run")
        return Run(argv=[sys.executable, *args], env=env, dry=args[2] == "pretrain")
    if prog in ("python", "python3") and args[:1] == ["examples/data/make_demo_corpus.py"]:
        return Run(argv=[sys.executable, *args], env=env)
    if prog == "images/build.sh":
        if "--dry-run" not in args:
            args.insert(args.index("--") if "--" in args else len(args), "--dry-run")
        return Run(argv=[prog, *args], env=env, dry=True)
    if prog == "hooks/00_rebuild_primus_turbo.sh" and {"--dry-run", "--help"} & set(args):
        return Run(argv=[prog, *args], env=env)
    raise AssertionError(f"{cmd.where}: no rule runs `{cmd.text}`: add one to tests/test_docs_commands.py")


BLOCKS = _blocks()


def _slow(commands: list[DocCommand]) -> bool:
    """A real data preparation imports torch and tokenizes (about 10 s on 2 cores)."""
    for cmd in commands:
        try:
            how = plan(cmd)
        except AssertionError:  # reported by test_docs_every_command_has_a_rule
            continue
        if isinstance(how, Run) and not how.dry and "prepare-data" in how.argv:
            return True
    return False


def _marks(commands: list[DocCommand]) -> list[pytest.MarkDecorator]:
    return [pytest.mark.slow] if _slow(commands) else []


# --------------------------------------------------------------------------- the docs' world


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`output/data` as `make demo` leaves it: the corpus, its tokenizer and the tokenized pair."""
    data = tmp_path_factory.mktemp("docs") / "output" / "data"
    env = _env({})
    subprocess.run([sys.executable, str(ROOT / "examples/data/make_demo_corpus.py"), "--output", str(data),
                    "--vocab-size", "2048"], env=env, check=True, capture_output=True)  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "megamoe.train", "prepare-data", "--input", str(data / "corpus.jsonl"),
         "--output-prefix", str(data / "pydoc"), "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", str(data / "tokenizer"), "--json-keys", "text", "--append-eod", "--workers", "1"],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    return data


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "MASTER_", "PRIMUS_", "REBUILD_"))
        and k not in ("GPUS_PER_NODE", "NNODES", "NODE_RANK")
    }
    env.update(
        {
            "PATH": f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}",
            "TORCHDYNAMO_DISABLE": "1",
            "OMP_NUM_THREADS": "1",
        }
    )
    return {**env, **extra}


@pytest.fixture
def checkout_copy(tmp_path: Path, demo_data: Path) -> Path:
    """The checkout's entries symlinked into tmp, plus the docs' data and the user's own files."""
    for entry in ROOT.iterdir():
        if entry.name not in ("output", "logs", "data", "workspace", ".git"):
            (tmp_path / entry.name).symlink_to(entry)
    shutil.copytree(demo_data, tmp_path / "output" / "data")
    shutil.copy(demo_data / "corpus.jsonl", tmp_path / "corpus.jsonl")
    shutil.copytree(demo_data / "tokenizer", tmp_path / "tokenizer")
    lines = (demo_data / "corpus.jsonl").read_text().splitlines(keepends=True)[:200]
    with gzip.open(tmp_path / "more.jsonl.gz", "wt") as f:
        f.writelines(lines)
    return tmp_path


@pytest.mark.parametrize(
    "commands",
    [pytest.param(c, id=w, marks=_marks(c)) for w, c in BLOCKS],
)
@pytest.mark.timeout(300)
def test_docs_bash_block_runs_as_written(commands: list[DocCommand], checkout_copy: Path) -> None:
    for cmd in commands:
        how = plan(cmd)
        if isinstance(how, str):
            continue
        res = subprocess.run(how.argv, cwd=checkout_copy, env=_env(how.env), capture_output=True, text=True,
                             timeout=240, check=False)  # fmt: skip
        last = (res.stderr.strip() or res.stdout.strip() or "(no output)").splitlines()[-1]
        assert res.returncode == 0, f"{cmd.where}: `{cmd.text}` exited {res.returncode}: {last}"


def test_docs_every_command_has_a_rule_and_every_exemption_is_used() -> None:
    assert BLOCKS, "no ```bash block found"
    used = {how for _, commands in BLOCKS for c in commands if isinstance(how := plan(c), str)}
    assert used == set(EXEMPT.values()), f"unused exemptions: {set(EXEMPT.values()) - used}"
