#!/usr/bin/env bash
# run.sh - builds zinf's GPU test programs against a CPU emulation of the CUDA runtime and
# cuBLAS (emu_rt.cpp, emu_gemm.cpp) and of NCCL (emu_nccl.cpp) and runs them, on a machine without a GPU. The library
# is built from its real sources with ZINF_HAVE_CUDA and ZINF_HAVE_KERNELS set, and the
# kernels of kernels/*.cu are turned into C++ by rewrite.py, so the code a GPU would run
# is checked by ASan and UBSan: stream and event ordering, the memory each copy touches,
# kernel indexing and barriers, the CPU-against-GPU comparisons of the tests.
#
#   tests/cuda_emu/run.sh [--stress] [--no-sanitize] [PROGRAM...]
#
# PROGRAM is a test program of tests/meson.build (default: test_kernels test_train_gpu
# test_device test_host test_comm test_comm_a2a), or `ranks`: ranks.sh, GPU ranks of `zinf launch -n N --
# zinf train` over the emulated NCCL (emu_nccl.cpp), with the zinf command built here
# (EMU_RANKS=zero, pipeline, tp, sp, faults, moe or wire: that part of it alone); or
# `ranks-mpi`: ranks_mpi.sh, GPU ranks under `mpirun -np N` split into logical nodes
# (ZINF_COMM_RANKS_PER_NODE), NCCL's id broadcast over MPI, with the communicator alone
# (comm_nccl_mpi_rank) first; or `comm-mpi`: that communicator part alone. Both need Open
# MPI's mpirun. --stress runs them again with EMU_PROTECT=1 EMU_SHUFFLE=1
# EMU_JITTER_US=300 (see emu_rt.cpp). --no-sanitize builds without ASan and UBSan (faster).
# Everything goes to build-emu/ at the repository root: meson/ (a CPU-only configuration
# that provides zinf_build.h and the lists of sources and flags), asan/ or plain/ (the
# build), logs/. CUDA_HOME (or -Dcudatoolkit_dir=DIR, as meson takes it; default
# /usr/local/cuda) says where the toolkit's headers are: only the declarations are used,
# nothing of the toolkit is linked. Without them it exits 77.
#
# Not part of `meson test` or CI, and not a substitute for tests/gpu/run.sh on a GPU: it
# cannot check the numerics of real FMAs and tensor cores, real concurrency between
# kernels and copies, or performance. CRITERION_JOBS=n runs n tests of a program at a time
# (default 1, so that the logs read in order). EMU_TIMEOUT=s: each test's time limit (default
# 1800, in place of the tests' own).
set -uo pipefail

usage() {
  echo "usage: tests/cuda_emu/run.sh [--stress] [--no-sanitize] [PROGRAM...]"
  echo "  (default programs: test_kernels test_train_gpu test_device test_host test_comm test_comm_a2a;"
  echo "   ranks: GPU ranks of zinf train over the emulated NCCL;"
  echo "   ranks-mpi: the same under mpirun, in logical nodes; comm-mpi: its communicator part)"
}

stress=0
sanitize=1
cuda_dir=${CUDA_HOME:-/usr/local/cuda}
progs=()
for a in "$@"; do
  case $a in
    --stress) stress=1 ;;
    --no-sanitize) sanitize=0 ;;
    -Dcudatoolkit_dir=*) cuda_dir=${a#*=} ;;
    -h | --help) usage; exit 0 ;;
    -*) usage >&2; exit 2 ;;
    *) progs+=("$a") ;;
  esac
done
[ ${#progs[@]} -gt 0 ] || progs=(test_kernels test_train_gpu test_device test_host test_comm test_comm_a2a)
# "ranks" is ranks.sh over the zinf command built here; "ranks-mpi" and "comm-mpi" are
# ranks_mpi.sh over it and comm_nccl_mpi_rank.
targets=()
for p in "${progs[@]}"; do
  case $p in
    ranks) targets+=(zinf) ;;
    ranks-mpi | comm-mpi) targets+=(zinf comm_nccl_mpi_rank) ;;
    *) targets+=("$p") ;;
  esac
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root" || exit 1
top=build-emu
variant=asan
[ $sanitize = 1 ] || variant=plain
bdir=$top/$variant

