#!/usr/bin/env bash
# test-torch.sh - the tests that need torch, which Debian does not package: a venv with
# torch, numpy, transformers, peft, safetensors and accelerate from PyPI (made once; several
# GB with torch's CUDA libraries), then
#   1. the project built (scripts/setup.sh) and tests/python run over the build tree by the
#      venv's Python: zinf.torch against plain PyTorch, torch's own calls on an offloaded
#      model, transformers' models, Trainer and peft, zinf train's LoRA export loaded by
#      peft, and the package's tests with torch;
#   2. zinf.torch across nodes under torchrun (tests/multinode/torch.sh: Linux namespaces on
#      this machine; skipped, saying why, without root or unshare);
#   3. the examples: 3 steps of the GPT on NVMe under tenth budgets, and transformers'
#      Trainer fine-tuning a model built straight into zinf;
#   4. `pip install .` into the venv (meson-python) and the torch tests again on the
#      installed package, from outside the source tree; then it is uninstalled.
#   ZINF_TORCH_VENV=build/torch-venv  the venv (an existing one with torch is reused)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${ZINF_TORCH_VENV:-$root/build/torch-venv}

BUILD_DIR=build scripts/setup.sh
pkgs=(torch numpy transformers peft safetensors accelerate)
if ! "$venv/bin/python" -c 'import torch, numpy, transformers, peft, safetensors, accelerate' \
    >/dev/null 2>&1; then
  # The build's Python makes the venv, so that the extension built for it loads there.
  if ! /usr/bin/python3 -c 'import ensurepip' >/dev/null 2>&1; then
    sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q python3-venv
  fi
  echo "test-torch: making $venv (${pkgs[*]} from PyPI)"
  [ -x "$venv/bin/pip" ] || /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q "${pkgs[@]}"
fi
py=$venv/bin/python
echo "test-torch: $("$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)')"

scratch=$(mktemp -d "${TMPDIR:-/tmp}/zinf-torch.XXXXXX")
trap 'rm -rf "$scratch"; "$venv/bin/pip" uninstall -q -y zinf >/dev/null 2>&1 || true' EXIT
export ZINF_TEST_TMPDIR=$scratch

echo "== 1. tests/python over the build tree"
(cd tests/python &&
  PYTHONPATH=$root/build/python ZINF_BIN=$root/build/tools/zinf \
    "$py" -m unittest -v test_torch test_torch_conventions test_torch_hf test_torch_dist \
      test_torch_ckpt test_torch_hf_dist test_lora_peft test_zinf 2>&1 |
    tee "$scratch/tree.log")
# "OK" alone: unittest writes "OK (skipped=N)" when any test skipped.
grep -q '^OK$' "$scratch/tree.log" ||
  { echo "test-torch: a test failed or skipped (above)" >&2; exit 1; }

echo "== 2. across nodes"
rc=0
ZINF_TORCH_PY=$py ZINF_PYTHONPATH=$root/build/python sh tests/multinode/torch.sh || rc=$?
if [ "$rc" = 77 ]; then
  echo "test-torch: across nodes skipped (the reason above)"
elif [ "$rc" != 0 ]; then
  echo "test-torch: across nodes failed (above)" >&2; exit 1
fi

echo "== 3. the example"
PYTHONPATH=$root/build/python "$py" examples/torch_offload.py --text README.md \
  --nvme "$scratch/example" --steps 3 --device emulated
PYTHONPATH=$root/build/python "$py" examples/hf_trainer.py --text README.md \
  --nvme "$scratch/hf-swap" --out "$scratch/hf-out" --steps 6

echo "== 4. pip install ."
"$venv/bin/pip" install -q "$root"
# From a folder outside the tree, with nothing on PYTHONPATH: the installed package.
cp tests/python/test_torch.py tests/python/test_torch_conventions.py tests/python/test_torch_hf.py \
  tests/python/test_torch_dist.py tests/python/test_torch_ckpt.py \
  tests/python/test_torch_hf_dist.py tests/python/daemon.py \
  "$scratch/"
mkdir -p "$scratch/examples" "$scratch/tests" &&
  cp examples/torch_offload.py examples/hf_trainer.py "$scratch/examples/"
mkdir -p "$scratch/tests/data" && cp tests/data/torch_text.md "$scratch/tests/data/"
(cd "$scratch" && mkdir -p tests/python &&
  mv test_torch.py test_torch_conventions.py test_torch_hf.py test_torch_dist.py \
    test_torch_ckpt.py test_torch_hf_dist.py daemon.py tests/python/ &&
  cd tests/python &&
  "$py" -c 'import zinf, zinf.torch, sys; assert "site-packages" in zinf.__file__, zinf.__file__; print("installed:", zinf.__file__)' &&
  ZINF_BIN=$venv/bin/zinf "$py" -m unittest test_torch test_torch_conventions test_torch_hf \
    test_torch_dist test_torch_ckpt test_torch_hf_dist 2>&1 |
  tee "$scratch/installed.log")
grep -q '^OK$' "$scratch/installed.log" ||
  { echo "test-torch: the installed package failed (above)" >&2; exit 1; }
echo "test-torch: all passed"
