"""Build Primus-Turbo at a pinned ref into a node-local directory: the body of the rebuild hook.

`hooks/00_rebuild_primus_turbo.sh` runs this file with the interpreter that will run training, so
the build stamp records the right Python and torch. It fixes what the original Primus hook got
wrong (it deleted and re-cloned on every run, had no lock, never synced submodules, and
uninstalled the working Primus-Turbo before building the new one):

* one clone per build dir, fetched into; checkout, then a recursive submodule sync;
* an exclusive lock on the build dir, so concurrent jobs on a node build once;
* one install dir per (commit, GPU archs, Python, torch), recorded in a build stamp, so a repeat
  run is a cache hit and switching refs back and forth never rebuilds;
* a wheel is built first and installed into a fresh dir that is renamed into place only after an
  import check, so a failed or interrupted build leaves the previous install untouched;
* the training sees the build through ``env.PYTHONPATH=<install dir>:...`` (hook protocol); the
  environment's site-packages are never changed.

Standard library only, Python >= 3.8: it runs inside arbitrary training images.
Progress goes to stderr, prefixed ``[primus-turbo]``; stdout carries only ``env.K=V`` lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import NoReturn

DEFAULT_REPO_URL = "https://github.com/AMD-AGI/Primus-Turbo.git"
# The oldest Primus-Turbo commit with the MegaMoE op this toolkit drives.
MIN_COMMIT = "9b5d3092efcbc087657b233d8e9ae662cee6ec6b"
DEFAULT_GPU_ARCHS = "gfx950"
STAMP_NAME = ".primus_turbo_build.json"
PACKAGE = "primus_turbo"
LOG_TAIL_LINES = 40

_USERINFO_RE = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_ARCH_RE = re.compile(r"^gfx[0-9a-z]+$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


class HookError(Exception):
    """A failure the user can act on; `code` is the hook's exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def setting_error(name: str, value: str, problem: str, remedy: str) -> HookError:
    """Bad input: ``<SETTING>=<value>: <problem>. <remedy>.`` with exit status 2."""
    return HookError(f"{name}={redact(value)}: {problem}. {remedy.rstrip('.')}.", code=2)


def redact(text: str) -> str:
    """Hide the userinfo of every URL (``https://user:token@host`` -> ``https://***@host``)."""
    return _USERINFO_RE.sub(r"\1***@", text)


