#!/usr/bin/env bash
# setup.sh - install what the build needs (Debian/Ubuntu, apt-get) when it is missing,
# then configure and build zinf in ./build (or $BUILD_DIR). Extra arguments go to
# `meson setup`. The CUDA toolkit is used when present (/usr/local/cuda); it is not
# installed from here.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${BUILD_DIR:-build}
pkgs=(gcc g++ pkg-config meson ninja-build liburing-dev libnuma-dev libhwloc-dev
      libcriterion-dev libjansson-dev libopenblas-dev fio python3)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=
  [ "$(id -u)" = 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q || true  # a stale list still serves if the update cannot run
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# nvcc compiles kernels/ when the CUDA toolkit is installed; meson looks for it on PATH.
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

if [ ! -f "$build_dir/build.ninja" ]; then
  meson setup "$build_dir" "$@"
elif [ $# -gt 0 ]; then
  meson configure "$build_dir" "$@"
fi
ninja -C "$build_dir"
