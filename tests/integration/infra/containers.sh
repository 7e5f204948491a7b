#!/usr/bin/env bash
# Container runtime + base image for the integration tests (and for images/ to build FROM).
#
#   containers.sh up      install podman + runc if missing, write a containers.conf that works on
#                         this kind of box (runc, cgroupfs, nofile within the hard limit), build
#                         localhost/megamoe-base:ci if it is missing or stale
#   containers.sh image   only (re)build the base image
#   containers.sh env     print CONTAINERS_CONF=...
#
# The base image holds no registry content: a root filesystem assembled from this host's own
# Debian packages (bash, coreutils, libc, libstdc++ and every library the Python needs) plus the
# host's Python 3.11 at its original path, so a venv made from that Python (ours, /work/main/.venv,
# bind-mounted at the same path) runs unchanged inside the container. It is rebuilt only when the
# Python or this script changes (fingerprint stored as an image label).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
DIR="${MEGAMOE_INFRA_DIR:-/tmp/megamoe-infra}"
IMAGE="${MEGAMOE_BASE_IMAGE:-localhost/megamoe-base:ci}"
CONF="$DIR/containers.conf"
CONF_TAG="# written by megamoe tests/integration/infra/containers.sh"

log() { printf '[infra:containers] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

install_pkgs() {
  local need=()
  command -v podman >/dev/null || need+=(podman)
  command -v runc >/dev/null || need+=(runc)
  [ "${#need[@]}" -eq 0 ] && return 0
  log "installing ${need[*]} (apt-get)"
  if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -print -quit 2>/dev/null)" ]; then
    apt-get update -qq
  fi
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
}

write_conf() {
  # crun fails on hybrid cgroups and podman's default nofile exceeds this box's hard limit.
  mkdir -p "$DIR"
  local nofile nproc
  nofile="$(ulimit -Hn)"; [ "$nofile" = unlimited ] && nofile=1048576
  # no CAP_SYS_RESOURCE in some VMs: runc cannot even restate the host's nproc limit; 4096 works
  nproc="$(ulimit -Hu)"; { [ "$nproc" = unlimited ] || [ "$nproc" -gt 4096 ]; } && nproc=4096
  cat > "$CONF" <<CONF
$CONF_TAG
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=${nproc}:${nproc}"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
  # Plain `podman` (users, images/build.sh) gets it too, unless the machine has its own config.
  if [ ! -e /etc/containers/containers.conf ] || grep -qxF "$CONF_TAG" /etc/containers/containers.conf; then
    mkdir -p /etc/containers
    cp "$CONF" /etc/containers/containers.conf
  else
    log "/etc/containers/containers.conf exists and is not ours: left alone (tests use CONTAINERS_CONF=$CONF)"
  fi
}

