#!/bin/sh
# Usage: driver_pp_check.sh MPIEXEC ONE_RANK STAGE0 STAGE1 WORKDIR
# Runs the two pipeline stages MPMD and checks that --save-final writes one
# file with both stages' parameters, bit for bit what the one-rank program
# holding both saves (initial, trained and reloaded), that the data sent
# along pp arrives, that rank 0 alone prints and counts its sends, and that
# a send past the last stage fails clearly.
set -eu
mpiexec=$1 one=$2 s0=$3 s1=$4 dir=$5
mpi="$mpiexec --oversubscribe --allow-run-as-root"
rm -rf "$dir" && mkdir -p "$dir"
"$one" --quiet --steps 0 --save-final "$dir/init1.safetensors"
"$one" --quiet --save-final "$dir/final1.safetensors"
$mpi -np 1 "$s0" --quiet --steps 0 --save-final "$dir/init2.safetensors" : \
  -np 1 "$s1" --quiet --steps 0 --save-final "$dir/init2.safetensors"
cmp "$dir/init1.safetensors" "$dir/init2.safetensors"
grep -q '"a"' "$dir/init2.safetensors"
grep -q '"b"' "$dir/init2.safetensors"
# Training on both stages: same final weights, step lines and metrics from
# rank 0 only, the send counted in each rank's report.
$mpi -np 1 "$s0" --save-final "$dir/final2.safetensors" \
  --comm-report "$dir/comm.json" --metrics "$dir/metrics.jsonl" : \
  -np 1 "$s1" --save-final "$dir/final2.safetensors" \
  --comm-report "$dir/comm.json" --metrics "$dir/metrics.jsonl" \
  >"$dir/out.txt"
cat "$dir/out.txt"
cmp "$dir/final1.safetensors" "$dir/final2.safetensors"
grep -q '^driver-pp-check: 2 ranks (pp=2), 1 parameters in pipeline stage 0 (6 elements on rank 0)' "$dir/out.txt"
test "$(grep -c '^step ' "$dir/out.txt")" = 3
test "$(grep -c '^stage 1 received step ' "$dir/out.txt")" = 3
test "$(grep -c '^done: ' "$dir/out.txt")" = 1
test "$(wc -l <"$dir/metrics.jsonl")" = 3
for r in 0 1; do
  grep -q '"send_recv": {"calls": 3, "elements": 18, "bytes_sent": 72}' \
    "$dir/comm.rank$r.json"
  grep -q '"all_reduce": {"calls": 3, "elements": 3,' "$dir/comm.rank$r.json"
done
# Loading the trained one-rank weights into the stages and saving them
# again without training gives the same bytes.
"$one" --quiet --steps 0 --init-from "$dir/final1.safetensors" \
  --save-final "$dir/final1b.safetensors"
$mpi -np 1 "$s0" --quiet --steps 0 --init-from "$dir/final1.safetensors" \
  --save-final "$dir/final2b.safetensors" : \
  -np 1 "$s1" --quiet --steps 0 --init-from "$dir/final1.safetensors" \
  --save-final "$dir/final2b.safetensors"
cmp "$dir/final1b.safetensors" "$dir/final2b.safetensors"
# A send past either end of the pipeline is a clear error.
if TESSEL_PP_CHECK_BAD=1 "$one" --quiet 2>"$dir/bad1.txt"; then
  echo "a send on a one-rank mesh did not fail"; exit 1
fi
grep -q 'sendTo along pp with offset 1 from coordinate 0: no rank has coordinate 1 (pp size 1)' "$dir/bad1.txt"
if TESSEL_PP_CHECK_BAD=1 $mpi -x TESSEL_PP_CHECK_BAD -np 1 "$s0" --quiet : \
  -np 1 "$s1" --quiet >/dev/null 2>"$dir/bad2.txt"; then
  echo "a send past the last stage did not fail"; exit 1
fi
grep -q 'rank 1: error: sendTo along pp with offset 1 from coordinate 1: no rank has coordinate 2 (pp size 2)' "$dir/bad2.txt"
# The failing rank says where it ran: host, process id, mesh coordinates.
grep -q "^  (on $(hostname), pid [0-9][0-9]*, pp 1)$" "$dir/bad2.txt"
echo "driver pp check passed"
