#!/bin/sh
# readme_example.sh - the embedding example of docs/embedding.md, as printed, against the library as
# installed: `meson install --destdir` into a scratch root (so zinf.pc must be relocatable),
# the ```c block under "# Embedding the tier manager" extracted from docs/embedding.md, compiled
# with the flags pkg-config gives for that root, and run. It must exit 0.
# usage: readme_example.sh SOURCE_ROOT BUILD_ROOT CC [SANITIZE]
set -eu
src=$1 build=$2 cc=$3 sanitize=${4:-none}
base=${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}
mkdir -p "$base" # the first test of a fresh build dir to run makes it
tmp=$(mktemp -d "$base/readme.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

meson install -C "$build" --destdir "$tmp/root" --no-rebuild --quiet >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; echo "readme_example: meson install failed" >&2; exit 1; }
pc=$(find "$tmp/root" -name zinf.pc | head -n 1)
[ -n "$pc" ] || { echo "readme_example: no zinf.pc was installed" >&2; exit 1; }
PKG_CONFIG_PATH=$(dirname "$pc")
export PKG_CONFIG_PATH
prefix=$(pkg-config --variable=prefix zinf)
case $(cd "$prefix" && pwd -P) in
"$(cd "$tmp/root" && pwd -P)"/*) ;;
*) echo "readme_example: zinf.pc names prefix $prefix, not the root it was installed in" >&2
   exit 1 ;;
esac

awk '/^# Embedding the tier manager/ { f = 1 } f && /^```c$/ { p = 1; next }
     p && /^```$/ { exit } p' "$src/docs/embedding.md" >"$tmp/app.c"
[ -s "$tmp/app.c" ] || { echo "readme_example: no C block under the heading of docs/embedding.md" >&2; exit 1; }

flags=
[ "$sanitize" = none ] || flags="-fsanitize=$sanitize"
# shellcheck disable=SC2046 # pkg-config's output is a list of words
"$cc" -Wall -Werror $flags "$tmp/app.c" $(pkg-config --cflags --libs zinf) -o "$tmp/app"
cd "$tmp"
LD_LIBRARY_PATH=$(pkg-config --variable=libdir zinf)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ./app
