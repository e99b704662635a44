#!/usr/bin/env bash
# Checks and benchmarks Tessel's CUDA backend on a machine with an NVIDIA GPU,
# in one run (written for one H200 with 16 cores; about 8 minutes at most):
#
#   build     the tree with the CUDA runtime (skipped with TESSEL_BUILD=DIR)
#   kernels   tessel-cuda-kernel-tests: every CUDA kernel against its CPU
#             kernel (run directly: ctest would count its exit 77, no GPU,
#             as skipped, here it is a failure)
#   numerics  per-step loss, grad_norm and lr of --target cuda programs, fp32
#             and bf16, against the CPU reference program of the same spec
#             (gpt-tiny, llama-tiny, mixtral-tiny, GPT-2 124M at seq_len
#             256), compared by
#             bench/gpu/compare_losses.py; and each fp32 program's steps as
#             a CUDA graph (the default) against the same program launched
#             eagerly (TESSEL_CUDA_GRAPH=0), bitwise
#   bench     Tessel's training throughput and MFU in bf16: GPT-2 124M
#             (16 x 1024 tokens) and a 1.3B GPT (examples/gpt-1.3b.json, 8 x 2048),
#             each with its steps as a CUDA graph (the default) and again
#             launched eagerly (TESSEL_CUDA_GRAPH=0)
#   calibrate tessel calibrate --target cuda --quick on every GPU of the
#             node: the measured cluster description (cuBLASLt GEMM peaks,
#             attention, bandwidth, NCCL) for tessel simulate and plan,
#             kept as bench/gpu/calibrated.json (not with TESSEL_BUNDLE)
#   torch     the same models and batches in PyTorch eager (bench/gpu/torch_gpt.py)
#   compile   and with torch.compile, when at least COMPILE_MIN_S seconds remain
#
# and prints one markdown table with the PASS/FAIL/SKIP lines of the checks,
# also written to bench/gpu/results.md. Every Tessel program is compiled at
# the start, in parallel, while the kernel tests run; the CPU reference runs
# go beside the CUDA runs. Every command has a timeout.
#
# Usage, from anywhere:  bench/gpu/run.sh
#
# A GPU machine without the toolchain (no MLIR, no MPI or OpenBLAS
# development packages: a cluster's compute node, say) runs a bundle made
# where Tessel builds, in two steps:
#
#   PHASES=bundle BUNDLE=DIR bench/gpu/run.sh      (no GPU needed)
#       builds build/ when it has no CUDA runtime yet (PHASES=build,bundle
#       brings it up to date in any case; TESSEL_BUILD=DIR uses that build)
#       and writes DIR: programs/NAME (plan.json, spec/, the stripped bin/),
#       every CUDA program of the run compiled for CUDA_ARCH (default: the
#       GPU's, sm_90 without one); reference/NAME.jsonl, the CPU reference
#       programs of the numerics, run here for NUMERICS_STEPS steps;
#       bin/tessel-cuda-kernel-tests; bench/gpu/ (this script and its python),
#       the specs and test/e2e/torch_reference.py; lib/, the shared libraries
#       of those binaries that a CUDA machine may lack (every one but glibc's
#       and CUDA's; libstdc++, libgcc_s and libgomp go to lib/fallback/, used
#       only where the system has none); bundle.txt (the cases, steps, arch,
#       commit) and run.sh. Prints its size; BUNDLE_TAR=FILE.tar.xz also
#       packs it (tar cJf).
#   DIR/run.sh                                      (on the GPU machine)
#       is TESSEL_BUNDLE=DIR DIR/bench/gpu/run.sh: the phases kernels,
#       numerics, bench, torch and compile from the bundle, no build, no
#       compile; the same checks, table and exit statuses. Each program runs
#       directly, as tessel run runs one rank: bin/PROGRAM --steps N
#       --metrics FILE --progress lines, with LD_LIBRARY_PATH (for the
#       Tessel binaries only) DIR/lib and the directories of libcudart.so.13,
#       libcublasLt.so.13 and libnccl.so.2 (CUDA 13: /usr/local/cuda*, or
#       PyTorch's nvidia/*/lib wheels). The cases, NUMERICS_STEPS and
#       CUDA_ARCH are the bundle's (BATCH_* and SEQ_* too); RESULTS is taken
#       from the root of the run.sh started (DIR/run.sh: DIR/bench/gpu/).
#       TESSEL_BUNDLE=DIR bench/gpu/run.sh runs a bundle from the tree too.
#
# Environment (all optional):
#   TESSEL_BUILD=DIR       use this build of Tessel instead of building build/
#   PHASES=a,b,...         a subset of build,kernels,calibrate,numerics,bench,
#                          torch,compile
#                          (PHASES=build builds and stops, without a GPU too;
#                          PHASES=bundle makes a bundle, see above)
#   BUNDLE=DIR             where PHASES=bundle writes the bundle (replaced
#                          when it holds one; this, TESSEL_BUNDLE and
#                          BUNDLE_TAR are taken from the current directory)
#   TESSEL_BUNDLE=DIR      run this bundle instead of building and compiling
#   PYTHON=python3         the python with PyTorch (CUDA) for the baseline
#   TIME_BUDGET_S=460      the whole run, build included: every timeout is
#                          capped by the time left, and what no longer fits
#                          is reported as SKIP (the build itself is limited
#                          by BUILD_TIMEOUT_S=420 only; PHASES=bundle: 1800,
#                          each CPU reference run REFERENCE_TIMEOUT_S=600)
#   NUMERICS_STEPS=12      steps of each numerics run
#   FP32_RTOL=1e-4 FP32_GRAD_RTOL=1e-3                 fp32 tolerances
#   BF16_RTOL=2e-2 BF16_FIRST_RTOL=5e-3 BF16_GRAD_RTOL=5e-2   bf16 tolerances
#   WARMUP_STEPS=3 MEASURED_STEPS=10                   throughput runs
#   BATCH_124M=16 SEQ_124M=1024 BATCH_1B3=8 SEQ_1B3=2048
#   PEAK_TFLOPS=989        dense bf16 peak of the GPU for MFU (default: from
#                          the GPU's name, see peak_tflops_for)
#   CUDA_ARCH=sm_90        --cuda-arch (default: the GPU's compute capability)
#   COMPILE_MIN_S=120      torch.compile runs only with this much time left
#   COMPILE_TIMEOUT_S=240  each tessel compile
#   BENCH_LOGS=DIR         where logs, metrics and plans go (default: a new
#                          temporary directory, printed at the end)
#   RESULTS=FILE           default bench/gpu/results.md (relative paths are
#                          taken from the repository root)
#
# Exit status: 0 every check passed and every benchmark ran (torch.compile
# may have been skipped for time); 1 a check or a benchmark run failed; 2 the
# run could not start (no GPU, build failed, a bundle's library missing); 3
# nothing failed but a check or a benchmark was skipped because the time
# budget was spent. PHASES=bundle: 0 the bundle is complete; 1 a program did
# not compile or a CPU reference did not run (the bundle lacks it, and the
# GPU run reports it); 2 it could not start.
set -euo pipefail
CALLER_DIR=$(pwd) # BUNDLE, TESSEL_BUNDLE and BUNDLE_TAR are taken from here
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$(pwd -P)

START_TS=$(date +%s)
# MODE: "here" builds, compiles and runs on this machine; "make"
# (PHASES=bundle) makes a bundle for a GPU machine; "bundled"
# (TESSEL_BUNDLE=DIR) runs one.
MODE=here
if [[ -n ${TESSEL_BUNDLE:-} ]]; then
  MODE=bundled
  PHASES=${PHASES:-kernels,numerics,bench,torch,compile}
else
  PHASES=${PHASES:-build,kernels,calibrate,numerics,bench,torch,compile}
fi
PHASES=",${PHASES// /,},"
if [[ $PHASES == *,bundle,* && $MODE == here ]]; then
  MODE="make"
  TIME_BUDGET_S=${TIME_BUDGET_S:-1800}
