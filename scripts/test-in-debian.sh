#!/usr/bin/env bash
# Runs qkv's scripts inside a minimal chroot of another Debian release, so that one machine tests
# qkv against that release's LibTorch (trixie: Debian 13, LibTorch 2.6; sid: unstable, the newest).
#
#   scripts/test-in-debian.sh RELEASE [SCRIPT [ARGS ...]]    default SCRIPT: scripts/test.sh
#   e.g. scripts/test-in-debian.sh trixie                      the whole suite on LibTorch 2.6
#        scripts/test-in-debian.sh sid scripts/test.sh -R Parity
#        scripts/test-in-debian.sh trixie scripts/bench.sh --rounds 3
#        scripts/test-in-debian.sh trixie --prepare            only create the chroot and install packages
#
# The chroot is made once with debootstrap (about a minute) under $QKV_CHROOT_ROOT
# (default /var/cache/qkv-chroots/RELEASE) and reused afterwards; the release's packages are
# installed by scripts/setup.sh inside it. The repository is bind-mounted at /qkv, and the build
# goes to build-RELEASE/ (the host's build/ is untouched). Needs root (or sudo), debootstrap and
# a Debian mirror (taken from this machine's apt sources; $QKV_DEBIAN_MIRROR overrides).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[[ $# -ge 1 ]] || { sed -n '2,16p' "$0" >&2; exit 2; }
release=$1
shift
prepare_only=false
if [[ "${1:-}" == "--prepare" ]]; then prepare_only=true; shift; fi
script=${1:-scripts/test.sh}
[[ $# -gt 0 ]] && shift

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo > /dev/null || { echo "test-in-debian: needs root or sudo (debootstrap, chroot, mount)" >&2; exit 1; }
  sudo=(sudo)
fi
if ! command -v debootstrap > /dev/null; then
  echo "test-in-debian: installing debootstrap"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends debootstrap > /dev/null
fi

# The mirror this machine's apt already uses (deb822 sources or a classic sources.list).
mirror=${QKV_DEBIAN_MIRROR:-}
if [[ -z "$mirror" ]]; then
  mirror=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v -- '-security' | head -1 || true)
  [[ -n "$mirror" ]] || mirror=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v -- '-security' | head -1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi

chroot_dir=${QKV_CHROOT_ROOT:-/var/cache/qkv-chroots}/$release
if [[ ! -x "$chroot_dir/usr/bin/apt-get" ]]; then
  # A name debootstrap does not know (a typo, or another script's option passed through) is
  # refused before anything is made.
  if [[ ! "$release" =~ ^[a-z][a-z0-9-]*$ || ! -e /usr/share/debootstrap/scripts/$release ]]; then
    echo "test-in-debian: expected a Debian release debootstrap knows (trixie, sid, ...), got '$release'" >&2
    exit 2
  fi
  echo "test-in-debian: creating a minimal Debian $release in $chroot_dir from $mirror"
  "${sudo[@]}" rm -rf "$chroot_dir"
  "${sudo[@]}" mkdir -p "$chroot_dir"
  "${sudo[@]}" debootstrap --variant=minbase "$release" "$chroot_dir" "$mirror" > "$chroot_dir.debootstrap.log" 2>&1 ||
    { tail -20 "$chroot_dir.debootstrap.log" >&2; echo "test-in-debian: debootstrap $release failed" >&2; exit 1; }
  # Unstable's Release files may be older than their Valid-Until on machines with a stale mirror.
  echo 'Acquire::Check-Valid-Until "false";' | "${sudo[@]}" tee "$chroot_dir/etc/apt/apt.conf.d/99qkv-no-valid-until" > /dev/null
fi
"${sudo[@]}" cp /etc/resolv.conf "$chroot_dir/etc/resolv.conf"

# One session per chroot at a time: a lock that the kernel drops when its holders die (the mounts
# are not a lock: a session killed before its cleanup leaves them behind). A second session waits
# for the first, up to $QKV_CHROOT_WAIT seconds (default one hour).
unmount_under_chroot() {
  local target
  while read -r target; do
    [[ "$target" == "$chroot_dir" || "$target" == "$chroot_dir"/* ]] && ! printf '%s\n' "$@" | grep -qx "$target" &&
      "${sudo[@]}" umount -l "$target" 2> /dev/null
  done < <(findmnt -rn -o TARGET | sort -r)
  return 0
}
lock_file="$chroot_dir.lock"
"${sudo[@]}" touch "$lock_file"
exec 9< "$lock_file"
if ! flock -n 9; then
  echo "test-in-debian: another session is using $chroot_dir; waiting for it to end (up to ${QKV_CHROOT_WAIT:-3600} s)"
  flock -w "${QKV_CHROOT_WAIT:-3600}" 9 ||
    { echo "test-in-debian: $chroot_dir is still in use after ${QKV_CHROOT_WAIT:-3600} s; giving up" >&2; exit 1; }
fi
# Mounts left by a session that was killed before its cleanup ran.
if findmnt -rn -o TARGET | grep -q "^$chroot_dir/"; then
  echo "test-in-debian: removing mounts left in $chroot_dir by an earlier session that was killed"
  unmount_under_chroot
fi

# Mounts, undone on every exit.
mounted=()
cleanup() {
  local i
  # Mounts made inside the chroot (ip netns binds /run/netns there) first, then ours.
  unmount_under_chroot "${mounted[@]}"
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do "${sudo[@]}" umount -l "${mounted[i]}" 2> /dev/null || true; done
}
trap cleanup EXIT
bind() {
  "${sudo[@]}" mkdir -p "$chroot_dir$2"
  "${sudo[@]}" mount --bind "$1" "$chroot_dir$2"
  mounted+=("$chroot_dir$2")
}
# The chroot's root as a mount point of its own: `ip netns exec` (the two-host test) remounts / as
# a slave, which fails on a plain directory.
"${sudo[@]}" mount --bind "$chroot_dir" "$chroot_dir"
mounted+=("$chroot_dir")
bind /proc /proc
bind /sys /sys
bind /dev /dev
bind /dev/pts /dev/pts
bind "$root" /qkv
[[ -d /dev/shm ]] && bind /dev/shm /dev/shm

# OpenBLAS's settings go in as one set: a machine that sets OPENBLAS_CORETYPE may set OPENBLAS_L2_SIZE
# beside it, and one without the other can crash. Debian unstable's OpenBLAS 0.3.34 on an AMD CPU with
# AVX-512 and a 1 MiB L2 enlarges the blocking of a forced AVX2 core (Haswell) past its dgemm kernel's
# stack buffer (OpenMathLib/OpenBLAS#6021, fixed by #6027): with OPENBLAS_CORETYPE=Haswell alone, a
# float64 product 512 deep segfaulted there (AMD EPYC Zen 5, 2026-12-04); with the L2 size as well, not.
openblas_settings=()
while IFS= read -r name; do openblas_settings+=("$name=${!name}"); done < <(compgen -e | grep '^OPENBLAS_' || true)

in_chroot() {
  "${sudo[@]}" chroot "$chroot_dir" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin QKV_BUILD_DIR="/qkv/build-$release" \
    QKV_CMAKE_ARGS="${QKV_CMAKE_ARGS:-}" "${openblas_settings[@]}" \
    ${GLIBC_TUNABLES:+GLIBC_TUNABLES="$GLIBC_TUNABLES"} ${MALLOC_MMAP_THRESHOLD_:+MALLOC_MMAP_THRESHOLD_="$MALLOC_MMAP_THRESHOLD_"} \
    ${MALLOC_TRIM_THRESHOLD_:+MALLOC_TRIM_THRESHOLD_="$MALLOC_TRIM_THRESHOLD_"} \
    ${QKV_TILED_ISA:+QKV_TILED_ISA="$QKV_TILED_ISA"} ${ATEN_CPU_CAPABILITY:+ATEN_CPU_CAPABILITY="$ATEN_CPU_CAPABILITY"} \
    ${ONEDNN_MAX_CPU_ISA:+ONEDNN_MAX_CPU_ISA="$ONEDNN_MAX_CPU_ISA"} "$@"
}

echo "test-in-debian: $release ($(in_chroot cat /etc/debian_version)), repository at /qkv"
in_chroot bash /qkv/scripts/setup.sh
if $prepare_only; then exit 0; fi
in_chroot bash -c 'cd /qkv && case $0 in *.sh) exec bash "$0" "$@" ;; *) exec "$0" "$@" ;; esac' "$script" "$@"