for h in cuda_runtime_api.h cublas_v2.h cuda_bf16.h; do
  if [ ! -f "$cuda_dir/include/$h" ]; then
    echo "cuda_emu: skipped: $cuda_dir/include/$h not found (set CUDA_HOME to a CUDA toolkit)"
    exit 77
  fi
done
for t in meson ninja python3 "${CXX:-c++}"; do
  if ! command -v "$t" > /dev/null; then
    echo "cuda_emu: $t not found (scripts/setup.sh installs it)" >&2
    exit 1
  fi
done
mkdir -p "$top/inc" "$top/logs" "$top/tmp" "$bdir"

# A CPU-only meson configuration: its zinf_build.h, and its introspection data for the
# library's sources, each program's sources and flags, and the libraries to link. It is set
# up once, set up again if it was configured with CUDA since (the real libcudart would be
# linked instead of the emulation), and otherwise re-reads the meson files when one
# changed, as a build in that directory would.
if [ ! -f "$top/meson/build.ninja" ]; then
  configure=(meson setup "$top/meson" -Dcuda=disabled -Dtests=enabled)
elif ! grep -q '^#define ZINF_HAVE_CUDA 0$' "$top/meson/zinf_build.h"; then
  configure=(meson setup --reconfigure "$top/meson" -Dcuda=disabled -Dtests=enabled)
else
  configure=(ninja -C "$top/meson" build.ninja)
fi
if ! "${configure[@]}" > "$top/logs/meson.log" 2>&1; then
  tail -20 "$top/logs/meson.log" >&2
  echo "cuda_emu: ${configure[*]} failed (log: $top/logs/meson.log)" >&2
  exit 1
fi
sed -e 's/^#define ZINF_HAVE_CUDA 0$/#define ZINF_HAVE_CUDA 1/' \
    -e 's/^#define ZINF_HAVE_KERNELS 0$/#define ZINF_HAVE_KERNELS 1/' \
    -e 's/^#define ZINF_HAVE_NCCL 0$/#define ZINF_HAVE_NCCL 1\n#define ZINF_NCCL_LINKED 1/' \
    "$top/meson/zinf_build.h" > "$top/inc/zinf_build.h.new"
if [ "$(grep -cE '^#define ZINF_(HAVE_(CUDA|KERNELS|NCCL)|NCCL_LINKED) 1$' "$top/inc/zinf_build.h.new")" != 4 ]; then
  echo "cuda_emu: cannot set ZINF_HAVE_CUDA, ZINF_HAVE_KERNELS and ZINF_HAVE_NCCL in $top/meson/zinf_build.h" >&2
  exit 1
fi
cmp -s "$top/inc/zinf_build.h.new" "$top/inc/zinf_build.h" ||
  mv "$top/inc/zinf_build.h.new" "$top/inc/zinf_build.h"
rm -f "$top/inc/zinf_build.h.new"

# build.ninja for this variant. The library's C sources and each program's sources and
# flags come from meson's introspection; the kernels are every kernels/*.cu (the list in
# kernels/meson.build is not introspectable in a build without CUDA).
python3 - "$root" "$here" "$top" "$bdir" "$cuda_dir" "$sanitize" "${CXX:-c++}" "${targets[@]}" \
  <<'PY' || exit 2
import glob, json, os, shlex, sys

root, here, top, bdir, cuda, sanitize, cxx = sys.argv[1:8]
progs = list(dict.fromkeys(sys.argv[8:]))  # zinf once, whichever modes ask for it
info = os.path.join(root, top, 'meson', 'meson-info')
targets = {}
for t in json.load(open(os.path.join(info, 'intro-targets.json'))):
    # The zinf command and the zinf library share a name: the programs are executables.
    if t['name'] not in targets or t['type'] == 'executable':
        targets[t['name']] = t
deps = json.load(open(os.path.join(info, 'intro-dependencies.json')))
inc = os.path.join(root, top, 'inc')
cuda_inc = os.path.join(cuda, 'include')
rewrite = os.path.join(here, 'rewrite.py')
san = ['-fsanitize=address,undefined', '-fno-omit-frame-pointer',
       '-fno-sanitize-recover=undefined', '-O1'] if sanitize == '1' else []


