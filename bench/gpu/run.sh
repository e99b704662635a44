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
#             (gpt-tiny, llama-tiny, GPT-2 124M at seq_len 256), compared by
#             bench/gpu/compare_losses.py
#   bench     Tessel's training throughput and MFU in bf16: GPT-2 124M
#             (16 x 1024 tokens) and a 1.3B GPT (examples/gpt-1.3b.json, 8 x 2048)
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
# Environment (all optional):
#   TESSEL_BUILD=DIR       use this build of Tessel instead of building build/
#   PHASES=a,b,...         a subset of build,kernels,numerics,bench,torch,compile
#                          (PHASES=build builds and stops, without a GPU too)
#   PYTHON=python3         the python with PyTorch (CUDA) for the baseline
#   TIME_BUDGET_S=460      the whole run, build included: every timeout is
#                          capped by the time left, and what no longer fits
#                          is reported as SKIP (the build itself is limited
#                          by BUILD_TIMEOUT_S=420 only)
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
# run could not start (no GPU, build failed); 3 nothing failed but a check or
# a benchmark was skipped because the time budget was spent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$(pwd -P)

START_TS=$(date +%s)
TIME_BUDGET_S=${TIME_BUDGET_S:-460}
RESERVE_S=${RESERVE_S:-15} # kept for the report
PHASES=${PHASES:-build,kernels,numerics,bench,torch,compile}
PHASES=",${PHASES// /,},"
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
NPROC=$(nproc)
CPU_THREADS=$(( NPROC > 4 ? NPROC - 2 : NPROC )) # leave cores to the CUDA runs beside them

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

