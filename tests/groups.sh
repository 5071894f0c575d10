#!/usr/bin/env bash
# groups.sh - checks that the --filter patterns a Criterion program runs under (its groups
# in tests/meson.build) take each of its tests exactly once: a test that no group took would
# never run, one that two took would run twice.
#
#   tests/groups.sh SOURCE SUITE PATTERN...
#
# SOURCE is the program's .c file, SUITE its Criterion suite; each PATTERN is matched as
# Criterion matches --filter, an extended glob over SUITE/NAME.
set -euo pipefail
shopt -s extglob
src=$1 suite=$2
shift 2
n=0 bad=0
while read -r name; do
  n=$((n + 1))
  took=0
  for pat in "$@"; do
    # shellcheck disable=SC2053 # the pattern is a glob on purpose
    [[ $suite/$name == $pat ]] && took=$((took + 1))
  done
  if [ "$took" != 1 ]; then
    echo "groups.sh: $suite/$name is in $took groups of $src" >&2
    bad=1
  fi
done < <(sed -n "s/^Test($suite, *\([A-Za-z0-9_]*\).*/\1/p" "$src")
[ "$n" -gt 0 ] || { echo "groups.sh: no Test($suite, ...) in $src" >&2; exit 1; }
[ "$bad" = 0 ] || exit 1
echo "groups.sh: $n tests of $src, each in one of $# groups"
