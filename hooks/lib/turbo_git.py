"""The rebuild hook's git side: one clone per build dir, fetched into; refs resolved; submodules synced."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

from turbo_common import git, git_out, say, setting_error
from turbo_settings import Settings

SHA_RE = re.compile(r"^[0-9a-f]{40}$")


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
    if SHA_RE.match(s.ref) and resolve_local(s) == s.ref:
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
