#!/usr/bin/env bash
# primus-hook: dry-run-ok
#
# Build Primus-Turbo at PRIMUS_TURBO_REF into a node-local dir before training (REBUILD_PRIMUS_TURBO=1).
# Runs on every node through primus-cli's hook engine, or alone:
#   REBUILD_PRIMUS_TURBO=1 PRIMUS_TURBO_REF=<sha|branch|tag> GPU_ARCHS=gfx950 hooks/00_rebuild_primus_turbo.sh
#   hooks/00_rebuild_primus_turbo.sh --dry-run        # says what it would do, changes nothing
# Settings: REBUILD_PRIMUS_TURBO, PRIMUS_TURBO_REPO_URL, PRIMUS_TURBO_REF, GPU_ARCHS, PRIMUS_TURBO_BUILD_DIR,
# PRIMUS_TURBO_ALLOW_OLD, PRIMUS_TURBO_PYTHON and more: docs/images.md, "The Primus-Turbo rebuild hook".
# stdout: env.PYTHONPATH=<install dir>:... and env.PRIMUS_TURBO_{INSTALL_DIR,COMMIT,WHEEL}; progress: stderr.
set -euo pipefail

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment block above is the help
  while IFS= read -r line && [[ "$line" == "#"* ]]; do
    [[ "$line" == "#!"* || "$line" == *"primus-hook:"* || "$line" == "#" ]] || printf '%s\n' "${line#"# "}"
  done < "${BASH_SOURCE[0]}"
  exit 0
fi

case "${REBUILD_PRIMUS_TURBO:-}" in
  1) ;;
  "" | 0) exit 0 ;;  # off: nothing to do, not even starting Python
  *)
    echo "[primus-turbo] error: REBUILD_PRIMUS_TURBO=${REBUILD_PRIMUS_TURBO}: expected 0 or 1." \
      "Set REBUILD_PRIMUS_TURBO=1 to rebuild Primus-Turbo, unset it to skip." >&2
    exit 2
    ;;
esac

# Build with the interpreter that runs training: the stamp records its Python and torch.
python="${PRIMUS_TURBO_PYTHON:-${PRIMUS_PYTHON:-}}"
if [[ -z "$python" ]]; then
  python="$(command -v python3 || command -v python || true)"
fi
if [[ -z "$python" ]] || ! command -v "$python" >/dev/null; then
  echo "[primus-turbo] error: PRIMUS_TURBO_PYTHON=${python}: no Python interpreter found." \
    "Set PRIMUS_TURBO_PYTHON to the python that runs training." >&2
  exit 2
fi
here="${BASH_SOURCE[0]%/*}"  # no dirname: minimal images may lack coreutils
[[ "$here" == "${BASH_SOURCE[0]}" ]] && here=.
exec "$python" "$here/lib/primus_turbo_rebuild.py" "$@"
