# ds_env.sh - sourced by the benchmarks that run DeepSpeed: sets up what they need when it
# is missing (libaio-dev for DeepSpeed's aio op, with apt-get; a venv with torch and
# deepspeed from PyPI, several GB, once), sets $py to the venv's python, and defines the
# helpers their summaries share: stats (median min max of the numbers on stdin), ratio A B
# (A / B to 3 places) and met X T ("met" when X >= T).
#   VENV=/var/tmp/zinf-ds-venv  NEED_AIO=1 (0: skip libaio-dev)
venv=${VENV:-/var/tmp/zinf-ds-venv}
if [ "${NEED_AIO:-1}" = 1 ] &&
   ! dpkg-query -W -f='${Status}' libaio-dev 2>/dev/null | grep -q 'install ok installed'; then
  sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q libaio-dev ||
    { $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q libaio-dev; }
fi
if ! "$venv/bin/python" -c 'import deepspeed, torch' >/dev/null 2>&1; then
  echo "# setting up $venv (torch, deepspeed from PyPI)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch deepspeed
fi
py="$venv/bin/python"

stats() { # median min max of the numbers on stdin
  tr ' ' '\n' | grep -v '^$' | sort -g |
    awk '{a[NR] = $1} END { printf "%s %s %s", a[int((NR + 1) / 2)], a[1], a[NR] }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }
met() { awk -v x="$1" -v t="$2" 'BEGIN { print (x >= t ? "met" : "NOT met") }'; }