fi
TIME_BUDGET_S=${TIME_BUDGET_S:-460}
RESERVE_S=${RESERVE_S:-15} # kept for the report
REFERENCE_TIMEOUT_S=${REFERENCE_TIMEOUT_S:-600}
NUMERICS_STEPS_GIVEN=${NUMERICS_STEPS:-}
PYTHON=${PYTHON:-python3}
NUMERICS_STEPS=${NUMERICS_STEPS:-12}
FP32_RTOL=${FP32_RTOL:-1e-4}
FP32_GRAD_RTOL=${FP32_GRAD_RTOL:-1e-3}
BF16_RTOL=${BF16_RTOL:-2e-2}
BF16_FIRST_RTOL=${BF16_FIRST_RTOL:-5e-3}
BF16_GRAD_RTOL=${BF16_GRAD_RTOL:-5e-2}
WARMUP_STEPS=${WARMUP_STEPS:-3}
MEASURED_STEPS=${MEASURED_STEPS:-10}
BATCH_124M=${BATCH_124M:-16}
SEQ_124M=${SEQ_124M:-1024}
BATCH_1B3=${BATCH_1B3:-8}
SEQ_1B3=${SEQ_1B3:-2048}
COMPILE_MIN_S=${COMPILE_MIN_S:-120}
BUILD_TIMEOUT_S=${BUILD_TIMEOUT_S:-420}
COMPILE_TIMEOUT_S=${COMPILE_TIMEOUT_S:-240}
RESULTS=${RESULTS:-bench/gpu/results.md}
if [[ $RESULTS != /* ]]; then RESULTS=$ROOT/$RESULTS; fi
NPROC=$(nproc)
CPU_THREADS=$(( NPROC > 4 ? NPROC - 2 : NPROC )) # leave cores to the CUDA runs beside them
if [[ $MODE == make ]]; then CPU_THREADS=$NPROC; fi # no CUDA runs beside them

LOGS=${BENCH_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/tessel-gpu-bench.XXXXXX")}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd -P)
rm -f "$LOGS"/*.status "$LOGS"/*.jsonl "$LOGS"/*.plan.json "$LOGS"/*.log "$LOGS/checks.txt" "$LOGS/results.md"
touch "$LOGS/checks.txt"
# Compiled programs are large (one binary each); they are not kept.
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/tessel-gpu-programs.XXXXXX")
BG_PIDS=() # background jobs of this script, stopped if it ends early
# shellcheck disable=SC2317 # called by the trap
cleanup() {
  local pid
  for pid in "${BG_PIDS[@]}"; do
    pkill -TERM -P "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
  done
  rm -rf "$SCRATCH"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ------------------------------------------------------------------ helpers

elapsed() { echo $(( $(date +%s) - START_TS )); }
time_left() { echo $(( TIME_BUDGET_S - $(elapsed) - RESERVE_S )); }
say() { printf '[%4ss] %s\n' "$(elapsed)" "$*"; }
die() {
  printf 'run.sh: error: %s\n' "$*" >&2
  exit 2
}
want() { [[ $PHASES == *",$1,"* ]]; }

# check_result PASS|FAIL|SKIP TEXT: one line of the report's checks.
check_result() {
  printf '%s %s\n' "$1" "$2" >>"$LOGS/checks.txt"
  say "$1 $2"
}

# outcome_of NAME [PROGRAM]: why the run NAME of a Tessel program (PROGRAM,
# default NAME) left no metrics: the first of the program's compile and the
# run's outcomes that is not "ok".
outcome_of() {
  local s
  for s in "${2:-$1}.compile" "$1.run"; do
    s=$(cat "$LOGS/$s.status" 2>/dev/null || echo "not run")
    if [[ $s != ok ]]; then echo "$s"; return; fi
  done
  echo "left no metrics"
}

# compare_metrics LABEL REFERENCE CANDIDATE TOLERANCES...: compare_losses.py's
# verdict on the candidate's per-step metrics, as a check line.
compare_metrics() {
  local label=$1 ref=$2 cand=$3 line
  shift 3
  line=$(python3 bench/gpu/compare_losses.py "$ref" "$cand" --steps "$NUMERICS_STEPS" \
    --name "$label" "$@" 2>&1 || true)
  if [[ $line == PASS\ * || $line == FAIL\ * ]]; then
    check_result "${line%% *}" "${line#* }"
  else
    check_result FAIL "$label: compare_losses.py failed: $line"
  fi
}

# run_logged NAME LIMIT_S CMD...: runs CMD with its output in $LOGS/NAME.log
# under a timeout of LIMIT_S seconds, capped by the time left unless
# NO_BUDGET=1. Writes a short outcome to $LOGS/NAME.status and prints the
# end of the log when CMD fails. Returns CMD's status (124: timed out,
# 200: skipped because the budget is spent).
run_logged() {
  local name=$1 limit=$2
  shift 2
  local logfile=$LOGS/$name.log left rc=0 t0 took
  if [[ ${NO_BUDGET:-0} != 1 ]]; then
    left=$(time_left)
    if (( left < limit )); then limit=$left; fi
  fi
  if (( limit < 5 )); then
    echo "skipped: the time budget (TIME_BUDGET_S=$TIME_BUDGET_S) is spent" >"$logfile"
    echo "skipped" >"$LOGS/$name.status"
    say "$name: SKIPPED (time budget spent)"
    return 200
  fi
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$logfile" 2>&1 || rc=$?
  took=$(( $(date +%s) - t0 ))
  if (( rc == 0 )); then
    echo "ok" >"$LOGS/$name.status"
    say "$name: ok (${took}s)"
  elif (( rc == 124 || rc == 137 )); then
    echo "timed out" >"$LOGS/$name.status"
    say "$name: TIMED OUT after ${limit}s; end of $logfile:"
    tail -n 12 "$logfile" | sed 's/^/    | /'
  else
    echo "failed (exit $rc)" >"$LOGS/$name.status"
    say "$name: FAILED (exit $rc, ${took}s); end of $logfile:"
    tail -n 20 "$logfile" | sed 's/^/    | /'
  fi
  return "$rc"
}

# plan_matches DIR TARGET PRECISION: the compiled plan is what was asked for
# (a bf16 check that silently ran fp32 would prove nothing).
plan_matches() {
  python3 - "$1/plan.json" "$2" "$3" <<'EOF'
import json, sys
plan = json.load(open(sys.argv[1]))
got = (plan.get("target"), plan.get("precision"))
if got != (sys.argv[2], sys.argv[3]):
    sys.exit("%s: target %s, precision %s; expected %s, %s"
             % (sys.argv[1], got[0], got[1], sys.argv[2], sys.argv[3]))
EOF
}

# tessel_compile NAME SPEC TARGET PRECISION [KEY=VALUE...]: compiles SPEC
# (with --set KEY=VALUE) into $SCRATCH/NAME and checks its plan.
tessel_compile() {
  local name=$1 spec=$2 target=$3 precision=$4
  shift 4
  local out=$SCRATCH/$name kv
  local args=(compile "$spec" -o "$out" --target="$target")
  if [[ $target == cuda ]]; then
    args+=(--cuda-arch="$CUDA_ARCH" --set "train.precision=\"$precision\"")
  fi
  for kv in "$@"; do args+=(--set "$kv"); done
  rm -rf "$out"
  run_logged "$name.compile" "$COMPILE_TIMEOUT_S" "$TESSEL" "${args[@]}" || return 1
  if ! plan_matches "$out" "$target" "$precision" >>"$LOGS/$name.compile.log" 2>&1; then
    echo "compiled the wrong plan" >"$LOGS/$name.compile.status"
    say "$name: $(tail -n 1 "$LOGS/$name.compile.log")"
    return 1
  fi
  cp "$out/plan.json" "$LOGS/$name.plan.json" # for the report's parameter count
}

# tessel_run NAME STEPS LIMIT_S: trains the program tessel_compile made (or
# the bundle's), writing one metrics line per step to $LOGS/NAME.jsonl.
tessel_run() {
  local name=$1 steps=$2 limit=$3 program=${4:-$1}
  local vars=("${@:5}")
  local out=$SCRATCH/$program
  [[ $(cat "$LOGS/$program.compile.status" 2>/dev/null) == ok ]] || return 1
  if [[ $MODE == bundled ]]; then
    # As tessel run runs one rank: the program itself, its OpenMP workers
    # asleep when idle.
    local binary
    out=$BUNDLE/programs/$program
    binary=$(plan_binary "$out") || return 1
    rm -f "$LOGS/$name.jsonl"
    run_logged "$name.run" "$limit" env LD_LIBRARY_PATH="$BUNDLE_LIBRARY_PATH" \
      OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" "${vars[@]}" "$out/$binary" \
      --steps "$steps" --metrics "$LOGS/$name.jsonl" --progress lines
    return
  fi
  local args=(run "$out" --steps "$steps" --metrics "$LOGS/$name.jsonl")
  if [[ $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["target"])' "$out/plan.json") == cpu ]]; then
    args+=(--threads "$CPU_THREADS")
  fi
  rm -f "$LOGS/$name.jsonl"
  run_logged "$name.run" "$limit" env "${vars[@]}" "$TESSEL" "${args[@]}"
}

# plan_binary DIR: the path, in DIR, of the one program of a one-rank plan
# on synthetic data: what a bundle carries and runs directly.
plan_binary() {
  python3 - "$1/plan.json" <<'EOF'
import json, sys
path = sys.argv[1]
plan = json.load(open(path))
programs = plan["programs"]
if plan.get("world_size") != 1 or len(programs) != 1:
    sys.exit("%s: %s ranks, %d programs; a bundle runs one-rank programs"
             % (path, plan.get("world_size"), len(programs)))
if plan.get("data", {}).get("format") != "synthetic":
    sys.exit("%s: data.format %s; a bundle carries no data, only synthetic tokens"
             % (path, plan.get("data", {}).get("format")))
(name, program), = programs.items()
print(program.get("binary", "bin/" + name))
EOF
}

# ------------------------------------------------------------------ bundles

# read_bundle: the cases, steps, arch and commit of $BUNDLE/bundle.txt.
read_bundle() {
  local file=$BUNDLE/bundle.txt line key value
  [[ -f $file ]] || die "TESSEL_BUNDLE=$TESSEL_BUNDLE has no bundle.txt: make a bundle with PHASES=bundle BUNDLE=DIR bench/gpu/run.sh"
  NUMERICS_CASES=()
  BENCH_CASES=()
  BUNDLE_COMMIT=unknown BUNDLE_MADE=unknown BUNDLE_ARCH="" BUNDLE_STEPS=""
  while IFS= read -r line; do
    if [[ -z $line || $line == \#* ]]; then continue; fi
    key=${line%%=*} value=${line#*=}
    case $key in
      format) [[ $value == 1 ]] || die "$file: format $value; this script reads format 1" ;;
      commit) BUNDLE_COMMIT=$value ;;
      made) BUNDLE_MADE=$value ;;
      cuda_arch) BUNDLE_ARCH=$value ;;
      numerics_steps) BUNDLE_STEPS=$value ;;
      numerics) NUMERICS_CASES+=("$value") ;;
      bench) BENCH_CASES+=("$value") ;;
      *) ;;
    esac
  done <"$file"
  [[ $BUNDLE_ARCH =~ ^sm_[0-9]+$ && $BUNDLE_STEPS =~ ^[0-9]+$ ]] ||
    die "$file: no cuda_arch=sm_NN or numerics_steps=N line"
}

# bundle_binaries: every executable of the bundle.
bundle_binaries() {
  local f
  for f in "$BUNDLE"/bin/* "$BUNDLE"/programs/*/bin/*; do
    if [[ -f $f && -x $f ]]; then echo "$f"; fi
  done
}

# cuda_library_dirs: where CUDA's libraries may be, in this order: the
# toolkit's (/usr/local/cuda, then /usr/local/cuda-*), then the nvidia/*/lib directories of
# python's site-packages (PyTorch's CUDA wheels: nvidia/cu13/lib,
# nvidia/nccl/lib).
cuda_library_dirs() {
  local d py
  for d in /usr/local/cuda/{lib64,lib,targets/*/lib} /usr/local/cuda-*/{lib64,lib,targets/*/lib}; do
    if [[ -d $d ]]; then echo "$d"; fi
  done
  for py in "$PYTHON" python3; do
    timeout 20 "$py" - 2>/dev/null <<'EOF' || true
import glob, os, site
roots = []
try:
    import nvidia
    roots += list(nvidia.__path__)
except ImportError:
    pass
try:
    roots += [os.path.join(p, "nvidia") for p in site.getsitepackages() + [site.getusersitepackages()]]
except AttributeError:  # an old virtualenv's site module
    pass
for root in roots:
    for d in sorted(glob.glob(os.path.join(root, "*", "lib"))):
        print(os.path.realpath(d))
EOF
  done
}

# missing_libraries: the libraries a bundle's binary needs that the dynamic
# linker does not find with LD_LIBRARY_PATH=$BUNDLE_LIBRARY_PATH.
missing_libraries() {
  local f out
  bundle_binaries | while IFS= read -r f; do
    if out=$(LD_LIBRARY_PATH=$BUNDLE_LIBRARY_PATH ldd "$f" 2>&1); then
      awk '$2 == "=>" && $3 == "not" { print $1 }' <<<"$out"
    else
      echo "(ldd ${f#"$BUNDLE/"}: $(tail -n 1 <<<"$out" | sed 's/^[[:space:]]*//'))"
    fi
  done | sort -u
}

# setup_bundle_libraries: BUNDLE_LIBRARY_PATH, the LD_LIBRARY_PATH of the
# bundle's binaries (of them only: lib/ holds the libraries of the machine
# that made the bundle, not for python or the system's programs): lib/,
# the directories of the CUDA 13 libraries they link, and for libstdc++,
# libgcc_s and libgomp, when the system has none, lib/fallback's. Stops
# the run (exit 2) when a library is still missing.
setup_bundle_libraries() {
  local dirs=("$BUNDLE/lib") candidates=() missing=() d lib found fallback
  mapfile -t candidates < <(cuda_library_dirs | awk '!seen[$0]++')
  for lib in libcudart.so.13 libcublasLt.so.13 libnccl.so.2; do
    found=""
    for d in "${candidates[@]}"; do
      if [[ -e $d/$lib ]]; then found=$d; break; fi
    done
    if [[ -n $found ]]; then
      say "bundle: $lib from $found"
      if [[ " ${dirs[*]} " != *" $found "* ]]; then dirs+=("$found"); fi
    else
      say "bundle: $lib is under neither /usr/local/cuda* nor python's nvidia/*/lib: left to the system's search path"
    fi
  done
  BUNDLE_LIBRARY_PATH=$(IFS=:; echo "${dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  mapfile -t missing < <(missing_libraries)
  if (( ${#missing[@]} > 0 )); then
    fallback=$LOGS/lib-fallback # links to the missing ones only, not to the others
    rm -rf "$fallback"
    mkdir -p "$fallback"
    for lib in "${missing[@]}"; do
      if [[ -f $BUNDLE/lib/fallback/$lib ]]; then
        ln -s "$BUNDLE/lib/fallback/$lib" "$fallback/$lib"
        say "bundle: $lib from the bundle's lib/fallback (the system has none)"
      fi
    done
    BUNDLE_LIBRARY_PATH=$fallback:$BUNDLE_LIBRARY_PATH
    mapfile -t missing < <(missing_libraries)
  fi
  if (( ${#missing[@]} > 0 )); then
    die "the bundle's binaries need ${missing[*]}, found nowhere (CUDA 13's come with the toolkit, /usr/local/cuda, or PyTorch's CUDA 13 wheels: nvidia-cuda-runtime, nvidia-cublas, nvidia-nccl-cu13)"
  fi
}

# bundle_program NAME TARGET PRECISION: the bundle's compiled NAME stands
# for tessel_compile's: its plan is checked and its outcome recorded alike.
bundle_program() {
  local name=$1 dir=$BUNDLE/programs/$1
  if [[ ! -f $dir/plan.json ]]; then
    echo "is not in the bundle" >"$LOGS/$name.compile.status"
    say "$name: not in the bundle (it did not compile when the bundle was made?)"
    return 1
  fi
  if ! { plan_matches "$dir" "$2" "$3" && plan_binary "$dir" >/dev/null; } >"$LOGS/$name.compile.log" 2>&1; then
    echo "compiled the wrong plan" >"$LOGS/$name.compile.status"
    say "$name: $(tail -n 1 "$LOGS/$name.compile.log")"
    return 1
  fi
  echo "ok" >"$LOGS/$name.compile.status"
  cp "$dir/plan.json" "$LOGS/$name.plan.json"
}

# bundle_libraries: "SONAME PATH" of every shared library the bundle's
# binaries load here, and "SONAME not" for those not found here (or for a
# binary ldd fails on).
bundle_libraries() {
  local f out
  bundle_binaries | while IFS= read -r f; do
    if out=$(ldd "$f" 2>&1); then
      awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 } $2 == "=>" && $3 == "not" { print $1, "not" }' <<<"$out"
    else
      echo "(ldd-failed-on-${f#"$BUNDLE/"}) not"
    fi
  done | sort -u
}

# make_bundle: runs the CPU references and writes $BUNDLE from the compiled
# programs (see the header). Returns 1 when a part is missing.
make_bundle() {
  local failed=0 p c name spec target binary f lib path status missing=() commit made
  say "bundle: the CPU references, $NUMERICS_STEPS steps each on $CPU_THREADS threads"
  for c in "${NUMERICS_CASES[@]}"; do
    IFS='|' read -r name _ <<<"$c"
    tessel_run "num-$name-cpu" "$NUMERICS_STEPS" "$REFERENCE_TIMEOUT_S" || true
  done
  if [[ -f $BUNDLE/bundle.txt ]]; then rm -rf "$BUNDLE"; fi
  mkdir -p "$BUNDLE"/{programs,reference,bin,lib/fallback,bench/gpu,test/e2e}

  for p in "${PROGRAMS[@]}"; do
    IFS='|' read -r name _ target _ <<<"$p"
    if [[ $target == cpu ]]; then
      # The reference's outcome goes with it: the GPU run reports it.
      for f in "$LOGS/$name".{compile,run}.{status,log}; do
        if [[ -f $f ]]; then cp "$f" "$BUNDLE/reference/"; fi
      done
      status=$(cat "$LOGS/$name.run.status" 2>/dev/null || true)
      if [[ $status == ok && -s $LOGS/$name.jsonl ]]; then
        cp "$LOGS/$name.jsonl" "$BUNDLE/reference/"
      else
        check_result FAIL "bundle: the CPU reference $name $(outcome_of "$name") (see $LOGS/$name.*.log)"
        failed=1
      fi
      continue
    fi
    if [[ $(cat "$LOGS/$name.compile.status" 2>/dev/null) != ok ]]; then
      check_result FAIL "bundle: $name $(outcome_of "$name") (see $LOGS/$name.compile.log)"
      failed=1
      continue
    fi
    if ! binary=$(plan_binary "$SCRATCH/$name" 2>>"$LOGS/$name.compile.log"); then
      check_result FAIL "bundle: $(tail -n 1 "$LOGS/$name.compile.log")"
      failed=1
      continue
    fi
    # plan.json, the spec and the binary; not the sources, IR and launchers.
    mkdir -p "$BUNDLE/programs/$name/bin"
    cp "$SCRATCH/$name/plan.json" "$BUNDLE/programs/$name/"
    if [[ -d $SCRATCH/$name/spec ]]; then cp -r "$SCRATCH/$name/spec" "$BUNDLE/programs/$name/"; fi
    cp "$SCRATCH/$name/$binary" "$BUNDLE/programs/$name/$binary"
  done
  cp "$KERNEL_TESTS" "$BUNDLE/bin/tessel-cuda-kernel-tests"

  if command -v strip >/dev/null; then
    bundle_binaries | while IFS= read -r f; do strip "$f"; done
  else
    say "bundle: no strip here; the binaries keep their symbols"
  fi
  # The plans name their binaries' SHA-256 (tessel run checks it): now the
  # stripped ones'.
  python3 - "$BUNDLE"/programs/*/plan.json <<'EOF'
import hashlib, json, os, sys
for path in sys.argv[1:]:
    if not os.path.isfile(path):
        continue
    with open(path) as f:
        plan = json.load(f)
    for name, program in plan["programs"].items():
        if "sha256" in program:
            binary = os.path.join(os.path.dirname(path), program.get("binary", "bin/" + name))
            with open(binary, "rb") as f:
                program["sha256"] = hashlib.sha256(f.read()).hexdigest()
    with open(path, "w") as f:
        json.dump(plan, f, indent=2)
        f.write("\n")
EOF

  # The binaries' shared libraries, but glibc's and CUDA's (the GPU machine
  # has its own: CUDA's must match its driver); the C++ and OpenMP runtimes
  # as a fallback only.
  while read -r lib path; do
    case $lib in
      libc.so.* | libm.so.* | libmvec.so.* | libpthread.so.* | libdl.so.* | librt.so.* | \
        libresolv.so.* | libutil.so.* | libanl.so.* | ld-linux*) ;;
      libcuda.so.* | libcudart.so.* | libcublas*.so.* | libnccl.so.*) ;;
      *)
        if [[ $path == not ]]; then
          missing+=("$lib")
        elif [[ $lib == libstdc++.so.* || $lib == libgcc_s.so.* || $lib == libgomp.so.* ]]; then
          cp -L "$path" "$BUNDLE/lib/fallback/$lib"
        else
          cp -L "$path" "$BUNDLE/lib/$lib"
        fi
        ;;
    esac
  done < <(bundle_libraries)
  if (( ${#missing[@]} > 0 )); then
    check_result FAIL "bundle: libraries not found here, so not in the bundle: ${missing[*]}"
    failed=1
  fi

  # The scripts and the specs, where they are in the tree (run.sh reads
  # them from the bundle's root; torch_gpt.py imports test/e2e's).
  cp bench/gpu/run.sh bench/gpu/*.py "$BUNDLE/bench/gpu/"
  cp test/e2e/torch_reference.py "$BUNDLE/test/e2e/"
  for c in "${NUMERICS_CASES[@]}" "${BENCH_CASES[@]}"; do
    IFS='|' read -r _ spec _ <<<"$c"
    mkdir -p "$BUNDLE/$(dirname "$spec")"
    cp "$spec" "$BUNDLE/$spec"
  done

  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  if [[ $commit != unknown ]] && ! git diff --quiet HEAD -- 2>/dev/null; then
    commit+=" with local changes"
  fi
  made=$(date -u +%Y-%m-%dT%H:%MZ)
  {
    echo "# A bundle of Tessel's CUDA checks and benchmarks, made by"
    echo "# PHASES=bundle BUNDLE=DIR bench/gpu/run.sh; DIR/run.sh runs it."
    echo "format=1"
    echo "commit=$commit"
    echo "made=$made"
    echo "cuda_arch=$CUDA_ARCH"
    echo "numerics_steps=$NUMERICS_STEPS"
    printf 'numerics=%s\n' "${NUMERICS_CASES[@]}"
    printf 'bench=%s\n' "${BENCH_CASES[@]}"
  } >"$BUNDLE/bundle.txt"
  cat >"$BUNDLE/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs the CUDA checks and benchmarks of this bundle on a machine with an
# NVIDIA GPU, without building or compiling: TESSEL_BUNDLE=<this directory>
# bench/gpu/run.sh. The bundle was made by PHASES=bundle BUNDLE=DIR
# bench/gpu/run.sh (bundle.txt says from which commit); bench/gpu/run.sh's
# header lists the environment it reads. The report goes to
# bench/gpu/results.md here.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
TESSEL_BUNDLE=$here exec "$here/bench/gpu/run.sh" "$@"
EOF
  chmod +x "$BUNDLE/run.sh" "$BUNDLE/bench/gpu/run.sh"

  say "bundle: $BUNDLE, $(du -sh "$BUNDLE" | cut -f1) (programs $(du -sh "$BUNDLE/programs" | cut -f1), bin $(du -sh "$BUNDLE/bin" | cut -f1), lib $(du -sh "$BUNDLE/lib" | cut -f1))"
  if [[ -n ${BUNDLE_TAR:-} ]]; then
    if NO_BUDGET=1 run_logged bundle.tar 600 tar cJf "$BUNDLE_TAR" -C "$(dirname "$BUNDLE")" "$(basename "$BUNDLE")"; then
      say "bundle: packed into $BUNDLE_TAR, $(du -sh "$BUNDLE_TAR" | cut -f1)"
    else
      check_result FAIL "bundle: tar cJf $BUNDLE_TAR failed (see $LOGS/bundle.tar.log)"
      failed=1
    fi
  fi
  say "bundle: on the GPU machine, $(basename "$BUNDLE")/run.sh"
  return "$failed"
}

# peak_tflops_for NAME: dense (no sparsity) bf16 tensor-core peak in TFLOP/s
# from the vendors' datasheets, SXM parts at their boost clock. Empty when
# unknown (then PEAK_TFLOPS must be given for MFU).
peak_tflops_for() {
  case $1 in
    *H200*) echo 989 ;; # also GH200
    *H100*PCIe*) echo 756 ;;
    *H100*NVL*) echo 835 ;;
    *H100* | *H800*) echo 989 ;;
    *B200*) echo 2250 ;;
    *A100* | *A800*) echo 312 ;;
    *L40S*) echo 362 ;;
    *) echo "" ;;
  esac
}

# ------------------------------------------------------------------ the mode

# abs_path PATH: PATH taken from the directory the script was started in.
abs_path() {
  if [[ $1 == /* ]]; then echo "$1"; else echo "$CALLER_DIR/$1"; fi
}

if [[ $MODE == bundled ]]; then
  if want bundle; then die "PHASES=bundle makes a bundle and TESSEL_BUNDLE runs one: not both"; fi
  if [[ $PHASES == ",build," ]]; then die "TESSEL_BUNDLE=$TESSEL_BUNDLE: a bundle has nothing to build"; fi
  BUNDLE=$(cd "$(abs_path "$TESSEL_BUNDLE")" 2>/dev/null && pwd -P) || die "TESSEL_BUNDLE=$TESSEL_BUNDLE is not a directory"
  read_bundle
  if [[ -n $NUMERICS_STEPS_GIVEN && $NUMERICS_STEPS_GIVEN != "$BUNDLE_STEPS" ]]; then
    die "NUMERICS_STEPS=$NUMERICS_STEPS_GIVEN, but the bundle's CPU references ran $BUNDLE_STEPS steps"
  fi
  NUMERICS_STEPS=$BUNDLE_STEPS
  if [[ -n ${CUDA_ARCH:-} && $CUDA_ARCH != "$BUNDLE_ARCH" ]]; then
    die "CUDA_ARCH=$CUDA_ARCH, but the bundle was compiled for $BUNDLE_ARCH"
  fi
  # The specs and scripts are the bundle's, relative to its root.
  cd "$BUNDLE"
elif [[ $MODE == make ]]; then
  if [[ ! $PHASES =~ ^,(build,)?bundle,(build,)?$ ]]; then
    die "PHASES=bundle is a run of its own (PHASES=build,bundle builds first); the other phases run the bundle on the GPU machine"
  fi
  [[ -n ${BUNDLE:-} ]] || die "PHASES=bundle needs BUNDLE=DIR, where the bundle goes"
  BUNDLE=$(abs_path "$BUNDLE")
  if [[ -e $BUNDLE && ! -d $BUNDLE ]]; then die "BUNDLE=$BUNDLE is not a directory"; fi
  if [[ -d $BUNDLE && -n $(ls -A "$BUNDLE") &&
    $(head -n 1 "$BUNDLE/bundle.txt" 2>/dev/null || true) != "# A bundle of Tessel's"* ]]; then
    die "BUNDLE=$BUNDLE holds files and no bundle: give an empty or a new directory"
  fi
  mkdir -p "$BUNDLE"
  BUNDLE=$(cd "$BUNDLE" && pwd -P)
  if [[ $BUNDLE == "$ROOT" ]]; then die "BUNDLE=$BUNDLE is the source tree"; fi
  if [[ -n ${BUNDLE_TAR:-} ]]; then BUNDLE_TAR=$(abs_path "$BUNDLE_TAR"); fi
fi

# ------------------------------------------------------------------ the GPU

GPU_NAME=""
if command -v nvidia-smi >/dev/null && GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) && [[ -n $GPU_NAME ]]; then
  say "GPU: $GPU_NAME ($(nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader | head -n 1))"
elif [[ $PHASES != ",build," && $MODE != make ]]; then
  die "no NVIDIA GPU visible (nvidia-smi missing or lists none); this script checks the CUDA backend on a GPU machine"
fi
GPU_ARCH=""
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true)
if [[ $cap =~ ^([0-9]+)\.([0-9]+)$ ]]; then
  GPU_ARCH=sm_${BASH_REMATCH[1]}${BASH_REMATCH[2]}
fi
if [[ $MODE == bundled ]]; then
  CUDA_ARCH=$BUNDLE_ARCH
  if [[ -n $GPU_ARCH && $GPU_ARCH != "$CUDA_ARCH" ]]; then
    say "warning: the bundle was compiled for $CUDA_ARCH, this GPU is $GPU_ARCH: its kernels may not load"
  fi
elif [[ -z ${CUDA_ARCH:-} ]]; then
  CUDA_ARCH=${GPU_ARCH:-sm_90}
fi
[[ $CUDA_ARCH =~ ^sm_[0-9]+$ ]] || die "CUDA_ARCH=$CUDA_ARCH: expected sm_NN, e.g. sm_90"
PEAK_SOURCE="PEAK_TFLOPS"
if [[ -n ${PEAK_TFLOPS:-} && ! $PEAK_TFLOPS =~ ^[0-9]+([.][0-9]+)?$ ]]; then
  die "PEAK_TFLOPS=$PEAK_TFLOPS: expected a number of TFLOP/s, e.g. 989"
fi
if [[ -z ${PEAK_TFLOPS:-} ]]; then
  PEAK_TFLOPS=$(peak_tflops_for "$GPU_NAME")
  PEAK_SOURCE="datasheet value for this GPU"
fi
say "target --cuda-arch=$CUDA_ARCH; bf16 dense peak ${PEAK_TFLOPS:-unknown} TFLOP/s; logs in $LOGS"

# ------------------------------------------------------------------ build

if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

# find_kernel_tests BUILD: the kernel tests' binary in a build, if any.
find_kernel_tests() {
  local candidate
  for candidate in "$1/bin/tessel-cuda-kernel-tests" "$1/unittests/tessel-cuda-kernel-tests"; do
    if [[ -x $candidate ]]; then
      echo "$candidate"
      return
    fi
  done
  find "$1" -name tessel-cuda-kernel-tests -type f -perm -u+x -print -quit 2>/dev/null || true
}

if [[ $MODE == bundled ]]; then
  BUILD="" TESSEL=""
  say "bundle: $BUNDLE (commit $BUNDLE_COMMIT, made $BUNDLE_MADE): no build, no compile"
elif [[ -n ${TESSEL_BUILD:-} ]]; then
  BUILD=$(cd "$TESSEL_BUILD" 2>/dev/null && pwd -P) || die "TESSEL_BUILD=$TESSEL_BUILD is not a directory"
  say "build: using $BUILD"
else
  BUILD=$ROOT/build
  # PHASES=bundle builds a tree that has no CUDA runtime yet (PHASES=build,bundle any tree).
  if want build || { [[ $MODE == make ]] && [[ ! -x $BUILD/bin/tessel || -z $(find_kernel_tests "$BUILD") ]]; }; then
    for tool in cmake ninja nvcc; do
      command -v "$tool" >/dev/null ||
        die "$tool not found: the build needs cmake, ninja, the CUDA toolkit (/usr/local/cuda) and MLIR 22 (scripts/setup.sh lists every package)"
    done
    configure=(cmake -G Ninja -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTESSEL_CUDA=ON)
    need_configure=1
    if [[ -f $BUILD/CMakeCache.txt ]]; then
      home=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
      if [[ $(cd "$home" 2>/dev/null && pwd -P) != "$ROOT" ]]; then
        die "build/ was configured for another source tree ($home): remove it, or set TESSEL_BUILD to a build of this tree"
      fi
      # A tree configured without the CUDA runtime (TESSEL_CUDA off, or no
      # nvcc found then) is configured again, naming nvcc: CMake keeps a
      # compiler it did not find as NOTFOUND otherwise.
      if [[ -f $BUILD/build.ninja ]] && ! grep -q '^TESSEL_CUDA:BOOL=OFF' "$BUILD/CMakeCache.txt" &&
        grep -q '^CMAKE_CUDA_COMPILER:[A-Z]*=/' "$BUILD/CMakeCache.txt"; then
        need_configure=0
      else
        configure+=("-DCMAKE_CUDA_COMPILER=$(command -v nvcc)")
      fi
    else
      configure+=("-DTESSEL_CUDA_ARCHITECTURES=${CUDA_ARCH#sm_}")
    fi
    if (( need_configure )); then
      if ! NO_BUDGET=1 run_logged build.configure 300 "${configure[@]}"; then
        if grep -qi 'mlir' "$LOGS/build.configure.log"; then
          die "configure failed and mentions MLIR: is MLIR 22 installed (libmlir-22-dev, mlir-22-tools)? see $LOGS/build.configure.log"
        fi
        die "configure failed: see $LOGS/build.configure.log"
      fi
    fi
    NO_BUDGET=1 run_logged build.ninja "$BUILD_TIMEOUT_S" ninja -C "$BUILD" -j"$NPROC" ||
      die "the build failed: see $LOGS/build.ninja.log"
    cuda_line=$(grep -h 'CUDA runtime:' "$LOGS"/build.*.log 2>/dev/null | tail -n 1 || true)
    if [[ -n $cuda_line ]]; then say "build: ${cuda_line#-- }"; fi
  fi
fi
if [[ $MODE == bundled ]]; then
  KERNEL_TESTS=$BUNDLE/bin/tessel-cuda-kernel-tests
  [[ -x $KERNEL_TESTS ]] || die "the bundle has no bin/tessel-cuda-kernel-tests"
  setup_bundle_libraries
else
  TESSEL=$BUILD/bin/tessel
  [[ -x $TESSEL ]] || die "$TESSEL is missing: build the tree (PHASES with build) or set TESSEL_BUILD"
  KERNEL_TESTS=$(find_kernel_tests "$BUILD")
  if [[ -z $KERNEL_TESTS ]]; then
    why=$(grep -h 'CUDA runtime:' "$LOGS"/build.*.log 2>/dev/null | tail -n 1 || true)
    die "$BUILD has no CUDA runtime (no tessel-cuda-kernel-tests)${why:+: $why}; was nvcc found when it was configured?"
  fi
fi
if [[ $PHASES == ",build," ]]; then
  say "build done"
  exit 0
fi

# ------------------------------------------------------------------ programs

# A bundle's cases are those it was made with (read_bundle).
if [[ $MODE != bundled ]]; then
  # name | spec | --set overrides. GPT-2 124M runs at seq_len 256 and batch 4 so
  # the CPU reference takes seconds, and with 5 warmup steps instead of 700
  # so that the updates of the compared steps are not vanishingly small.
  NUMERICS_CASES=(
    "gpt-tiny|examples/gpt-tiny.json|"
    "llama-tiny|examples/llama-tiny.json|"
    "mixtral-tiny|examples/mixtral-tiny.json|"
    "gpt-tiny-unfused-dropout|examples/gpt-tiny.json|train.attention=unfused model.dropout=0.1 model.attention_dropout=0.1"
    "gpt2-124m-T256|examples/gpt2-124m.json|model.seq_len=256 train.global_batch=4 data.format=synthetic train.lr_schedule.warmup_steps=5"
  )
  # name | spec | batch | seq_len
  BENCH_CASES=(
    "gpt2-124m|examples/gpt2-124m.json|$BATCH_124M|$SEQ_124M"
    "gpt-1.3b|examples/gpt-1.3b.json|$BATCH_1B3|$SEQ_1B3"
  )
fi
BENCH_STEPS=$(( WARMUP_STEPS + MEASURED_STEPS ))

# Every program of the run: name | spec | target | precision | overrides.
# They compile at once (one compiler process each, on all the cores), while
# the kernel tests use the GPU. A bundle holds them compiled, but for the
# CPU references: it holds their metrics.
PROGRAMS=()
if want numerics || [[ $MODE == make ]]; then
  for c in "${NUMERICS_CASES[@]}"; do
    IFS='|' read -r name spec sets <<<"$c"
    if [[ $MODE != bundled ]]; then PROGRAMS+=("num-$name-cpu|$spec|cpu|fp32|$sets"); fi
    PROGRAMS+=("num-$name-cuda-fp32|$spec|cuda|fp32|$sets"
      "num-$name-cuda-bf16|$spec|cuda|bf16|$sets")
  done
fi
if want bench || [[ $MODE == make ]]; then
  for c in "${BENCH_CASES[@]}"; do
    IFS='|' read -r name spec batch seq <<<"$c"
    PROGRAMS+=("bench-$name-tessel|$spec|cuda|bf16|train.global_batch=$batch model.seq_len=$seq data.format=synthetic")
  done
fi
compile_pids=()
if [[ $MODE == bundled ]]; then
  for p in "${PROGRAMS[@]}"; do
    IFS='|' read -r name _ target precision _ <<<"$p"
    bundle_program "$name" "$target" "$precision" || true
  done
elif (( ${#PROGRAMS[@]} > 0 )); then
  say "compiling ${#PROGRAMS[@]} programs in the background"
  for p in "${PROGRAMS[@]}"; do
    IFS='|' read -r name spec target precision sets <<<"$p"
    read -r -a extra <<<"$sets"
    tessel_compile "$name" "$spec" "$target" "$precision" "${extra[@]}" &
    compile_pids+=("$!")
    BG_PIDS+=("$!")
  done
fi

if [[ $MODE == make ]]; then
  for pid in "${compile_pids[@]}"; do wait "$pid" || true; done
  BG_PIDS=()
  rc=0
  make_bundle || rc=$?
  failed=$(grep -c '^FAIL' "$LOGS/checks.txt" || true)
  say "bundle: $failed failed; logs in $LOGS"
  exit "$rc"
fi

# ------------------------------------------------------------------ kernels

if want kernels; then
  rc=0
  kernel_tests=("$KERNEL_TESTS")
  if [[ $MODE == bundled ]]; then kernel_tests=(env LD_LIBRARY_PATH="$BUNDLE_LIBRARY_PATH" "$KERNEL_TESTS"); fi
  run_logged kernels 150 "${kernel_tests[@]}" || rc=$?
  passed=$(grep -h '^\[  PASSED  \]' "$LOGS/kernels.log" | tail -n 1 || true)
  passed=${passed#\[  PASSED  \] }
  case $rc in
    0) check_result PASS "cuda kernel tests: ${passed:-passed}" ;;
    77) check_result FAIL "cuda kernel tests: exit 77, the tests see no CUDA device" ;;
    200) check_result SKIP "cuda kernel tests: time budget spent" ;;
    *)
      failed=$(grep -h '^\[  FAILED  \] [A-Za-z]' "$LOGS/kernels.log" | head -n 5 | sed 's/^\[  FAILED  \] //' | paste -sd ',' - || true)
      check_result FAIL "cuda kernel tests: $(cat "$LOGS/kernels.status")${failed:+; failed: $failed}"
      ;;
  esac
fi

# ---------------------------------------------------------------- calibrate

if want calibrate && [[ $MODE == here ]]; then
  rc=0
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  (( gpus >= 1 )) || gpus=1
  run_logged calibrate 120 "$TESSEL" calibrate --target cuda --ranks "$gpus" --quick \
    -o "$ROOT/bench/gpu/calibrated.json" || rc=$?
  line=$(grep -h '^calibrate: wrote' "$LOGS/calibrate.log" | tail -n 1 || true)
  case $rc in
    0) check_result PASS "calibrate: ${line#calibrate: wrote }" ;;
    200) check_result SKIP "calibrate: time budget spent" ;;
    *) check_result FAIL "calibrate: $(cat "$LOGS/calibrate.status")" ;;
  esac
fi

for pid in "${compile_pids[@]}"; do wait "$pid" || true; done
BG_PIDS=()

# ------------------------------------------------------------------ numerics

if want numerics; then
  cpu_pid=""
  if [[ $MODE == bundled ]]; then
    say "numerics: $NUMERICS_STEPS steps each, against the bundle's CPU references"
    # Their metrics, and their outcomes when they have none.
    for c in "${NUMERICS_CASES[@]}"; do
      IFS='|' read -r name _ <<<"$c"
      for f in "$BUNDLE/reference/num-$name-cpu".{jsonl,compile.status,run.status,compile.log,run.log}; do
        if [[ -f $f ]]; then cp "$f" "$LOGS/"; fi
      done
    done
  else
    say "numerics: $NUMERICS_STEPS steps each; CPU references on $CPU_THREADS threads beside the CUDA runs"
    # The CPU reference programs use the cores, the CUDA runs the GPU: both
    # go at once.
    (
      for c in "${NUMERICS_CASES[@]}"; do
        IFS='|' read -r name _ <<<"$c"
        tessel_run "num-$name-cpu" "$NUMERICS_STEPS" 200 || true
      done
    ) &
    cpu_pid=$!
    BG_PIDS+=("$cpu_pid")
  fi
  for c in "${NUMERICS_CASES[@]}"; do
    IFS='|' read -r name _ <<<"$c"
    for precision in fp32 bf16; do
      tessel_run "num-$name-cuda-$precision" "$NUMERICS_STEPS" 90 || true
    done
    # The fp32 program again with every kernel launched by the host: the
    # step as a CUDA graph must give the same bits.
    tessel_run "num-$name-cuda-fp32-eager" "$NUMERICS_STEPS" 90 "num-$name-cuda-fp32" TESSEL_CUDA_GRAPH=0 || true
  done
  if [[ -n $cpu_pid ]]; then wait "$cpu_pid" || true; fi
  BG_PIDS=()
  ref_what="the CPU reference"
  if [[ $MODE == bundled ]]; then ref_what="the bundle's CPU reference"; fi
  for c in "${NUMERICS_CASES[@]}"; do
    IFS='|' read -r name _ <<<"$c"
    ref=$LOGS/num-$name-cpu.jsonl
    for precision in fp32 bf16; do
      cand=$LOGS/num-$name-cuda-$precision.jsonl
      label="numerics $name $precision vs cpu"
      if [[ ! -s $ref ]]; then
        outcome=$(outcome_of "num-$name-cpu")
        if [[ $outcome == skipped ]]; then
          check_result SKIP "$label: $ref_what was skipped (time budget)"
        else
          check_result FAIL "$label: $ref_what $outcome (see $LOGS/num-$name-cpu.*.log)"
        fi
        continue
      fi
      if [[ ! -s $cand ]]; then
        outcome=$(outcome_of "num-$name-cuda-$precision")
        if [[ $outcome == skipped ]]; then
          check_result SKIP "$label: the CUDA run was skipped (time budget)"
        else
          check_result FAIL "$label: the CUDA program $outcome (see $LOGS/num-$name-cuda-$precision.*.log)"
        fi
        continue
      fi
      if [[ $precision == fp32 ]]; then
        tolerances=(--rtol "$FP32_RTOL" --grad-rtol "$FP32_GRAD_RTOL")
      else
        tolerances=(--rtol "$BF16_RTOL" --first-rtol "$BF16_FIRST_RTOL" --grad-rtol "$BF16_GRAD_RTOL")
      fi
      compare_metrics "$label" "$ref" "$cand" "${tolerances[@]}"
    done
    # Graph against eager launches: bitwise.
    graph=$LOGS/num-$name-cuda-fp32.jsonl
    eager=$LOGS/num-$name-cuda-fp32-eager.jsonl
    label="numerics $name fp32 CUDA graph vs eager launches"
    if [[ ! -s $graph ]]; then
      continue # reported above
    elif [[ ! -s $eager ]]; then
      outcome=$(outcome_of "num-$name-cuda-fp32-eager" "num-$name-cuda-fp32")
      if [[ $outcome == skipped ]]; then
        check_result SKIP "$label: the eager run was skipped (time budget)"
      else
        check_result FAIL "$label: the eager run $outcome (see $LOGS/num-$name-cuda-fp32-eager.run.log)"
      fi
    else
      compare_metrics "$label" "$eager" "$graph" --rtol 0 --grad-rtol 0
    fi
  done
fi

# ------------------------------------------------------------------ benchmarks

# tessel_bench_failed CASE RUN [SUFFIX [PROGRAM]]: the check line of a Tessel
# benchmark run that did not finish (SUFFIX says which variant it was).
tessel_bench_failed() {
  local name=$1 run=$2 suffix=${3:-} outcome
  outcome=$(outcome_of "$run" ${4:+"$4"})
  if [[ $outcome == skipped ]]; then
    check_result SKIP "benchmark $name: the Tessel run$suffix was skipped (time budget)"
  else
    check_result FAIL "benchmark $name: the Tessel program$suffix $outcome (see $LOGS/$run.*.log)"
  fi
}

if want bench; then
  for c in "${BENCH_CASES[@]}"; do
    IFS='|' read -r name _ <<<"$c"
    tessel_run "bench-$name-tessel" "$BENCH_STEPS" 240 ||
      tessel_bench_failed "$name" "bench-$name-tessel"
  done
  # The same programs with every kernel launched by the host each step
  # (no CUDA graph), for the table's comparison.
  for c in "${BENCH_CASES[@]}"; do
    IFS='|' read -r name _ <<<"$c"
    # (A program that did not compile has been reported above.)
    [[ $(cat "$LOGS/bench-$name-tessel.compile.status" 2>/dev/null) == ok ]] || continue
    tessel_run "bench-$name-tessel-eager" "$BENCH_STEPS" 240 "bench-$name-tessel" TESSEL_CUDA_GRAPH=0 ||
      tessel_bench_failed "$name" "bench-$name-tessel-eager" " without the CUDA graph" "bench-$name-tessel"
  done
fi

# torch_ready: PYTHON has PyTorch with a CUDA device (checked once; a
# missing baseline is a failed check).
TORCH_STATE=""
torch_ready() {
  if [[ -z $TORCH_STATE ]]; then
    if "$PYTHON" -c 'import torch, sys; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)' >"$LOGS/torch-check.log" 2>&1; then
      TORCH_STATE=ok
      say "$(tail -n 1 "$LOGS/torch-check.log")"
    else
      TORCH_STATE=missing
      check_result FAIL "PyTorch baseline: '$PYTHON' has no PyTorch with a CUDA device ($(tail -n 1 "$LOGS/torch-check.log"))"
    fi
  fi
  [[ $TORCH_STATE == ok ]]
}

if want torch && torch_ready; then
  for c in "${BENCH_CASES[@]}"; do
    IFS='|' read -r name spec batch seq <<<"$c"
    # A result printed before the process failed (or was stopped at exit) still counts.
    if ! run_logged "bench-$name-torch-eager" 200 "$PYTHON" bench/gpu/torch_gpt.py --spec "$spec" \
      --batch "$batch" --seq-len "$seq" --precision bf16 --warmup "$WARMUP_STEPS" --steps "$MEASURED_STEPS" &&
      ! grep -q '^{"mode": "eager".*"tokens_per_s"' "$LOGS/bench-$name-torch-eager.log"; then
      outcome=$(cat "$LOGS/bench-$name-torch-eager.status")
      if [[ $outcome == skipped ]]; then
        check_result SKIP "benchmark $name: PyTorch eager skipped (time budget)"
      else
        check_result FAIL "benchmark $name: PyTorch eager $outcome (see $LOGS/bench-$name-torch-eager.log)"
      fi
    fi
  done
fi

if want compile && torch_ready; then
  for c in "${BENCH_CASES[@]}"; do
    IFS='|' read -r name spec batch seq <<<"$c"
    left=$(time_left)
    if (( left < COMPILE_MIN_S )); then
      echo "skipped" >"$LOGS/bench-$name-torch-compiled.status"
      say "bench-$name-torch-compiled: SKIPPED (${left}s left, torch.compile needs COMPILE_MIN_S=$COMPILE_MIN_S)"
      continue
    fi
    # A failed or timed-out torch.compile is reported in the table, not as a
    # failed check: the eager baseline is the one the comparison rests on.
    run_logged "bench-$name-torch-compiled" 300 "$PYTHON" bench/gpu/torch_gpt.py --spec "$spec" \
      --batch "$batch" --seq-len "$seq" --precision bf16 --warmup "$WARMUP_STEPS" \
      --steps "$MEASURED_STEPS" --compile --no-eager || true
  done
fi

# ------------------------------------------------------------------ report

mkdir -p "$(dirname "$RESULTS")"
cases_arg=$(printf '%s\n' "${BENCH_CASES[@]}")
if [[ $MODE == bundled ]]; then
  COMMIT="$BUNDLE_COMMIT (bundle made $BUNDLE_MADE)"
else
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
LOGS=$LOGS GPU_NAME=$GPU_NAME PEAK_TFLOPS=${PEAK_TFLOPS:-} PEAK_SOURCE=$PEAK_SOURCE \
  WARMUP_STEPS=$WARMUP_STEPS MEASURED_STEPS=$MEASURED_STEPS CASES=$cases_arg COMMIT=$COMMIT \
  CUDA_ARCH=$CUDA_ARCH ELAPSED=$(elapsed) python3 - >"$LOGS/results.md" <<'EOF' ||
"""Renders the benchmark table and the check lines as markdown."""
import datetime
import json
import os
import statistics

env = os.environ
logs = env["LOGS"]
warmup = int(env["WARMUP_STEPS"])
peak = float(env["PEAK_TFLOPS"]) * 1e12 if env.get("PEAK_TFLOPS") else None


def spec_model(path, seq_len):
    with open(path) as f:
        m = dict(json.load(f)["model"])
    m["seq_len"] = seq_len
    m.setdefault("ffn_hidden", 4 * m["hidden"])
    m.setdefault("tie_embeddings", True)
    # The token table's rows: the vocabulary padded to vocab_pad_to_multiple.
    pad = m.get("vocab_pad_to_multiple", 1)
    m["vocab_size"] = (m["vocab_size"] + pad - 1) // pad * pad
    return m


def gpt_params(m):
    """Parameters of a gpt-family model: (all, those in matmuls)."""
    V, T, d, L, f = m["vocab_size"], m["seq_len"], m["hidden"], m["layers"], m["ffn_hidden"]
    layer = (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (2 * d) + (d * f + f) + (f * d + d)
    total = V * d + T * d + L * layer + 2 * d + (0 if m["tie_embeddings"] else V * d)
    # The position table (and an untied input embedding) are lookups, not matmuls.
    matmul = total - T * d - (0 if m["tie_embeddings"] else V * d)
    return total, matmul


def flops_per_token(m):
    """PaLM (Chowdhery et al. 2022, appendix B): 6 N + 12 L d T, N the matmul
    parameters, the attention term for the full (unmasked) score matrix."""
    return 6 * gpt_params(m)[1] + 12 * m["layers"] * m["hidden"] * m["seq_len"]


def status(name):
    try:
        with open(os.path.join(logs, name + ".status")) as f:
            return f.read().strip()
    except OSError:
        return "not run"


def tessel_tokens_per_s(name, run="tessel"):
    path = os.path.join(logs, "bench-%s-%s.jsonl" % (name, run))
    try:
        rows = [json.loads(l) for l in open(path) if l.strip()]
    except (OSError, ValueError):
        rows = []
    timed = [r["tokens_per_s"] for r in rows if r.get("step", -1) >= warmup]
    if timed:
        return statistics.median(timed), None
    for stage in ("run", "compile"):
        s = status("bench-%s-%s.%s" % (name, run if stage == "run" else "tessel", stage))
        if s not in ("ok", "not run"):
            return None, s
    return None, "no timed steps" if rows else "not run"


rows, notes = [], []


def torch_record(name, mode):
    path = os.path.join(logs, "bench-%s-torch-%s.log" % (name, mode))
    try:
        for line in open(path):
            if line.startswith("{"):
                r = json.loads(line)
                if r.get("mode") == mode:
                    if "error" in r or "tokens_per_s" not in r:
                        notes.append("%s: PyTorch %s failed: %s" % (name, mode, r.get("error", "no result")))
                        return None, "failed"
                    return r, None
    except (OSError, ValueError):
        pass
    return None, status("bench-%s-torch-%s" % (name, mode))


def tps(v, why):
    return "%.0f" % v if v is not None else (why or "n/a")


def mfu(v, fpt):
    return "%.1f%%" % (100 * v * fpt / peak) if (v is not None and peak) else "n/a"


for case in env["CASES"].splitlines():
    name, spec, batch, seq = case.split("|")
    m = spec_model(spec, int(seq))
    fpt = flops_per_token(m)
    total, matmul = gpt_params(m)
    t, t_why = tessel_tokens_per_s(name)
    g, g_why = tessel_tokens_per_s(name, "tessel-eager")
    e, e_why = torch_record(name, "eager")
    c, c_why = torch_record(name, "compiled")
    ev = e["tokens_per_s"] if e else None
    try:
        with open(os.path.join(logs, "bench-%s-tessel.plan.json" % name)) as f:
            planned = sum(p["parameters"] for p in json.load(f)["programs"].values())
        if planned != total:
            notes.append("%s: Tessel's plan has %d parameters, the formula %d" % (name, planned, total))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cv = c["tokens_per_s"] if c else None
    if e and e.get("params") != total:
        notes.append("%s: PyTorch counts %s parameters, the formula %d" % (name, e.get("params"), total))
    ratio = "%.2f" % (t / ev) if (t and ev) else "n/a"
    rows.append("| %s (%.2fB params, B=%s, T=%s) | bf16 | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        name, total / 1e9, batch, seq, tps(t, t_why), mfu(t, fpt), tps(g, g_why), tps(ev, e_why),
        mfu(ev, fpt), tps(cv, c_why), mfu(cv, fpt), ratio))
    if t and g:
        tokens = int(batch) * int(seq)
        notes.append("%s: Tessel's step %.1f ms as a CUDA graph, %.1f ms launched eagerly "
                     "(TESSEL_CUDA_GRAPH=0)" % (name, 1000 * tokens / t, 1000 * tokens / g))
    notes.append("%s: %.3g FLOPs per token (N = %d matmul parameters)" % (name, fpt, matmul))
    if e:
        notes.append("%s: PyTorch %s, %s, %s attention, peak memory %.1f GiB" % (
            name, e.get("torch"), e.get("optimizer"), e.get("attention"), e.get("peak_mem_gib", 0)))
    if c and c.get("first_step_s") is not None:
        notes.append("%s: torch.compile's first step (compilation) took %.0f s" % (name, c["first_step_s"]))

with open(os.path.join(logs, "checks.txt")) as f:
    checks = [l.rstrip("\n") for l in f if l.strip()]

peak_text = ("%s TFLOP/s (%s)" % (env["PEAK_TFLOPS"], env["PEAK_SOURCE"])
             if peak else "unknown (set PEAK_TFLOPS for MFU)")
out = []
out.append("## Tessel CUDA backend on %s" % (env["GPU_NAME"] or "an unknown GPU"))
out.append("")
out.append("`bench/gpu/run.sh`, %s, commit %s, --cuda-arch=%s, %s s in all." % (
    datetime.date.today().isoformat(), env["COMMIT"], env["CUDA_ARCH"], env["ELAPSED"]))
out.append("Tokens/s: median over %s timed steps after %d warm-up steps. MFU = tokens/s x "
           "(6 N + 12 L d T) / peak, bf16 dense peak %s." % (env["MEASURED_STEPS"], warmup, peak_text))
out.append("")
out.append("| model | precision | Tessel tokens/s | Tessel MFU | Tessel without CUDA graph tokens/s | "
           "PyTorch eager tokens/s | PyTorch eager MFU | PyTorch compiled tokens/s | "
           "PyTorch compiled MFU | Tessel / eager |")
out.append("|---|---|---|---|---|---|---|---|---|---|")
out.extend(rows)
out.append("")
out.extend("- " + n for n in notes)
out.append("")
out.append("Checks:")
out.append("")
out.append("```")
out.extend(checks or ["(none ran)"])
out.append("```")
print("\n".join(out))
EOF
  {
    echo "run.sh: error: the report could not be written (above); the checks were:" >&2
    cat "$LOGS/checks.txt" >&2
    exit 1
  }
cp "$LOGS/results.md" "$RESULTS"

failed=$(grep -c '^FAIL' "$LOGS/checks.txt" || true)
skipped=$(grep -c '^SKIP' "$LOGS/checks.txt" || true)
echo
cat "$RESULTS"
echo
say "results in $RESULTS, logs in $LOGS: $failed failed, $skipped skipped"
if (( failed > 0 )); then exit 1; fi
if (( skipped > 0 )); then exit 3; fi
exit 0