# outcome_of NAME: why a Tessel program left no metrics: the first of its
# compile and run outcomes that is not "ok".
outcome_of() {
  local stage s
  for stage in compile run; do
    s=$(cat "$LOGS/$1.$stage.status" 2>/dev/null || echo "not run")
    if [[ $s != ok ]]; then echo "$s"; return; fi
  done
  echo "left no metrics"
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

# tessel_run NAME STEPS LIMIT_S: trains the program tessel_compile made,
# writing one metrics line per step to $LOGS/NAME.jsonl.
tessel_run() {
  local name=$1 steps=$2 limit=$3
  local out=$SCRATCH/$name
  [[ $(cat "$LOGS/$name.compile.status" 2>/dev/null) == ok ]] || return 1
  local args=(run "$out" --steps "$steps" --metrics "$LOGS/$name.jsonl")
  if [[ $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["target"])' "$out/plan.json") == cpu ]]; then
    args+=(--threads "$CPU_THREADS")
  fi
  rm -f "$LOGS/$name.jsonl"
  run_logged "$name.run" "$limit" "$TESSEL" "${args[@]}"
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

# ------------------------------------------------------------------ the GPU

GPU_NAME=""
if command -v nvidia-smi >/dev/null && GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) && [[ -n $GPU_NAME ]]; then
  say "GPU: $GPU_NAME ($(nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader | head -n 1))"
elif [[ $PHASES != ",build," ]]; then
  die "no NVIDIA GPU visible (nvidia-smi missing or lists none); this script checks the CUDA backend on a GPU machine"
fi
if [[ -z ${CUDA_ARCH:-} ]]; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true)
  if [[ $cap =~ ^([0-9]+)\.([0-9]+)$ ]]; then
    CUDA_ARCH=sm_${BASH_REMATCH[1]}${BASH_REMATCH[2]}
  else
    CUDA_ARCH=sm_90
  fi
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

if [[ -n ${TESSEL_BUILD:-} ]]; then
  BUILD=$(cd "$TESSEL_BUILD" 2>/dev/null && pwd -P) || die "TESSEL_BUILD=$TESSEL_BUILD is not a directory"
  say "build: using $BUILD"
else
  BUILD=$ROOT/build
  if want build; then
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
TESSEL=$BUILD/bin/tessel
[[ -x $TESSEL ]] || die "$TESSEL is missing: build the tree (PHASES with build) or set TESSEL_BUILD"

KERNEL_TESTS=""
for candidate in "$BUILD/bin/tessel-cuda-kernel-tests" "$BUILD/unittests/tessel-cuda-kernel-tests"; do
  if [[ -x $candidate ]]; then KERNEL_TESTS=$candidate; break; fi
done
if [[ -z $KERNEL_TESTS ]]; then
  KERNEL_TESTS=$(find "$BUILD" -name tessel-cuda-kernel-tests -type f -perm -u+x -print -quit 2>/dev/null || true)
fi
if [[ -z $KERNEL_TESTS ]]; then
  why=$(grep -h 'CUDA runtime:' "$LOGS"/build.*.log 2>/dev/null | tail -n 1 || true)
  die "$BUILD has no CUDA runtime (no tessel-cuda-kernel-tests)${why:+: $why}; was nvcc found when it was configured?"
fi
if [[ $PHASES == ",build," ]]; then
  say "build done"
  exit 0
fi

# ------------------------------------------------------------------ programs

# name | spec | --set overrides. GPT-2 124M runs at seq_len 256 and batch 4 so
# the CPU reference takes seconds, and with 5 warmup steps instead of 700
# so that the updates of the compared steps are not vanishingly small.
NUMERICS_CASES=(
  "gpt-tiny|examples/gpt-tiny.json|"
  "llama-tiny|examples/llama-tiny.json|"
  "gpt2-124m-T256|examples/gpt2-124m.json|model.seq_len=256 train.global_batch=4 data.format=synthetic train.lr_schedule.warmup_steps=5"
)
# name | spec | batch | seq_len
BENCH_CASES=(
  "gpt2-124m|examples/gpt2-124m.json|$BATCH_124M|$SEQ_124M"
  "gpt-1.3b|examples/gpt-1.3b.json|$BATCH_1B3|$SEQ_1B3"
)
BENCH_STEPS=$(( WARMUP_STEPS + MEASURED_STEPS ))

# Every program of the run: name | spec | target | precision | overrides.
# They compile at once (one compiler process each, on all the cores), while
# the kernel tests use the GPU.
PROGRAMS=()
if want numerics; then
  for c in "${NUMERICS_CASES[@]}"; do
    IFS='|' read -r name spec sets <<<"$c"
    PROGRAMS+=("num-$name-cpu|$spec|cpu|fp32|$sets"
      "num-$name-cuda-fp32|$spec|cuda|fp32|$sets"
      "num-$name-cuda-bf16|$spec|cuda|bf16|$sets")
  done
fi
if want bench; then
  for c in "${BENCH_CASES[@]}"; do
    IFS='|' read -r name spec batch seq <<<"$c"
    PROGRAMS+=("bench-$name-tessel|$spec|cuda|bf16|train.global_batch=$batch model.seq_len=$seq data.format=synthetic")
  done
fi
compile_pids=()
if (( ${#PROGRAMS[@]} > 0 )); then
  say "compiling ${#PROGRAMS[@]} programs in the background"
  for p in "${PROGRAMS[@]}"; do
    IFS='|' read -r name spec target precision sets <<<"$p"
    read -r -a extra <<<"$sets"
    tessel_compile "$name" "$spec" "$target" "$precision" "${extra[@]}" &
    compile_pids+=("$!")
    BG_PIDS+=("$!")
  done
fi

# ------------------------------------------------------------------ kernels

if want kernels; then
  rc=0
  run_logged kernels 150 "$KERNEL_TESTS" || rc=$?
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

for pid in "${compile_pids[@]}"; do wait "$pid" || true; done
BG_PIDS=()

# ------------------------------------------------------------------ numerics

if want numerics; then
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
  for c in "${NUMERICS_CASES[@]}"; do
    IFS='|' read -r name _ <<<"$c"
    for precision in fp32 bf16; do
      tessel_run "num-$name-cuda-$precision" "$NUMERICS_STEPS" 90 || true
    done
  done
  wait "$cpu_pid" || true
  BG_PIDS=()
  for c in "${NUMERICS_CASES[@]}"; do
    IFS='|' read -r name _ <<<"$c"
    ref=$LOGS/num-$name-cpu.jsonl
    for precision in fp32 bf16; do
      cand=$LOGS/num-$name-cuda-$precision.jsonl
      label="numerics $name $precision vs cpu"
      if [[ ! -s $ref ]]; then
        outcome=$(outcome_of "num-$name-cpu")
        if [[ $outcome == skipped ]]; then
          check_result SKIP "$label: the CPU reference was skipped (time budget)"
        else
          check_result FAIL "$label: the CPU reference $outcome (see $LOGS/num-$name-cpu.*.log)"
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
      line=$(python3 bench/gpu/compare_losses.py "$ref" "$cand" --steps "$NUMERICS_STEPS" \
        --name "$label" "${tolerances[@]}" 2>&1 || true)
      if [[ $line == PASS\ * || $line == FAIL\ * ]]; then
        check_result "${line%% *}" "${line#* }"
      else
        check_result FAIL "$label: compare_losses.py failed: $line"
      fi
    done
  done
fi

# ------------------------------------------------------------------ benchmarks

if want bench; then
  for c in "${BENCH_CASES[@]}"; do
    IFS='|' read -r name _ <<<"$c"
    if ! tessel_run "bench-$name-tessel" "$BENCH_STEPS" 240; then
      outcome=$(outcome_of "bench-$name-tessel")
      if [[ $outcome == skipped ]]; then
        check_result SKIP "benchmark $name: the Tessel run was skipped (time budget)"
      else
        check_result FAIL "benchmark $name: the Tessel program $outcome (see $LOGS/bench-$name-tessel.*.log)"
      fi
    fi
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
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
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


def tessel_tokens_per_s(name):
    path = os.path.join(logs, "bench-%s-tessel.jsonl" % name)
    try:
        rows = [json.loads(l) for l in open(path) if l.strip()]
    except (OSError, ValueError):
        rows = []
    timed = [r["tokens_per_s"] for r in rows if r.get("step", -1) >= warmup]
    if timed:
        return statistics.median(timed), None
    for stage in ("run", "compile"):
        s = status("bench-%s-tessel.%s" % (name, stage))
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
    rows.append("| %s (%.2fB params, B=%s, T=%s) | bf16 | %s | %s | %s | %s | %s | %s | %s |" % (
        name, total / 1e9, batch, seq, tps(t, t_why), mfu(t, fpt), tps(ev, e_why), mfu(ev, fpt),
        tps(cv, c_why), mfu(cv, fpt), ratio))
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
out.append("| model | precision | Tessel tokens/s | Tessel MFU | PyTorch eager tokens/s | "
           "PyTorch eager MFU | PyTorch compiled tokens/s | PyTorch compiled MFU | Tessel / eager |")
out.append("|---|---|---|---|---|---|---|---|---|")
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
