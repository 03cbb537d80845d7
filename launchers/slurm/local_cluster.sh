#!/usr/bin/env bash
# A SLURM cluster on this machine, for tests and CI: munged + slurmctld + slurmd, no accounting,
# no cgroups, no systemd; config, state and logs under one directory. One node on localhost, or
# several "nodes" in network namespaces (CLUSTER_NODES, below).
#
#   launchers/slurm/local_cluster.sh start [DIR]   # prints `export SLURM_CONF=DIR/slurm.conf`
#   launchers/slurm/local_cluster.sh stop [DIR]    # waits for jobs, scontrol shutdown, then munged
#
# CLUSTER_NODES="node0=198.18.0.1@NS0 node1=198.18.0.2@NS1": one slurmd per entry, NAME its node
# name and (unshare --uts) its host name, ADDR its NodeAddr, started inside network namespace NS
# (`ip netns exec`; the namespaces and their /etc/hosts are the caller's, see tests/netns.py).
# slurmctld runs on the first node, so clients (sbatch, squeue) must run in its namespace too.
# munged is shared: its socket is a file, which every namespace sees.
#
# Needs root and Debian's packages (installed by CI, not here):
#   apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
# DIR defaults to /tmp/baton-slurm. Ports: SLURMCTLD_PORT (6817), SLURMD_PORT (6818).
# Every daemon is started in the foreground under nohup, and stopped by the pid recorded here.
set -euo pipefail
cmd="${1:-}" dir="${2:-/tmp/baton-slurm}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
conf="$dir/slurm.conf"

# The nodes: names, addresses and namespaces (empty: this one); ctl runs a command where slurmctld is.
names=() addrs=() nss=()
for entry in ${CLUSTER_NODES:-localhost=127.0.0.1}; do
  [[ "$entry" =~ ^([^=@]+)=([^=@]+)(@(.+))?$ ]] || { echo "local_cluster.sh: bad CLUSTER_NODES entry $entry (NAME=ADDR[@NETNS])" >&2; exit 2; }
  names+=("${BASH_REMATCH[1]}") addrs+=("${BASH_REMATCH[2]}") nss+=("${BASH_REMATCH[4]}")
done
ctl=()
[ -z "${nss[0]}" ] || ctl=(ip netns exec "${nss[0]}")
on_node() {  # the words that run a daemon on node $1: in its namespace, under its host name
  [ -z "${nss[$1]}" ] || echo "$here/in_node.sh ${nss[$1]} ${names[$1]}"
}

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
  for n in "${names[@]}"; do mkdir -p "$dir/d/$n"; done
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
SlurmctldHost=${names[0]}(${addrs[0]})
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
AuthType=auth/munge
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/d/%n
SlurmctldPidFile=$dir/run/slurmctld.daemon.pid
SlurmdPidFile=$dir/run/slurmd.%n.daemon.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
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
$(for i in "${!names[@]}"; do echo "NodeName=${names[$i]} NodeAddr=${addrs[$i]} CPUs=$(nproc) State=UNKNOWN"; done)
PartitionName=local Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
  export SLURM_CONF="$conf"
  alive "$dir/run/slurmctld.pid" || {
    nohup $(on_node 0) slurmctld -D -i -f "$conf" >"$dir/log/slurmctld.out" 2>&1 &
    echo $! > "$dir/run/slurmctld.pid"
  }
  for i in "${!names[@]}"; do
    alive "$dir/run/slurmd.${names[$i]}.pid" || {
      nohup $(on_node "$i") slurmd -D -N "${names[$i]}" -f "$conf" >"$dir/log/slurmd.${names[$i]}.out" 2>&1 &
      echo $! > "$dir/run/slurmd.${names[$i]}.pid"
    }
  done
  for _ in $(seq 300); do  # every node up: idle (or already running a job)
    state="$("${ctl[@]}" sinfo -h -N -o %T 2>/dev/null | sort | uniq -c | tr -s ' \n' ' ' || true)"
    up="$("${ctl[@]}" sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated)' || true)"
    [ "$up" = "${#names[@]}" ] && { echo "export SLURM_CONF=$conf"; return 0; }
    sleep 0.1
  done
  tail -n 20 "$dir"/log/*.log "$dir"/log/*.out >&2 || true
  die "the nodes did not come up (states: ${state:-none})"
}

stop() {
  [ -f "$conf" ] || exit 0
  export SLURM_CONF="$conf"
  if alive "$dir/run/slurmctld.pid"; then
    for _ in $(seq 600); do [ -z "$("${ctl[@]}" squeue -h 2>/dev/null)" ] && break; sleep 0.1; done  # let jobs finish
    "${ctl[@]}" scontrol shutdown >/dev/null 2>&1 || true
  fi
  for n in "${names[@]}"; do wait_gone "$dir/run/slurmd.$n.pid" 15; done
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