def esc(path):  # a path in a ninja build line
    return path.replace('$', '$$').replace(' ', '$ ').replace(':', '$:')


def cmd(args):  # a ninja variable holding shell words
    return ' '.join(shlex.quote(a) for a in args).replace('$', '$$')


meson_dir = os.path.join(root, top, 'meson')
generated = []  # sources the meson configuration generates (the zinf command's pages)


def c_target(name):
    """The C compiler, sources and flags of a meson target, for this build."""
    if name not in targets:
        sys.exit('cuda_emu: %s is not a target of the meson build (tests/meson.build)' % name)
    [ts] = [t for t in targets[name]['target_sources'] if t['language'] == 'c']
    # Sources the configuration generates (meson lists them apart) are made there first.
    gen = ts.get('generated_sources', [])
    for s in gen:
        if os.path.relpath(s, meson_dir) not in generated:
            generated.append(os.path.relpath(s, meson_dir))
    # Our zinf_build.h comes before meson's; the toolkit's headers are system headers.
    params = [a for a in ts['parameters'] if not a.startswith('-fdiagnostics-color')]
    return (ts['compiler'][0], ts['sources'] + gen,
            ['-I' + inc] + params + ['-isystem', cuda_inc] + san)


lines = [
    '# Written by tests/cuda_emu/run.sh on every run.',
    'rule cc',
    '  command = $cc -MD -MF $out.d $flags -c $in -o $out',
    '  depfile = $out.d',
    '  deps = gcc',
    '  description = cc $in',
    'rule cxx',
    '  command = %s -MD -MF $out.d $flags -c $in -o $out' % shlex.quote(cxx),
    '  depfile = $out.d',
    '  deps = gcc',
    '  description = c++ $in',
    'rule rewrite',
    '  command = python3 %s $in > $out' % shlex.quote(rewrite),
    '  description = rewrite $in',
    'rule link',
    '  command = %s $flags -o $out $in $libs' % shlex.quote(cxx),
    '  description = link $out',
]


def compile_c(cc, src, flags, sub=''):
    o = os.path.join('obj', sub, os.path.relpath(src, root)) + '.o'
    lines.extend(['build %s: cc %s' % (esc(o), esc(src)), '  cc = ' + cmd([cc]),
                  '  flags = ' + cmd(flags)])
    return o


def compile_cxx(src, flags):
    o = os.path.join('obj', os.path.basename(src)) + '.o'
    lines.extend(['build %s: cxx %s' % (esc(o), esc(src)), '  flags = ' + cmd(flags)])
    return o


# The library, from its real C sources.
cc, srcs, flags = c_target('zinf_internal')
lib_objs = [compile_c(cc, s, flags) for s in srcs]

# The kernels, rewritten to C++ in gen/.
kernel_flags = ['-std=c++17', '-g', '-O2', '-Wall', '-Wno-unused-parameter',
                '-include', os.path.join(here, 'emu.h'), '-I' + here, '-I' + inc,
                '-I' + os.path.join(root, 'src'), '-I' + os.path.join(root, 'include'),
                '-I' + root, '-isystem', cuda_inc] + san
for cu in sorted(glob.glob(os.path.join(root, 'kernels', '*.cu'))):
    cpp = os.path.join('gen', os.path.basename(cu) + '.cpp')
    lines.append('build %s: rewrite %s | %s' % (esc(cpp), esc(cu), esc(rewrite)))
    lib_objs.append(compile_cxx(cpp, kernel_flags))

# The emulator: the runtime checked like the rest, the GEMM loops optimised and unchecked.
rt_flags = ['-std=c++17', '-g', '-O2', '-Wall', '-Wextra', '-Wno-unused-parameter',
            '-I' + here, '-isystem', cuda_inc] + san
lib_objs.append(compile_cxx(os.path.join(here, 'emu_rt.cpp'), rt_flags))
lib_objs.append(compile_cxx(os.path.join(here, 'emu_nccl.cpp'), rt_flags))
gemm_flags = ['-std=c++17', '-g', '-O2', '-Wall']
lib_objs.append(compile_cxx(os.path.join(here, 'emu_gemm.cpp'), gemm_flags))

