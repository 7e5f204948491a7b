#!/usr/bin/env bash
# `make integration-infra`: start what the slurm/container tests need, idempotently.
#   * Slurm: munged + slurmctld + 2 slurmd (fake nodes node1, node2) on localhost  (slurm_local.sh)
#   * podman with runc + the base image localhost/megamoe-base:ci                  (containers.sh)
# Already running / already built parts are only re-checked (well under a second). Writes
# $MEGAMOE_INFRA_DIR/env (SLURM_CONF=..., CONTAINERS_CONF=...), which tests/conftest.py reads.
#   setup.sh [all|slurm|containers|down]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${MEGAMOE_INFRA_DIR:-/tmp/megamoe-infra}"
what="${1:-all}"
if [ "$(id -u)" != 0 ]; then
  echo "[infra] needs root (apt-get, daemons); run: sudo $0 $what" >&2
  exit 1
fi
mkdir -p "$DIR"
t0=$SECONDS
case "$what" in
  all) "$HERE/slurm_local.sh" up; "$HERE/containers.sh" up ;;
  slurm) "$HERE/slurm_local.sh" up ;;
  containers) "$HERE/containers.sh" up ;;
  down) "$HERE/slurm_local.sh" down; exit 0 ;;
  *) echo "usage: $0 [all|slurm|containers|down]" >&2; exit 2 ;;
esac
{ "$HERE/slurm_local.sh" env; "$HERE/containers.sh" env; } > "$DIR/env"
echo "[infra] ready in $((SECONDS - t0)) s: $(tr '\n' ' ' < "$DIR/env")" >&2
