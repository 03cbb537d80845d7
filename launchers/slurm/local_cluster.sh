#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, for tests and CI: munged + slurmctld + slurmd, no
# accounting, no cgroups, no systemd; config, state and logs under one directory.
#
#   launchers/slurm/local_cluster.sh start [DIR]   # prints `export SLURM_CONF=DIR/slurm.conf`
#   launchers/slurm/local_cluster.sh stop [DIR]    # waits for jobs, scontrol shutdown, then munged
#
# Needs root and Debian's packages (installed by CI, not here):
#   apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
# DIR defaults to /tmp/baton-slurm. Ports: SLURMCTLD_PORT (6817), SLURMD_PORT (6818).
# Every daemon is started in the foreground under nohup, and stopped by the pid recorded here.
set -euo pipefail
cmd="${1:-}" dir="${2:-/tmp/baton-slurm}"
conf="$dir/slurm.conf"

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_gone() {  # pidfile, seconds: wait for the process to exit, then SIGKILL it by pid
  local pidfile="$1" n=$(( $2 * 10 ))
  while alive "$pidfile" && [ "$n" -gt 0 ]; do sleep 0.1; n=$((n - 1)); done
  if alive "$pidfile"; then kill -9 "$(cat "$pidfile")" 2>/dev/null || true; fi
  rm -f "$pidfile"
}

start() {
  for bin in munged slurmctld slurmd sinfo; do
    command -v "$bin" >/dev/null || die "$bin not found: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
  done
  [ "$(id -u)" = 0 ] || die "must run as root (slurmd starts jobs as their users)"
  mkdir -p "$dir"/{ctld,d,log,run}
  # munged as the munge user, with its packaged key; reuse one that is already running.
  if ! pgrep -x munged >/dev/null; then
    [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key missing (the munge package creates it)"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do [ -S /run/munge/munge.socket.2 ] && break; sleep 0.1; done
    cp /run/munge/munged.pid "$dir/run/munged.pid"  # ours to stop
  fi
  cat > "$conf" <<CONF
ClusterName=baton-local
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
AuthType=auth/munge
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/d
SlurmctldPidFile=$dir/run/slurmctld.daemon.pid
SlurmdPidFile=$dir/run/slurmd.daemon.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
  export SLURM_CONF="$conf"
  alive "$dir/run/slurmctld.pid" || { nohup slurmctld -D -i -f "$conf" >"$dir/log/slurmctld.out" 2>&1 & echo $! > "$dir/run/slurmctld.pid"; }
  alive "$dir/run/slurmd.pid" || { nohup slurmd -D -N localhost -f "$conf" >"$dir/log/slurmd.out" 2>&1 & echo $! > "$dir/run/slurmd.pid"; }
  for _ in $(seq 300); do
    state="$(sinfo -h -n localhost -o %T 2>/dev/null || true)"
    case "$state" in idle*|mixed*|allocated*) echo "export SLURM_CONF=$conf"; return 0 ;; esac
    sleep 0.1
  done
  tail -n 20 "$dir"/log/*.log "$dir"/log/*.out >&2 || true
  die "the node did not come up (state: ${state:-none})"
}

stop() {
  [ -f "$conf" ] || exit 0
  export SLURM_CONF="$conf"
  if alive "$dir/run/slurmctld.pid"; then
    for _ in $(seq 600); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.1; done  # let jobs finish
    scontrol shutdown >/dev/null 2>&1 || true
  fi
  wait_gone "$dir/run/slurmd.pid" 15
  wait_gone "$dir/run/slurmctld.pid" 15
  if [ -f "$dir/run/munged.pid" ]; then  # last: the slurm daemons authenticate through it
    kill "$(cat "$dir/run/munged.pid")" 2>/dev/null || true
    wait_gone "$dir/run/munged.pid" 10
  fi
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop [DIR]" >&2; exit 2 ;;
esac