# The programs, linked with every library the meson configuration found.
libs = []
for d in deps:
    for a in d['link_args']:
        if a not in libs:
            libs.append(a)
libs.append('-lm')
for p in progs:
    cc, srcs, flags = c_target(p)
    objs = [compile_c(cc, s, flags, p) for s in srcs]
    lines.extend(['build %s: link %s' % (esc(p), ' '.join(esc(o) for o in objs + lib_objs)),
                  '  flags = ' + cmd(san), '  libs = ' + cmd(libs)])
with open(os.path.join(root, bdir, 'build.ninja'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
# What the meson configuration must generate first (its custom targets make their headers
# with their sources), one path a line.
with open(os.path.join(root, bdir, 'generated.txt'), 'w') as f:
    f.write(''.join(g + '\n' for g in generated))
PY

mapfile -t generated < "$bdir/generated.txt"
if [ ${#generated[@]} -gt 0 ] &&
  ! ninja -C "$top/meson" "${generated[@]}" > "$top/logs/generated.log" 2>&1; then
  tail -20 "$top/logs/generated.log" >&2
  echo "cuda_emu: cannot generate ${generated[*]} (log: $top/logs/generated.log)" >&2
  exit 1
fi

echo "== building ${targets[*]} in $bdir"
if ! ninja -C "$bdir" "${targets[@]}" > "$top/logs/build.log" 2>&1; then
  grep -v '^\[' "$top/logs/build.log" | tail -40 >&2
  echo "cuda_emu: build failed (log: $top/logs/build.log)" >&2
  exit 1
fi

# As tests/meson.build runs the tests. The pinned host tier mlocks its arena.
export ZINF_TEST_TMPDIR=$root/$top/tmp ZINF_TEST_DATA=$root/tests/data
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:protect_shadow_gap=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export CRITERION_JOBS=${CRITERION_JOBS:-1}
# Each test's limit, in place of its own: the emulated kernels under ASan run a test many
# times slower than a build does (a GPU trainer test takes minutes on 2 cores).
timeout=${EMU_TIMEOUT:-1800}
ulimit -l unlimited 2> /dev/null || true
echo "memlock limit: $(ulimit -l) (KiB; the pinned host tier locks its whole arena)"

failed=0
runs=0
run_all() { # label, then environment assignments
  local label=$1
  shift
  for p in "${progs[@]}"; do
    local log=$top/logs/$p.$variant.$label.log t0=$SECONDS rc
    echo "== $p ($variant, $label)"
    if [ "$p" = ranks ]; then
      env "$@" bash "$here/ranks.sh" "$root/$bdir/zinf" "$root/$top/tmp/ranks" > "$log" 2>&1
      rc=$?
      grep -E 'rc=[1-9]|FAIL|EMU: |ERROR: |runtime error|failure' "$log" | sed 's/^/   /'
      sed -n '/figures/,$p' "$log" | sed 's/^/   /'
    elif [ "$p" = ranks-mpi ] || [ "$p" = comm-mpi ]; then
      env "$@" bash "$here/ranks_mpi.sh" "$root/$bdir/zinf" "$root/$bdir/comm_nccl_mpi_rank" \
        "$root/$top/tmp/ranks-mpi" ${p%-mpi} > "$log" 2>&1
      rc=$?
      grep -E '^   [a-z]|FAIL|EMU: |ERROR: |runtime error' "$log" | sed 's/^/   /'
    else
      env "$@" "$bdir/$p" --verbose --timeout "$timeout" > "$log" 2>&1
      rc=$?
      grep -E 'largest|\[FAIL\]|EMU: |ERROR: |runtime error|Synthesis' "$log" | sed 's/^/   /'
    fi
    [ $rc = 0 ] || tail -5 "$log" | sed 's/^/   | /'
    echo "   rc=$rc ($((SECONDS - t0)) s, log: $log)"
    runs=$((runs + 1))
    [ $rc = 0 ] || failed=$((failed + 1))
  done
}
run_all normal
[ $stress = 0 ] || run_all stress EMU_PROTECT=1 EMU_SHUFFLE=1 EMU_JITTER_US=300
echo "cuda_emu: $((runs - failed)) of $runs runs passed"
[ $failed = 0 ]