def say(message: str) -> None:
    """Progress line on stderr (the launcher shows it; stdout is the hook protocol)."""
    print(f"[primus-turbo] {redact(message)}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The hook's inputs, read once from the environment."""

    repo_url: str
    ref: str
    min_commit: str
    allow_old: bool
    gpu_archs: tuple
    build_dir: str
    lock_timeout_s: float
    keep: int
    install_requirements: bool
    import_check: bool
    progress_s: float
    dry_run: bool

    @property
    def src(self) -> str:
        return os.path.join(self.build_dir, "src")

    @property
    def installs(self) -> str:
        return os.path.join(self.build_dir, "installs")


def _flag(env: dict, name: str) -> bool:
    value = env.get(name, "")
    if value not in ("", "0", "1"):
        raise setting_error(
            name, value, "expected 0 or 1", f"Set {name}=1 to turn it on, unset it to turn it off"
        )
    return value == "1"


def _number(env: dict, name: str, default: float, minimum: float) -> float:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise setting_error(name, raw, f"expected a number >= {minimum:g}", f"Unset {name} for {default:g}")
    return value


def parse_archs(raw: str) -> tuple:
    """``"gfx950; gfx942;gfx950"`` -> ``("gfx942", "gfx950")``: sorted and unique, so order never rebuilds."""
    archs = sorted({a.strip() for a in raw.split(";") if a.strip()})
    bad = [a for a in archs if not _ARCH_RE.match(a)]
    if not archs or bad:
        raise setting_error(
            "GPU_ARCHS",
            raw,
            f"not a ;-separated list of AMD GPU architectures (bad: {', '.join(bad) or 'empty'})",
            'Use e.g. GPU_ARCHS="gfx950" or GPU_ARCHS="gfx942;gfx950"',
        )
    return tuple(archs)


def read_settings(env: dict, dry_run: bool) -> Settings:
    """Settings from the environment, each checked with a message that names it."""
    host = env.get("HOSTNAME") or socket.gethostname()
    repo_url = env.get("PRIMUS_TURBO_REPO_URL") or DEFAULT_REPO_URL
    min_commit = env.get("PRIMUS_TURBO_MIN_COMMIT") or MIN_COMMIT
    ref = env.get("PRIMUS_TURBO_REF") or min_commit
    for name, value in (("PRIMUS_TURBO_REPO_URL", repo_url), ("PRIMUS_TURBO_REF", ref)):
        if value.startswith("-") or any(c.isspace() for c in value):
            raise setting_error(name, value, "must not start with '-' or contain spaces", "Check the value")
    if not re.match(r"^[0-9a-f]{7,40}$", min_commit):
        raise setting_error("PRIMUS_TURBO_MIN_COMMIT", min_commit, "not a commit sha", "Unset it")
    build_dir = os.path.abspath(env.get("PRIMUS_TURBO_BUILD_DIR") or f"/tmp/primus_turbo_{host}")
    return Settings(
        repo_url=repo_url,
        ref=ref,
        min_commit=min_commit,
        allow_old=_flag(env, "PRIMUS_TURBO_ALLOW_OLD"),
        gpu_archs=parse_archs(env.get("GPU_ARCHS") or DEFAULT_GPU_ARCHS),
        build_dir=build_dir,
        lock_timeout_s=_number(env, "PRIMUS_TURBO_LOCK_TIMEOUT", 3000.0, 0.0),
        keep=int(_number(env, "PRIMUS_TURBO_KEEP", 3, 1)),
        install_requirements=_flag(env, "PRIMUS_TURBO_INSTALL_REQUIREMENTS"),
        import_check=_flag(env, "PRIMUS_TURBO_IMPORT_CHECK") or not env.get("PRIMUS_TURBO_IMPORT_CHECK"),
        progress_s=_number(env, "PRIMUS_TURBO_PROGRESS_S", 30.0, 0.1),
        dry_run=dry_run,
    )


# --------------------------------------------------------------------------------------- processes

_children: set[subprocess.Popen] = set()


def _on_signal(signum: int, _frame: object) -> NoReturn:
    """Stop the build's process group, then unwind so `finally` blocks remove partial dirs."""
    for child in list(_children):
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGTERM)
    raise HookError(f"interrupted by signal {signum}; the previous install is untouched", 128 + signum)


