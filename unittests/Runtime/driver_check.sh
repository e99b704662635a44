#!/bin/sh
# Usage: driver_check.sh MPIEXEC ONE_RANK DP2 DP2_TP2 WORKDIR
# Runs the toy program on one rank, dp=2 and dp=2 tp=2 and checks that
# sharded initialisation, --init-from and --save-final reproduce the
# one-rank tensors bit for bit, and that every rank writes its report.
set -eu
mpiexec=$1 one=$2 dp2=$3 dp2tp2=$4 dir=$5
rm -rf "$dir" && mkdir -p "$dir"
"$one" --quiet --steps 0 --save-final "$dir/init1.safetensors"
"$one" --quiet --save-final "$dir/final1.safetensors"
"$mpiexec" -np 2 --oversubscribe --allow-run-as-root "$dp2" --quiet \
  --steps 0 --save-final "$dir/init2.safetensors"
"$mpiexec" -np 4 --oversubscribe --allow-run-as-root "$dp2tp2" --quiet \
  --steps 0 --save-final "$dir/init4.safetensors"
cmp "$dir/init1.safetensors" "$dir/init2.safetensors"
cmp "$dir/init1.safetensors" "$dir/init4.safetensors"
# Load the trained one-rank weights into the 4-rank layout and save them
# again without training: the same bytes come back.
"$one" --quiet --steps 0 --init-from "$dir/final1.safetensors" \
  --save-final "$dir/final1b.safetensors"
"$mpiexec" -np 4 --oversubscribe --allow-run-as-root "$dp2tp2" --quiet \
  --steps 0 --init-from "$dir/final1.safetensors" \
  --save-final "$dir/final4.safetensors"
cmp "$dir/final1b.safetensors" "$dir/final4.safetensors"
# Training on 4 ranks: a report per rank, step lines from rank 0 only.
"$mpiexec" -np 4 --oversubscribe --allow-run-as-root "$dp2tp2" \
  --comm-report "$dir/comm.json" --metrics "$dir/metrics.jsonl" \
  >"$dir/out.txt"
for r in 0 1 2 3; do
  grep -q "\"rank\": $r, \"steps\": 3, \"collectives\": {\"all_reduce\": {\"calls\": 9," \
    "$dir/comm.rank$r.json"
done
test "$(grep -c '^step ' "$dir/out.txt")" = 3
test "$(wc -l <"$dir/metrics.jsonl")" = 3
echo "driver check passed"
