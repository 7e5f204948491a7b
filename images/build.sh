#!/usr/bin/env bash
# Build a MegaMoE image with podman or docker:  images/build.sh {cpu|cuda|rocm} [--dry-run] [-- <build args>]
#
#   cpu   small Python base + CPU torch; runs the embedded demo (`make image-cpu`). Installs only from a
#         wheelhouse made here on the host, so the build itself needs no network or registry.
#   cuda  NVIDIA PyTorch base + this package with Triton (pip reaches PyPI from inside the build).
#   rocm  rocm/primus base + Primus-Turbo built at a pinned ref by hooks/00_rebuild_primus_turbo.sh.
#
# Environment (all optional):
#   CONTAINER_RUNTIME  podman | docker (default: podman if installed, else docker)
#   IMAGE              tag to build (default localhost/megamoe-<kind>:latest)
#   BASE_IMAGE         passed as --build-arg BASE_IMAGE (each Dockerfile has its own default)
#   PYTHON             the host Python that builds the wheels (default .venv/bin/python, else python3);
#                      for cpu its major.minor must match the base image's python3
#   TORCH_VERSION      cpu: the CPU torch put in the wheelhouse (default 2.13.0)
#   PRIMUS_TURBO_REF, PRIMUS_TURBO_REPO_URL, GPU_ARCHS   rocm: passed as build args when set
# Everything after `--` goes to `<runtime> build` unchanged (e.g. -- --network host --no-cache).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[images] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

kind="${1:-}"
case "$kind" in
  cpu | cuda | rocm) shift ;;
  -h | --help | "") sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; [ -n "$kind" ]; exit $? ;;
  *) die "kind=$kind: not an image of this repo. Use one of: cpu, cuda, rocm" ;;
esac
dry_run=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --) shift; extra=("$@"); break ;;
    *) die "argument $1: unknown. Put build options after --, e.g. images/build.sh $kind -- --no-cache" ;;
  esac
  shift
done

runtime="${CONTAINER_RUNTIME:-}"
if [ -z "$runtime" ]; then
  if command -v podman >/dev/null; then runtime=podman; elif command -v docker >/dev/null; then runtime=docker; fi
fi
case "$runtime" in
  podman | docker) ;;
  "") [ "$dry_run" = 1 ] || die "no container runtime: install podman or docker (or set CONTAINER_RUNTIME)"
      runtime=docker; log "warning: no podman or docker here; showing docker" ;;
  *) die "CONTAINER_RUNTIME=$runtime: expected podman or docker" ;;
esac
command -v "$runtime" >/dev/null || [ "$dry_run" = 1 ] ||
  die "CONTAINER_RUNTIME=$runtime: not installed. Install it or pick the other"
python="${PYTHON:-}"
[ -n "$python" ] || { [ -x "$ROOT/.venv/bin/python" ] && python="$ROOT/.venv/bin/python"; } || python="$(command -v python3)"
image="${IMAGE:-localhost/megamoe-$kind:latest}"
ctx="$ROOT/build/images/$kind"

run() {  # print, then run unless --dry-run
  printf '+ %s\n' "$*" >&2
  [ "$dry_run" = 1 ] || "$@"
}

build_args=()
[ -n "${BASE_IMAGE:-}" ] && build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
if [ "$kind" = rocm ]; then
  for name in PRIMUS_TURBO_REF PRIMUS_TURBO_REPO_URL GPU_ARCHS; do
    [ -n "${!name:-}" ] && build_args+=(--build-arg "$name=${!name}")
  done
  case "${PRIMUS_TURBO_REPO_URL:-}" in
    *://*@*) die "PRIMUS_TURBO_REPO_URL: has credentials; a build arg is stored in the image history. Use a URL without them" ;;
  esac
fi

t0=$SECONDS
if [ "$kind" = cpu ] && [ "$dry_run" = 0 ]; then  # before any work: the wheelhouse is for one Python
  host_py="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  base="${BASE_IMAGE:-$(sed -n 's/^ARG BASE_IMAGE=//p' "$ROOT/images/cpu/Dockerfile")}"
  image_py="$("$runtime" run --rm "$base" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ||
    die "BASE_IMAGE=$base: could not run python3 in it. Pull or build that image first"
  [ "$host_py" = "$image_py" ] ||
    die "PYTHON=$python: is Python $host_py but $base has $image_py; the wheelhouse must match. Set PYTHON to a $image_py interpreter"
fi
log "context $ctx"
run rm -rf "$ctx"
run mkdir -p "$ctx/wheels"
run cp "$ROOT/images/$kind/Dockerfile" "$ROOT/images/$kind/primus.yaml" "$ctx/"
run cp -r "$ROOT/hooks" "$ROOT/examples" "$ctx/"
# This package as a wheel: the image gets what `pip install .` installs, not the whole work tree.
run "$python" -m pip wheel --quiet --no-deps --wheel-dir "$ctx/wheels" "$ROOT"
if [ "$kind" = cpu ]; then
  torch="torch==${TORCH_VERSION:-2.13.0}"
  # The wheelhouse: every dependency as a wheel for the image's Python. Uses the host's pip config:
  # on a host without local CPU wheels, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
  # so `torch==X` resolves to the CPU build (X+cpu sorts above the PyPI CUDA build).
  log "wheelhouse: this package + $torch (host pip config decides where they come from)"
  run "$python" -m pip wheel --quiet --wheel-dir "$ctx/wheels" --find-links "$ctx/wheels" "$torch" pip \
    "$ctx/wheels/megamoe-"*.whl
fi
run "$runtime" build --tag "$image" --file "$ctx/Dockerfile" "${build_args[@]}" "${extra[@]}" "$ctx"
if [ "$kind" = cpu ]; then  # the install stage (1+ GB of wheels and venv) is not needed once built
  run "$runtime" image prune --force --filter label=megamoe.stage=install >/dev/null
fi
[ "$dry_run" = 1 ] || log "built $image with $runtime in $((SECONDS - t0)) s"