def run(
    argv: list,
    *,
    cwd: str | None = None,
    env: dict | None = None,
    log=None,
    heartbeat: str = "",
    every_s: float = 30.0,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run argv in its own process group, stdout+stderr redacted into `log` (or captured).

    With `heartbeat`, prints "<heartbeat> <elapsed>: <last log line>" every `every_s` seconds so a
    ten-minute compile shows it is alive.
    """
    child = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
        errors="replace",
    )
    _children.add(child)
    tail: deque = deque(maxlen=LOG_TAIL_LINES)
    captured: list = []
    last = [""]

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            line = redact(line)
            tail.append(line)
            if line.strip():
                last[0] = line.strip()
            if log is not None:
                log.write(line)
                log.flush()
            else:
                captured.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        while True:
            try:
                child.wait(timeout=every_s if heartbeat else None)
                break
            except subprocess.TimeoutExpired:
                say(f"{heartbeat} {time.monotonic() - start:.0f}s: {last[0][:160]}")
        reader.join()
    finally:
        _children.discard(child)
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait()
    output = "".join(captured) if log is None else "".join(tail)
    result = subprocess.CompletedProcess(argv, child.returncode, output, "")
    if check and child.returncode != 0:
        raise subprocess.CalledProcessError(child.returncode, argv, output)
    return result


def git(*args: str, cwd: str | None = None, log=None, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="/bin/true")
    return run(["git", *args], cwd=cwd, env=env, log=log, check=check)


def git_out(*args: str, cwd: str) -> str | None:
    """Output of a read-only git query, or None when it fails (unknown ref, not a repo)."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


# --------------------------------------------------------------------------------------- the build key


def build_key(commit: str, archs: tuple) -> dict:
    """What a build depends on: a change in any of these needs a new build."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # Python 3.7 has no importlib.metadata
        torch_version = "unknown"
    else:
        try:
            torch_version = version("torch")
        except PackageNotFoundError:
            torch_version = "absent"
    return {
        "commit": commit,
        "gpu_archs": ";".join(archs),
        "python": f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}",
        "soabi": sysconfig.get_config_var("SOABI") or "",
        "torch": torch_version,
    }


def install_name(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return f"{key['commit'][:12]}-{digest}"


def read_stamp(install_dir: str) -> dict | None:
    try:
        with open(os.path.join(install_dir, STAMP_NAME)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_cached(install_dir: str, key: dict) -> bool:
    stamp = read_stamp(install_dir)
    return stamp is not None and stamp.get("key") == key


# --------------------------------------------------------------------------------------- git


def resolve_local(s: Settings) -> str | None:
    """The commit the ref names in the local clone, without the network; None if unknown.

    Branches are looked up as remote-tracking refs (we never create local branches), then tags,
    then the ref as a commit.
    """
    if not os.path.isdir(os.path.join(s.src, ".git")):
        return None
    for candidate in (f"refs/remotes/origin/{s.ref}", f"refs/tags/{s.ref}", s.ref):
        sha = git_out("rev-parse", "--verify", "--quiet", f"{candidate}^{{commit}}", cwd=s.src)
        if sha:
            return sha
    return None


def sync_clone(s: Settings, log) -> str:
    """Clone once, then fetch into the clone; return the commit the ref names."""
    if not os.path.isdir(os.path.join(s.src, ".git")) or git_out("rev-parse", "--git-dir", cwd=s.src) is None:
        shutil.rmtree(s.src, ignore_errors=True)
        partial = tempfile.mkdtemp(prefix="src.partial-", dir=s.build_dir)
        say(f"cloning {s.repo_url}")
        try:
            git("clone", "--no-checkout", "--quiet", s.repo_url, partial, log=log)
            os.rename(partial, s.src)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    elif git_out("remote", "get-url", "origin", cwd=s.src) != s.repo_url:
        say(f"origin is now {s.repo_url}")
        git("remote", "set-url", "origin", s.repo_url, cwd=s.src, log=log)
    if _SHA_RE.match(s.ref) and resolve_local(s) == s.ref:
        return s.ref  # a full sha already here: nothing to fetch
    say(f"fetching {s.repo_url}")
    git(
        "fetch",
        "--quiet",
        "--prune",
        "--tags",
        "--force",
        "origin",
        "+refs/heads/*:refs/remotes/origin/*",
        cwd=s.src,
        log=log,
    )
    commit = resolve_local(s)
    # A commit no branch or tag points to (a PR head, say): ask for it by name.
    if (
        commit is None
        and re.match(r"^[0-9a-f]{7,40}$", s.ref)
        and git("fetch", "--quiet", "origin", s.ref, cwd=s.src, log=log, check=False).returncode == 0
    ):
        commit = git_out("rev-parse", "--verify", "--quiet", "FETCH_HEAD^{commit}", cwd=s.src)
    if commit is None:
        raise setting_error(
            "PRIMUS_TURBO_REF",
            s.ref,
            f"no branch, tag or commit of that name in {s.repo_url}",
            "Check the name, or set PRIMUS_TURBO_REPO_URL to the repository that has it",
        )
    return commit


def check_minimum(s: Settings, commit: str) -> None:
    """Refuse a ref that predates the MegaMoE op (unless PRIMUS_TURBO_ALLOW_OLD=1)."""
    done = subprocess.run(
        ["git", "merge-base", "--is-ancestor", s.min_commit, commit],
        cwd=s.src,
        capture_output=True,
        text=True,
    )
    if done.returncode == 0:
        return
    if done.returncode == 1:
        problem = f"commit {commit[:12]} does not contain the minimum commit {s.min_commit[:12]} (MegaMoE)"
    else:
        problem = f"the minimum commit {s.min_commit[:12]} (MegaMoE) is not in {s.repo_url}"
    if s.allow_old:
        say(f"warning: {problem}; building anyway because PRIMUS_TURBO_ALLOW_OLD=1")
        return
    raise setting_error(
        "PRIMUS_TURBO_REF",
        s.ref,
        problem,
        "Use a newer ref, or set PRIMUS_TURBO_ALLOW_OLD=1 to build it anyway",
    )


def checkout(s: Settings, commit: str, log) -> None:
    """Check out the commit, drop stale build output, then bring every submodule to its pinned commit."""
    say(f"checking out {commit[:12]} and syncing submodules")
    git("checkout", "--quiet", "--force", "--detach", commit, cwd=s.src, log=log)
    git("clean", "-ffdxq", cwd=s.src, log=log)
    git("submodule", "sync", "--quiet", "--recursive", cwd=s.src, log=log)
    git("submodule", "update", "--init", "--recursive", "--force", "--quiet", cwd=s.src, log=log)
    git("submodule", "foreach", "--quiet", "--recursive", "git clean -ffdxq", cwd=s.src, log=log)


# --------------------------------------------------------------------------------------- build + install


def clean_pythonpath(value: str, build_dir: str) -> list:
    """PYTHONPATH entries minus our own installs (an older build must not shadow the new one)."""
    prefix = os.path.join(build_dir, "")
    return [p for p in value.split(os.pathsep) if p and not os.path.abspath(p).startswith(prefix)]


def build_env(s: Settings) -> dict:
    env = dict(os.environ, GPU_ARCHS=";".join(s.gpu_archs), PYTHONNOUSERSITE="1")
    # The checkout goes first: an installed Primus-Turbo ships a top-level `tools` package that
    # would shadow the checkout's `tools.build_utils` (Primus PR #934 uninstalled it instead).
    env["PYTHONPATH"] = os.pathsep.join([s.src, *clean_pythonpath(env.get("PYTHONPATH", ""), s.build_dir)])
    return env


def build_and_install(s: Settings, key: dict, install_dir: str, log, log_path: str) -> str:
    """Wheel, then a fresh install dir, an import check, and a rename into place; returns the wheel."""
    env = build_env(s)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    if s.install_requirements and os.path.exists(os.path.join(s.src, "requirements.txt")):
        say("installing requirements.txt into the environment (PRIMUS_TURBO_INSTALL_REQUIREMENTS=1)")
        run(
            [*pip, "install", "-r", "requirements.txt"],
            cwd=s.src,
            env=env,
            log=log,
            heartbeat="requirements",
            every_s=s.progress_s,
        )
    wheels_tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.join(s.build_dir, "wheels"))
    target_tmp = tempfile.mkdtemp(prefix=".tmp-", dir=s.installs)
    try:
        say(f"building wheel for GPU_ARCHS={key['gpu_archs']} (log: {log_path})")
        start = time.monotonic()
        run(
            [
                *pip,
                "wheel",
                "--verbose",
                "--no-deps",
                "--no-build-isolation",
                "--wheel-dir",
                wheels_tmp,
                s.src,
            ],
            cwd=s.src,
            env=env,
            log=log,
            heartbeat="building",
            every_s=s.progress_s,
        )
        wheels = [w for w in os.listdir(wheels_tmp) if w.endswith(".whl")]
        if len(wheels) != 1:
            raise HookError(f"expected one wheel from the build, got {wheels or 'none'}")
        say(f"built {wheels[0]} in {time.monotonic() - start:.0f}s; installing into {install_dir}")
        run(
            [
                *pip,
                "install",
                "--no-deps",
                "--no-index",
                "--no-compile",
                "--target",
                target_tmp,
                os.path.join(wheels_tmp, wheels[0]),
            ],
            cwd=s.build_dir,
            env=env,
            log=log,
        )
        if s.import_check:
            check_import(target_tmp, log)
        else:
            say("skipping the import check (PRIMUS_TURBO_IMPORT_CHECK=0)")
        wheel_dir = os.path.join(s.build_dir, "wheels", os.path.basename(install_dir))
        shutil.rmtree(wheel_dir, ignore_errors=True)
        os.rename(wheels_tmp, wheel_dir)
        stamp = {
            "key": key,
            "wheel": os.path.join(wheel_dir, wheels[0]),
            "log": log_path,
            "repo_url": redact(s.repo_url),
            "ref": s.ref,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(os.path.join(target_tmp, STAMP_NAME), "w") as f:
            json.dump(stamp, f, indent=2, sort_keys=True)
        shutil.rmtree(install_dir, ignore_errors=True)  # only ever a dir without a matching stamp
        os.rename(target_tmp, install_dir)
        return stamp["wheel"]
    finally:
        shutil.rmtree(wheels_tmp, ignore_errors=True)
        shutil.rmtree(target_tmp, ignore_errors=True)


def check_import(target: str, log) -> None:
    """Import the new build from its own dir (not the checkout, not site-packages) before using it."""
    probe = (
        "import os, sys, primus_turbo as p; f = os.path.realpath(p.__file__); "
        "t = os.path.realpath(sys.argv[1]); "
        "sys.exit(0 if f.startswith(t + os.sep) else 'primus_turbo imported from ' + f + ', not the new build')"
    )
    env = dict(os.environ, PYTHONPATH=target, PYTHONNOUSERSITE="1")
    run([sys.executable, "-c", probe, target], cwd=target, env=env, log=log)


def point_link(s: Settings, name: str, target: str) -> None:
    """Point <build_dir>/<name> at target atomically (rename over it): `current`, `build.log`."""
    tmp = os.path.join(s.build_dir, f".{name}-{os.getpid()}")
    os.symlink(os.path.relpath(target, s.build_dir), tmp)
    os.replace(tmp, os.path.join(s.build_dir, name))


def prune(s: Settings, keep_dir: str) -> None:
    """Keep the newest `keep` installs (a running job may still import an older one)."""
    dirs = [os.path.join(s.installs, d) for d in os.listdir(s.installs) if not d.startswith(".")]
    dirs.sort(key=lambda d: os.stat(d).st_mtime, reverse=True)
    for old in [d for d in dirs if d != keep_dir][s.keep - 1 :]:
        say(f"removing old install {os.path.basename(old)} (PRIMUS_TURBO_KEEP={s.keep})")
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(os.path.join(s.build_dir, "wheels", os.path.basename(old)), ignore_errors=True)


def prune_logs(s: Settings, keep: int = 20) -> None:
    """Keep the newest `keep` build logs."""
    logs_dir = os.path.join(s.build_dir, "logs")
    logs = sorted(os.listdir(logs_dir), reverse=True)  # names start with a timestamp
    for name in logs[keep:]:
        os.unlink(os.path.join(logs_dir, name))


def remove_leftovers(s: Settings) -> None:
    """Partial dirs of a run that was killed (SIGKILL skips `finally`); called under the lock."""
    for parent, prefix in (
        (s.build_dir, "src.partial-"),
        (s.installs, ".tmp-"),
        (os.path.join(s.build_dir, "wheels"), ".tmp-"),
        (s.build_dir, ".current-"),
        (s.build_dir, ".build.log-"),
    ):
        for name in os.listdir(parent):
            if name.startswith(prefix):
                path = os.path.join(parent, name)
                if os.path.islink(path) or not os.path.isdir(path):
                    os.unlink(path)
                else:
                    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------- lock


@contextlib.contextmanager
def build_lock(s: Settings) -> Iterator[None]:
    """Exclusive flock on <build_dir>/.lock, waiting up to PRIMUS_TURBO_LOCK_TIMEOUT seconds.

    flock dies with the process, so a killed build never leaves the dir locked.
    """
    path = os.path.join(s.build_dir, ".lock")
    with open(path, "a+") as handle:
        deadline = time.monotonic() + s.lock_timeout_s
        told = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if not told:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                say(f"waiting for the build already running in {s.build_dir} ({holder})")
                told = True
            if time.monotonic() > deadline:
                raise setting_error(
                    "PRIMUS_TURBO_LOCK_TIMEOUT",
                    f"{s.lock_timeout_s:g}",
                    f"{path} is still locked by another build",
                    "Wait for it, or raise the timeout",
                )
            time.sleep(0.2)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n")
        handle.flush()
        yield


# --------------------------------------------------------------------------------------- entry points


def exports(s: Settings, install_dir: str, commit: str, wheel: str) -> list:
    """The hook-protocol lines: the new build first on PYTHONPATH, plus what was built."""
    path = os.pathsep.join([install_dir, *clean_pythonpath(os.environ.get("PYTHONPATH", ""), s.build_dir)])
    return [
        f"env.PYTHONPATH={path}",
        f"env.PRIMUS_TURBO_INSTALL_DIR={install_dir}",
        f"env.PRIMUS_TURBO_COMMIT={commit}",
        f"env.PRIMUS_TURBO_WHEEL={wheel}",
    ]


def describe(s: Settings) -> None:
    """--dry-run: say what a real run would do, from what is on disk now; change nothing."""
    say(f"dry run: REBUILD_PRIMUS_TURBO=1, PRIMUS_TURBO_REF={s.ref}, GPU_ARCHS={';'.join(s.gpu_archs)}")
    say(f"dry run: repository {s.repo_url}, build dir {s.build_dir}")
    commit = resolve_local(s)
    if commit is None:
        action = "clone" if not os.path.isdir(s.src) else "fetch"
        say(
            f"dry run: would {action} the repository and resolve {s.ref}, refuse it unless it contains "
            f"{s.min_commit[:12]}, then build a wheel and install it under {s.installs}"
        )
        say(f"dry run: would export PYTHONPATH=<{s.installs}/<build>>:$PYTHONPATH")
        return
    fetch = "" if _SHA_RE.match(s.ref) and commit == s.ref else " (after a fetch it may move)"
    say(f"dry run: {s.ref} is {commit[:12]} in the local clone{fetch}")
    install_dir = os.path.join(s.installs, install_name(build_key(commit, s.gpu_archs)))
    if is_cached(install_dir, build_key(commit, s.gpu_archs)):
        say(f"dry run: already built; would reuse {install_dir}")
    else:
        say(
            f"dry run: would check out {commit[:12]}, sync submodules, build a wheel, install it into {install_dir}"
        )
    say(f"dry run: would export PYTHONPATH={install_dir}:$PYTHONPATH")


def rebuild(s: Settings) -> list:
    """The real run; returns the hook-protocol lines to print."""
    for d in (
        s.build_dir,
        s.installs,
        os.path.join(s.build_dir, "wheels"),
        os.path.join(s.build_dir, "logs"),
    ):
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise setting_error(
                "PRIMUS_TURBO_BUILD_DIR",
                s.build_dir,
                f"cannot create {d}: {e.strerror}",
                "Point it at a writable node-local directory",
            ) from e
    with build_lock(s):
        remove_leftovers(s)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_path = os.path.join(s.build_dir, "logs", f"build-{stamp}-{os.getpid()}.log")
        built = False
        try:
            with open(log_path, "w") as log:
                log.write(f"# ref {s.ref}, GPU_ARCHS={';'.join(s.gpu_archs)}, python {sys.executable}\n")
                lines, built = build_locked(s, log, log_path)
                return lines
        except subprocess.CalledProcessError as e:
            built = True  # keep the log of a failure
            raise HookError(failure_report(e, log_path)) from e
        except HookError:
            built = True
            raise
        finally:
            if built:
                point_link(s, "build.log", log_path)
                prune_logs(s)
            else:
                os.unlink(log_path)  # a cache hit: nothing worth keeping


def build_locked(s: Settings, log, log_path: str) -> tuple[list, bool]:
    """Under the lock: resolve, refuse old refs, reuse a matching build or make one.

    Returns the hook-protocol lines and whether a build ran.
    """
    commit = sync_clone(s, log)
    check_minimum(s, commit)
    key = build_key(commit, s.gpu_archs)
    install_dir = os.path.join(s.installs, install_name(key))
    cached = is_cached(install_dir, key)
    if cached:
        say(
            f"up to date: {commit[:12]} for {key['gpu_archs']}, {key['python']}, torch {key['torch']} "
            f"is already built in {install_dir}"
        )
        wheel = (read_stamp(install_dir) or {}).get("wheel", "")
        os.utime(install_dir)  # most recently used: pruned last
    else:
        checkout(s, commit, log)
        wheel = build_and_install(s, key, install_dir, log, log_path)
        say(f"installed {commit[:12]} into {install_dir}")
    point_link(s, "current", install_dir)
    prune(s, install_dir)
    return exports(s, install_dir, commit, wheel), not cached


def step_name(argv: list) -> str:
    """`pip wheel`, `git fetch`, `import check`: which step failed, in words."""
    args = [str(a) for a in argv]
    if args[1:3] == ["-m", "pip"]:
        return "pip " + next((a for a in args[3:] if not a.startswith("-")), "")
    if os.path.basename(args[0]) == "git":
        return "git " + args[1]
    return "the import check of the new build" if "-c" in args else os.path.basename(args[0])


def failure_report(e: subprocess.CalledProcessError, log_path: str) -> str:
    tail = (e.output or "").rstrip()
    return (
        f"{step_name(e.cmd)} failed with exit code {e.returncode}; the previous install is untouched.\n"
        f"--- last lines of {log_path} ---\n{tail}\n--- end of log tail ---"
    )


def main(argv: list) -> int:
    args = list(argv)
    dry_run = os.environ.get("PRIMUS_DRY_RUN", "") not in ("", "0")
    if args and args[0] == "--dry-run":
        dry_run = True
        args.pop(0)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        print(
            "See docs/images.md (section 'The Primus-Turbo rebuild hook') for every setting.", file=sys.stderr
        )
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        if not _flag(os.environ, "REBUILD_PRIMUS_TURBO"):
            return 0
        settings = read_settings(dict(os.environ), dry_run)
        if settings.dry_run:
            describe(settings)
            return 0
        lines = rebuild(settings)
    except HookError as e:
        first, _, rest = str(e).partition("\n")
        say(f"error: {first}")
        if rest:
            print(redact(rest), file=sys.stderr, flush=True)
        return e.code
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
