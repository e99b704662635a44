#!/bin/sh
# Runs a command against a one-node Slurm cluster of its own:
#   slurm_cluster.sh DIR COMMAND [ARG...]
# starts munged, slurmctld and slurmd (as root) with a configuration, a munge
# key and free ports of their own, waits until the node is idle, runs COMMAND
# with SLURM_CONF naming that configuration, then cancels the jobs COMMAND
# left and stops the daemons it started, by their process ids, whether
# COMMAND succeeded or not (and on SIGINT, SIGTERM, SIGHUP). Nothing in /etc
# or /run is read or changed. DIR (created) holds slurm.conf, the
# controller's state and the logs (DIR/log/*.log: a job can write its output
# there too); the sockets and the spool live in a short-named directory under
# TMPDIR (a socket's path has at most 107 bytes), removed at the end. Exits
# with COMMAND's status; when a daemon does not come up or COMMAND fails, it
# prints the end of each log. Needs Debian's slurm-wlm and munge.
set -eu

if [ $# -lt 2 ]; then
  echo "usage: slurm_cluster.sh DIR COMMAND [ARG...]" >&2
  exit 2
fi
mkdir -p "$1/state" "$1/log"
dir=$(cd "$1" && pwd)
shift
run=$(mktemp -d "${TMPDIR:-/tmp}/slurm.XXXXXX")
chmod 755 "$run"
mkdir -m 755 "$run/munge" "$run/spool"

pids=""
command=""
stop() {
  status=$?
  trap - EXIT INT TERM HUP
  set +e
  [ -n "$command" ] && kill "$command" 2>/dev/null
  if [ -n "$pids" ]; then
    # The jobs COMMAND left end before the daemons do.
    jobs=$(squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs" ]; then
      scancel $jobs 2>/dev/null
      for _ in $(seq 20); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.5
      done
    fi
    kill $pids 2>/dev/null
    for _ in $(seq 20); do
      alive=""
      for pid in $pids; do
        kill -0 "$pid" 2>/dev/null && alive="$alive $pid"
      done
      [ -z "$alive" ] && break
      sleep 0.5
    done
    [ -n "$alive" ] && kill -KILL $alive 2>/dev/null
    wait 2>/dev/null
  fi
  rm -rf "$run"
  if [ "$status" -ne 0 ]; then
    for log in "$dir"/log/*.log; do
      [ -f "$log" ] || continue
      echo "--- ${log##*/} (last lines)" >&2
      tail -n 30 "$log" >&2
    done
  fi
  exit "$status"
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# Two free TCP ports, for slurmctld and slurmd.
ports=$(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
ctld_port=${ports% *}
slurmd_port=${ports#* }
host=$(hostname -s)
# More CPUs than cores are fine (SlurmdParameters=config_overrides), so that
# jobs of up to 8 one-thread ranks fit on a small machine.
cpus=$(nproc)
[ "$cpus" -ge 8 ] || cpus=8

# Every client below (squeue and scancel in stop too) uses this cluster.
# sbatch --wait polls every 2 s while that is under MinJobAge / 2, then
# every 8 and 32 s: a short MinJobAge keeps a test's wait short.
cat >"$dir/slurm.conf" <<EOF
ClusterName=tessel-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$run/munge/socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=4
StateSaveLocation=$dir/state
SlurmdSpoolDir=$run/spool
SlurmctldPidFile=$run/slurmctld.pid
SlurmdPidFile=$run/slurmd.pid
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$dir/slurm.conf"

# munge: a key of its own; AuthInfo tells Slurm where its socket is.
dd if=/dev/urandom of="$run/munge/munge.key" bs=1024 count=1 2>/dev/null
chmod 400 "$run/munge/munge.key"
munged --foreground --force --key-file="$run/munge/munge.key" \
  --socket="$run/munge/socket" --pid-file="$run/munge/munged.pid" \
  --seed-file="$run/munge/seed" >"$dir/log/munged.log" 2>&1 &
pids="$pids $!"
for _ in $(seq 50); do
  [ -S "$run/munge/socket" ] && break
  sleep 0.1
done
if [ ! -S "$run/munge/socket" ]; then
  echo "slurm_cluster.sh: munged did not start" >&2
  exit 1
fi

# In the foreground (-D), logging to their standard error.
slurmctld -D -c -f "$SLURM_CONF" >"$dir/log/slurmctld.log" 2>&1 &
pids="$pids $!"
slurmd -D -f "$SLURM_CONF" -N "$host" >"$dir/log/slurmd.log" 2>&1 &
pids="$pids $!"

state=""
for _ in $(seq 60); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.5
done
if [ "$state" != idle ]; then
  echo "slurm_cluster.sh: node $host is not idle after 30 s" \
    "(state: ${state:-unknown})" >&2
  exit 1
fi

# In the background, so that a signal to this script stops it at once (the
# shell runs a trap only after a foreground command ends).
"$@" &
command=$!
set +e
wait "$command"
status=$?
command=""
exit "$status"