python_facts() {  # the interpreter our venv was made from (falls back to python3 on PATH)
  local py="${MEGAMOE_BASE_PYTHON:-}"
  if [ -z "$py" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then py="$REPO/.venv/bin/python"; else py="$(command -v python3)"; fi
  fi
  "$py" - <<'PY'
import os, sys, sysconfig
exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
libdir = sysconfig.get_config_var("LIBDIR") or ""
ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
shared = os.path.join(libdir, ldlib) if sysconfig.get_config_var("Py_ENABLE_SHARED") else ""
print(exe)
print(sysconfig.get_paths()["stdlib"])
print(shared)
print(sys.version.split()[0])
PY
}

ldd_closure() {  # every shared library (path as ldd prints it) needed by the given files
  local f
  for f in "$@"; do ldd "$f" 2>/dev/null | awk '/=> \//{print $3} /^\t\//{print $1}' || true; done | sort -u
}

norm() {  # /lib/x86_64-linux-gnu/x -> /usr/lib/x86_64-linux-gnu/x (merged /usr); keeps the file name
  local p="$1"; printf '%s/%s\n' "$(realpath "$(dirname "$p")")" "$(basename "$p")"
}

build_image() {
  mapfile -t facts < <(python_facts)
  local exe="${facts[0]}" stdlib="${facts[1]}" libpython="${facts[2]}" version="${facts[3]}"
  case "$version" in 3.11.*) ;; *) log "warning: host Python is $version, not 3.11" ;; esac
  local fingerprint
  fingerprint="$(printf '%s\n' "$exe" "$version" "$(sha256sum "${BASH_SOURCE[0]}")" | sha256sum | cut -c1-16)"
  if podman image exists "$IMAGE" &&
     [ "$(podman image inspect --format '{{ index .Labels "megamoe.base.fingerprint" }}' "$IMAGE")" = "$fingerprint" ]; then
    log "$IMAGE is up to date (python $version at $exe)"
    return 0
  fi
  local t0=$SECONDS root="$DIR/rootfs" list="$DIR/rootfs.list"
  rm -rf "$root"; mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib,usr/lib64,etc,tmp,root,proc,sys,dev,work}
  chmod 1777 "$root/tmp"
  local d; for d in bin sbin lib lib64; do ln -s "usr/$d" "$root/$d"; done

  # Debian packages: a shell and basic tools, the C/C++ runtime, and the owners of every library
  # the interpreter and its extension modules link against.
  local bins=("$exe" /bin/bash /bin/sh /usr/bin/env)
  [ -n "$libpython" ] && bins+=("$libpython")
  mapfile -t dynload < <(find "$stdlib/lib-dynload" -name '*.so' 2>/dev/null)
  local pkgs=(bash dash coreutils libc6 libc-bin libgcc-s1 libstdc++6 zlib1g procps grep sed findutils)
  local lib pkg
  while read -r lib; do
    pkg="$(dpkg -S "$lib" 2>/dev/null || dpkg -S "$(norm "$lib")" 2>/dev/null || true)"
    [ -n "$pkg" ] && pkgs+=("${pkg%%:*}")
  done < <(ldd_closure "${bins[@]}" "${dynload[@]}")
  mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | sed 's/:amd64$//' | sort -u)
  : > "$list"
  for pkg in "${pkgs[@]}"; do
    dpkg -L "$pkg" 2>/dev/null | grep -vE '^/usr/share/(doc|man|info|locale|lintian)/' | while read -r p; do
      [ -L "$p" ] || [ -f "$p" ] || continue
      norm "$p"
    done >> "$list"
  done
  # libraries outside dpkg (a pyenv interpreter's libpython, ...)
  while read -r lib; do norm "$lib"; realpath "$lib"; done < <(ldd_closure "${bins[@]}" "${dynload[@]}") >> "$list"
  sort -u -o "$list" "$list"
  tar -C / -cf - --no-recursion 2>/dev/null -T <(sed 's|^/||' "$list") | tar -C "$root" -xf -

  # The interpreter at its own path: bin/, lib/libpython*, the stdlib (no tests, no site-packages).
  local prefix; prefix="$(dirname "$(dirname "$exe")")"
  mkdir -p "$root$prefix/bin"
  cp -a "$exe" "$root$exe"
  ln -sfn "$(basename "$exe")" "$root$prefix/bin/python3"
  [ -n "$libpython" ] && cp -a "$(dirname "$libpython")"/libpython3* "$root$(dirname "$libpython")/"
  tar -C / -cf - --exclude="${stdlib#/}/test" --exclude="${stdlib#/}/site-packages/*" \
      --exclude="${stdlib#/}/dist-packages/*" --exclude='*/idlelib' --exclude='*/tkinter' "${stdlib#/}" |
    tar -C "$root" -xf -
  [ -e "$root/usr/bin/python3" ] || ln -s "$exe" "$root/usr/bin/python3"

  printf 'root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' > "$root/etc/passwd"
  printf 'root:x:0:\nvideo:x:44:\nnogroup:x:65534:\n' > "$root/etc/group"
  printf '/usr/local/lib\n/usr/lib/x86_64-linux-gnu\n' > "$root/etc/ld.so.conf"
  ldconfig -r "$root" 2>/dev/null || true

  local old; old="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
  tar -C "$root" -cf - . | podman import --quiet \
      --change "ENV PATH=$prefix/bin:/usr/local/bin:/usr/bin:/bin" \
      --change "LABEL megamoe.base.fingerprint=$fingerprint" \
      --change "LABEL megamoe.base.python=$exe" \
      --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
  rm -rf "$root"
  [ -n "$old" ] && podman rmi "$old" >/dev/null 2>&1 || true   # the stale copy we replaced (if unused)
  podman run --rm "$IMAGE" python3 -c 'import ssl, sqlite3, ctypes, json' ||
    die "$IMAGE: the interpreter does not start inside the image"
  log "BUILT $IMAGE in $((SECONDS - t0)) s (python $version from $exe, $(podman image inspect --format '{{.Size}}' "$IMAGE") bytes)"
}

case "${1:-up}" in
  up) install_pkgs; write_conf; export CONTAINERS_CONF="$CONF"; build_image ;;
  image) [ -f "$CONF" ] && export CONTAINERS_CONF="$CONF"; build_image ;;
  env) echo "CONTAINERS_CONF=$CONF" ;;
  *) echo "usage: $0 {up|image|env}" >&2; exit 2 ;;
esac
