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
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator

from turbo_common import HookError, failure_report, on_signal, redact, run, say, setting_error
from turbo_git import SHA_RE, check_minimum, checkout, resolve_local, sync_clone
from turbo_settings import Settings, flag, read_settings

STAMP_NAME = ".primus_turbo_build.json"


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


# --------------------------------------------------------------------------------------- build + install


def clean_pythonpath(value: str, build_dir: str) -> list:
    """PYTHONPATH entries minus our own installs (an older build must not shadow the new one)."""
    prefix = os.path.join(build_dir, "")
    return [p for p in value.split(os.pathsep) if p and not os.path.abspath(p).startswith(prefix)]


def build_env(s: Settings) -> dict:
    # Same interpreter and site dirs as training (torch may live in the user site), plus GPU_ARCHS.
    env = dict(os.environ, GPU_ARCHS=";".join(s.gpu_archs))
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
    env = dict(os.environ, PYTHONPATH=target)
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
    fetch = "" if SHA_RE.match(s.ref) and commit == s.ref else " (after a fetch it may move)"
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


def main(argv: list) -> int:
    args = list(argv)
    dry_run = os.environ.get("PRIMUS_DRY_RUN", "") not in ("", "0")
    if args and args[0] == "--dry-run":
        dry_run = True
        args.pop(0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        if not flag(os.environ, "REBUILD_PRIMUS_TURBO"):
            return 0
        settings = read_settings(dict(os.environ), dry_run)
        if shutil.which("git") is None:
            raise HookError(
                "git is not installed here, and the rebuild fetches Primus-Turbo with it. Install git "
                "in this environment (image), or unset REBUILD_PRIMUS_TURBO to use the installed Primus-Turbo",
                code=2,
            )
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
