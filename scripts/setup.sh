#!/usr/bin/env bash
# setup.sh - install what the build needs (Debian/Ubuntu, apt-get) when it is missing,
# then configure and build zinf in ./build (or $BUILD_DIR). Extra arguments go to
# `meson setup`. The CUDA toolkit is used when present (/usr/local/cuda, or
# -Dcudatoolkit_dir=DIR); without it the device tier is emulated. It is not installed
# from here.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${BUILD_DIR:-build}
# libhwloc-plugins: hwloc's libxml2 XML parser for `zinf topo --xml` (without it hwloc has
# only a minimal one that reads nothing but its own layout), with the discovery plugins
# (gl, opencl, pci) that most installs have and that zinf leaves out of its loads.
# python3-dev: the headers the Python package (python/zinf) is built with; python3-numpy: its
# DLPack tests.
# systemd: systemd-analyze, systemd-sysusers and systemd-tmpfiles, with which the packaging
# test checks the installed unit (no running systemd is needed).
pkgs=(gcc g++ pkg-config meson ninja-build liburing-dev libnuma-dev libhwloc-dev
      libhwloc-plugins libcriterion-dev libjansson-dev libopenblas-dev fio python3 python3-dev python3-numpy
      gnuplot-nox systemd openmpi-bin libopenmpi-dev procps)
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

# nvcc compiles kernels/ when the CUDA toolkit is installed: meson looks for it in
# cudatoolkit_dir/bin, then on PATH.

if [ ! -f "$build_dir/build.ninja" ]; then
  meson setup "$build_dir" "$@"
elif [ $# -gt 0 ]; then
  meson configure "$build_dir" "$@"
fi
ninja -C "$build_dir"
