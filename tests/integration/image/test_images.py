"""A real build of the `cpu` image (`make image-cpu`) from a locally made base, and a job inside it.

No registry is reachable in CI, so the base is `localhost/megamoe-base:ci`, which
`tests/integration/infra/setup.sh` assembles from this host's own files, and the image installs
only from the wheelhouse that `images/build.sh` makes on the host. The job then runs through
`primus-cli container` on that image, with the image's Python (not the host venv's).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import BASE_IMAGE
from tests.hooks.rebuild_hook_helpers import GIT_ENV, make_fake_turbo

REPO = Path(__file__).resolve().parents[3]
IMAGE = "localhost/megamoe-cpu:test"
# runc here has no CAP_SYS_RESOURCE: it can set nproc 4096 and nofile up to the hard limit, no more.
_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
_NOFILE = 1048576 if _NOFILE == resource.RLIM_INFINITY else _NOFILE
ULIMITS = [f"nofile={_NOFILE}:{_NOFILE}", "nproc=4096:4096"]

# the build (2-4 min on 2 busy cores) counts against the first test's timeout
pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def cpu_image(container_env: dict[str, str]) -> Iterator[str]:
    """`make image-cpu` with the local base; the image is removed after the module's tests."""
    env = {**container_env, "BASE_IMAGE": BASE_IMAGE, "IMAGE": IMAGE, "CONTAINER_RUNTIME": "podman"}
    start = time.monotonic()
    done = subprocess.run(
        ["make", "--no-print-directory", "image-cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    print(f"make image-cpu: {time.monotonic() - start:.0f}s")
    yield IMAGE
    subprocess.run(["podman", "rmi", "--force", IMAGE], env=container_env, capture_output=True)


def _in_image(env: dict[str, str], image: str, *argv: str) -> str:
    done = subprocess.run(
        ["podman", "run", "--rm", image, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_cpu_image_has_cpu_torch_this_package_and_the_demo(
    cpu_image: str, container_env: dict[str, str]
) -> None:
    probe = (
        "import os, torch, megamoe, runner; "
        "print(torch.__version__, torch.cuda.is_available(), os.path.dirname(megamoe.__file__), os.getcwd())"
    )
    torch_version, cuda, megamoe_dir, cwd = _in_image(container_env, cpu_image, "python", "-c", probe).split()
    assert (torch_version, cuda) == ("2.13.0+cpu", "False")
    assert megamoe_dir.startswith("/opt/megamoe/venv/")
    assert cwd == "/opt/megamoe"
    listing = _in_image(
        container_env, cpu_image, "python", "-c", "import os; print(sorted(os.listdir('/opt/megamoe/hooks')))"
    )
    assert "00_rebuild_primus_turbo.sh" in listing
    inspect = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{json .Config.Cmd}}", cpu_image],
        env=container_env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "examples/megatron/configs/cpu/moe_tiny-mock-pretrain.yaml" in inspect.stdout
    plan = _in_image(container_env, cpu_image, "primus-cli", "--dry-run", "direct", "--", "--script", "x.py")
    assert "00_rebuild_primus_turbo.sh  [dry-run-ok]  (/opt/megamoe/hooks/00_rebuild_primus_turbo.sh)" in plan
    assert "--nproc-per-node 2" in plan  # the image's .primus.yaml: 2 CPU ranks


def test_cpu_image_default_command_runs_the_demo(cpu_image: str, container_env: dict[str, str]) -> None:
    # --network none: torchrun's rendezvous stays on the container's own loopback
    done = subprocess.run(
        ["podman", "run", "--rm", "--network", "none", cpu_image],
        env=container_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "MoELayer replaced by MegaMoE" in out, out[-4000:]


def test_cpu_image_runs_a_job_through_primus_cli_container(
    cpu_image: str, container_env: dict[str, str], tmp_path: Path
) -> None:
    primus_cli = REPO / ".venv" / "bin" / "primus-cli"
    argv = [
        str(primus_cli),
        "container",
        "--image",
        cpu_image,
        "--runtime",
        "podman",
        "--gpu",
        "none",
        "--python",
        "python3",  # the image's venv (first on its PATH), not the host's
        "--ulimit",
        ULIMITS[0],
        "--ulimit",
        ULIMITS[1],
        "--",
        "--gpus-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        "--",
        "--script",
        "tests/integration/image/image_job.py",
    ]
    done = subprocess.run(argv, cwd=REPO, env=container_env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    lines = sorted(line[line.index("image-job") :] for line in out.splitlines() if "image-job rank=" in line)
    assert len(lines) == 2, out[-4000:]
    for rank, line in enumerate(lines):
        assert f"rank={rank} world=2 sum=3 torch=2.13.0+cpu torch_file=/opt/megamoe/venv/" in line
        assert "moe_shape=(4, 8)" in line


def _host_git_mounts() -> list[str]:
    """`-v` flags lending the host's git to the container (the cpu image has none; rocm/primus has).

    git, its helper dir, and the libraries git and the `git submodule` script's tools link against
    (the base image carries only what its Python needs).
    """
    tools = [shutil.which(t) for t in ("git", "sed", "basename", "mkdir", "rm")]
    libs: set[str] = set()
    for tool in filter(None, tools):
        ldd = subprocess.run(["ldd", tool], capture_output=True, text=True, check=True).stdout
        libs |= {line.split("=> ")[1].split()[0] for line in ldd.splitlines() if "=> /" in line}
    git = shutil.which("git") or "git"
    flags = ["-v", f"{git}:{git}:ro", "-v", "/usr/lib/git-core:/usr/lib/git-core:ro"]
    for lib in sorted(libs):
        if not Path(lib).name.startswith(("libc.so", "ld-linux")):
            flags += ["-v", f"{os.path.realpath(lib)}:/usr/lib/x86_64-linux-gnu/{Path(lib).name}:ro"]
    return flags


def test_cpu_image_rebuild_hook_runs_inside_the_container_and_its_build_dir_persists(
    cpu_image: str, container_env: dict[str, str], tmp_path: Path
) -> None:
    turbo = make_fake_turbo(tmp_path / "upstream")
    build_dir = tmp_path / "build"
    env = {
        **container_env,
        **GIT_ENV,
        "REBUILD_PRIMUS_TURBO": "1",
        "PRIMUS_TURBO_REPO_URL": turbo.url,
        "PRIMUS_TURBO_MIN_COMMIT": turbo.minimum,
        "PRIMUS_TURBO_REF": "main",
        "PRIMUS_TURBO_BUILD_DIR": str(build_dir),  # PRIMUS_* crosses into the container by prefix
    }
    argv = [
        str(REPO / ".venv" / "bin" / "primus-cli"),
        "container",
        "--image",
        cpu_image,
        "--runtime",
        "podman",
        "--gpu",
        "none",
        "--python",
        "python3",
        "--ulimit",
        ULIMITS[0],
        "--ulimit",
        ULIMITS[1],
        *_host_git_mounts(),
        "-v",
        f"{tmp_path}:{tmp_path}",  # the upstream and a build dir that outlives each --rm container
        *[
            arg
            for name in ("GIT_CONFIG_COUNT", "GIT_CONFIG_KEY_0", "GIT_CONFIG_VALUE_0")
            for arg in ("-e", name)
        ],
        "--",
        "--log-dir",
        str(tmp_path / "logs"),
        "--",
        "--script",
        "tests/hooks/print_turbo_env.py",
    ]
    runs = [
        subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300) for _ in range(2)
    ]
    for done in runs:
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        assert f"seen primus_turbo.COMMIT={turbo.newer}" in done.stdout
        assert f"seen PRIMUS_TURBO_INSTALL_DIR={build_dir}/installs/" in done.stdout
    assert "[primus-turbo] installed" in runs[0].stderr
    assert "[primus-turbo] up to date" in runs[1].stderr  # built by the image's Python, kept on the host
    stamp = next((build_dir / "installs").glob("*/.primus_turbo_build.json")).read_text()
    assert '"torch": "2.13.0+cpu"' in stamp and '"python": "cpython-3.11"' in stamp


def test_rocm_dockerfile_builds_primus_turbo_with_the_hook(
    cpu_image: str, container_env: dict[str, str], tmp_path: Path
) -> None:
    """images/rocm/Dockerfile on a stand-in base (the cpu image: no registry here) and a fake upstream.

    The image build runs the rebuild hook, installs the wheel into the image's Python and this
    package after it. The stand-in upstream lacks the real minimum commit, hence ALLOW_OLD=1.
    """
    turbo = make_fake_turbo(tmp_path / "upstream")
    (tmp_path / "gitconfig").write_text(
        '[protocol "file"]\n\tallow = always\n'
    )  # the submodule's file:// URL
    image = "localhost/megamoe-rocm:test"
    env = {
        **container_env,
        "BASE_IMAGE": cpu_image,
        "IMAGE": image,
        "CONTAINER_RUNTIME": "podman",
        "PRIMUS_TURBO_REPO_URL": turbo.url,
        "PRIMUS_TURBO_REF": "v0.2.0",
        "GPU_ARCHS": "gfx942;gfx950",
    }
    build_opts = ["--build-arg", "PRIMUS_TURBO_ALLOW_OLD=1", *_host_git_mounts()]
    build_opts += ["-v", f"{tmp_path}:{tmp_path}", "-v", f"{tmp_path / 'gitconfig'}:/root/.gitconfig:ro"]
    try:
        done = subprocess.run(
            ["bash", str(REPO / "images" / "build.sh"), "rocm", "--", *build_opts],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        assert "building anyway because PRIMUS_TURBO_ALLOW_OLD=1" in done.stdout + done.stderr
        probe = "import primus_turbo as p; print(p.COMMIT, p.CK_VERSION, p.GPU_ARCHS, p.__file__)"
        commit, ck, archs, path = _in_image(container_env, image, "python3", "-c", probe).split()
        assert (commit, ck, archs) == (turbo.newer, "ck-v2", "gfx942;gfx950")
        assert "/site-packages/primus_turbo/" in path  # installed into the image's Python: no PYTHONPATH
        labels = subprocess.run(
            ["podman", "image", "inspect", "--format", "{{json .Config.Labels}}", image],
            env=container_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert '"megamoe.primus_turbo.ref":"v0.2.0"' in labels
    finally:
        subprocess.run(["podman", "rmi", "--force", image], env=container_env, capture_output=True)
