#!/bin/sh
# packaging.sh - what `meson install` puts in place for the service (packaging/), checked as
# installed: `meson install --destdir` into a scratch root; every file where the build's
# prefix says; the default config read by the installed zinf; the unit through
# `systemd-analyze verify` (its ExecStart pointed at the installed binary in the scratch
# root), which must pass without a word, and `systemd-analyze security --offline`, whose
# exposure is printed and must stay at or below 2.0. As root, systemd-sysusers and
# systemd-tmpfiles apply the installed sysusers.d and tmpfiles.d entries to the scratch root:
# the user and group zinf, /run/zinf 0750 and /var/lib/zinf 0700 theirs, the config copied
# to sysconfdir. Nothing outside the scratch root is touched. Exit 77 (skipped) without
# systemd-analyze (Debian's package systemd).
# usage: packaging.sh BUILD_ROOT PREFIX BINDIR SYSCONFDIR DATADIR UNITDIR SYSUSERSDIR TMPFILESDIR
# (the directories absolute, as the build configured them)
set -eu
build=$1 prefix=$2 bindir=$3 sysconfdir=$4 datadir=$5 unitdir=$6 sysusersdir=$7 tmpfilesdir=$8
fail() { echo "packaging: $*" >&2; exit 1; }
command -v systemd-analyze >/dev/null || { echo "packaging: no systemd-analyze: skipped"; exit 77; }
base=${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}
mkdir -p "$base" # the first test of a fresh build dir to run makes it
tmp=$(mktemp -d "$base/packaging.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root

meson install -C "$build" --destdir "$root" --no-rebuild --quiet >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "meson install failed"; }
for f in "$bindir/zinf" "$prefix/include/zinf.h" "$unitdir/zinf.service" \
         "$sysusersdir/zinf.conf" "$tmpfilesdir/zinf.conf" "$datadir/zinf/zinf.json"; do
  [ -f "$root$f" ] || fail "$f was not installed (prefix $prefix)"
done
[ -n "$(find "$root" -name zinf.pc)" ] || fail "no zinf.pc was installed"
[ -n "$(find "$root" -name 'libzinf.so*')" ] || fail "no libzinf.so was installed"

# The default config, as the installed daemon reads it.
"$root$bindir/zinf" config check --strict "$root$datadir/zinf/zinf.json" >"$tmp/check.log" 2>&1 ||
  { cat "$tmp/check.log" >&2; fail "the default config does not pass zinf config check --strict"; }

# The unit names the installed binary and config; verify sees the binary in the scratch root.
unit=$root$unitdir/zinf.service
want="ExecStart=$bindir/zinf serve --foreground --socket /run/zinf/zinf.sock --config $sysconfdir/zinf/zinf.json --group zinf"
grep -qxF "$want" "$unit" || { grep '^ExecStart=' "$unit" >&2; fail "the unit's ExecStart is not: $want"; }
mkdir "$tmp/verify"
sed "s|^ExecStart=$bindir/|ExecStart=$root$bindir/|" "$unit" >"$tmp/verify/zinf.service"
# No --root: verify then needs the machine's own systemd units (sysinit.target...), which
# Debian's package installs; no running systemd is needed. It exits 0 even over an unknown
# key or a bad value (it says "ignoring"), so anything it says fails the test.
(cd "$tmp/verify" && systemd-analyze verify --man=no --generators=no ./zinf.service) \
  >"$tmp/verify.log" 2>&1 || { cat "$tmp/verify.log" >&2; fail "systemd-analyze verify failed"; }
[ ! -s "$tmp/verify.log" ] || { cat "$tmp/verify.log" >&2; fail "systemd-analyze verify complained"; }
(cd "$tmp/verify" && systemd-analyze security --offline=yes --threshold=20 ./zinf.service) \
  >"$tmp/security.log" 2>&1 || { cat "$tmp/security.log" >&2
                                 fail "systemd-analyze security: exposure above 2.0, or it failed"; }
grep 'Overall exposure level' "$tmp/security.log" || fail "no exposure level in: $(cat "$tmp/security.log")"

if [ "$(id -u)" != 0 ]; then
  echo "packaging: not root: the sysusers.d and tmpfiles.d entries were not applied"
  exit 0
fi
command -v systemd-sysusers >/dev/null && command -v systemd-tmpfiles >/dev/null ||
  fail "systemd-analyze is here but systemd-sysusers or systemd-tmpfiles is not"
mkdir -p "$root/etc" # its passwd and group, made there
systemd-sysusers --root="$root" "$root$sysusersdir/zinf.conf" >"$tmp/sysusers.log" 2>&1 ||
  { cat "$tmp/sysusers.log" >&2; fail "systemd-sysusers failed"; }
uid=$(awk -F: '$1 == "zinf" { print $3 }' "$root/etc/passwd")
gid=$(awk -F: '$1 == "zinf" { print $3 }' "$root/etc/group")
[ -n "$uid" ] && [ -n "$gid" ] || fail "no user or group zinf in the scratch root's /etc"
systemd-tmpfiles --root="$root" --create "$root$tmpfilesdir/zinf.conf" >"$tmp/tmpfiles.log" 2>&1 ||
  { cat "$tmp/tmpfiles.log" >&2; fail "systemd-tmpfiles --create failed"; }
for d in "/run/zinf 750" "/var/lib/zinf 700"; do
  # shellcheck disable=SC2086 # a path and a mode, split on purpose
  set -- $d
  got=$(stat -c '%a %u %g' "$root$1")
  [ "$got" = "$2 $uid $gid" ] || fail "$1 is '$got' (mode uid gid), not '$2 $uid $gid'"
done
cmp -s "$root$datadir/zinf/zinf.json" "$root$sysconfdir/zinf/zinf.json" ||
  fail "systemd-tmpfiles did not copy the default config to $sysconfdir/zinf/zinf.json"
# An edited config is kept by the next --create.
echo '{}' >"$root$sysconfdir/zinf/zinf.json"
systemd-tmpfiles --root="$root" --create "$root$tmpfilesdir/zinf.conf" >/dev/null 2>&1 || true
[ "$(cat "$root$sysconfdir/zinf/zinf.json")" = '{}' ] ||
  fail "systemd-tmpfiles --create replaced an edited $sysconfdir/zinf/zinf.json"
echo "packaging: installed under $prefix; user zinf $uid:$gid; /run/zinf, /var/lib/zinf and the config in place"
