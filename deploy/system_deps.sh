#!/usr/bin/env bash
# Installs the Debian packages a make target needs: `deploy/system_deps.sh test|pod-test`.
# test: prometheus and promtool (tests/observability scrapes and checks rules for real).
# pod-test: podman, buildah, debootstrap, runc and catatonit (podman's pause process, only
# recommended by Debian's podman; runc named: Debian's podman pulls crun,
# which fails on some hosts). As root (or with passwordless sudo) it installs what is missing;
# otherwise it prints the one command to run and fails before any test starts.
set -euo pipefail

declare -A packages
case "${1:-}" in
  test) packages=([prometheus]=prometheus [promtool]=prometheus) ;;
  pod-test) packages=([podman]=podman [buildah]=buildah [debootstrap]=debootstrap [runc]=runc
    [catatonit]=catatonit) ;;
  *) echo "usage: $0 test|pod-test" >&2; exit 2 ;;
esac

missing=()
for cmd in "${!packages[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${packages[$cmd]}")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "make $1 needs Debian packages that are not installed; run:" \
    "sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
  exit 1
fi
echo "installing ${missing[*]} (needed by make $1)" >&2
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
