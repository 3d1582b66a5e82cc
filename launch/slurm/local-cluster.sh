#!/usr/bin/env bash
# A two-node Slurm on this one machine, to try launch/slurm/train.sbatch without a cluster.
#   sudo launch/slurm/local-cluster.sh install   # Debian/Ubuntu: apt-get install slurmctld slurmd slurm-client
#   sudo launch/slurm/local-cluster.sh up        # prints the SLURM_CONF line to export, then sbatch/squeue/sinfo work
#   sudo launch/slurm/local-cluster.sh down
# The two "nodes" are two slurmd on separate ports, named `localhost` and this host's name (both
# must resolve, or torchrun's rendezvous on the first node cannot be reached), each with 1 CPU and
# 8 fake GPUs (gres on /dev/tty*), so a script asking for --gpus-per-node=8 runs unchanged.
# auth/none and cred/none: no munge daemon; fine on a laptop, never on a shared machine.
# Daemons run as root, started with setsid and stopped by their recorded pids; state, logs and
# spool live in $SLURM_LOCAL_DIR (default /tmp/rollpacker-slurm), wiped on every `up`.
set -euo pipefail
dir=${SLURM_LOCAL_DIR:-/tmp/rollpacker-slurm}
conf=$dir/slurm.conf
host=$(hostname -s)
nodes=("$host" localhost)

install() {
  [[ $EUID -eq 0 ]] || { echo "install needs root (apt-get)" >&2; exit 1; }
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client; }
}

write_conf() {
  local mem=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) / 3 ))
  mkdir -p "$dir"/{state,log,run}
  cat >"$conf" <<EOF
ClusterName=local
SlurmctldHost=$host
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
JobRequeue=1
KillWait=10
GresTypes=gpu
NodeName=${nodes[0]} NodeAddr=127.0.0.1 NodeHostname=$host Port=${SLURMD_PORT:-6818} CPUs=1 RealMemory=$mem Gres=gpu:8 State=UNKNOWN
NodeName=${nodes[1]} NodeAddr=127.0.0.1 NodeHostname=$host Port=$(( ${SLURMD_PORT:-6818} + 1 )) CPUs=1 RealMemory=$mem Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=${nodes[0]},${nodes[1]} Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$dir/gres.conf" <<EOF
NodeName=${nodes[0]} Name=gpu File=/dev/tty[0-7]
NodeName=${nodes[1]} Name=gpu File=/dev/tty[8-15]
EOF
}

start() {  # start NAME COMMAND...: a daemon in its own session, its pid recorded
  local name=$1; shift
  setsid "$@" >>"$dir/log/$name.stdio" 2>&1 </dev/null &
  echo $! >"$dir/run/$name.fgpid"
}

up() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null \
    || { echo "Slurm is not installed: run '$0 install' (root, Debian/Ubuntu)" >&2; exit 1; }
  [[ $EUID -eq 0 ]] || { echo "up needs root (the daemons run as SlurmUser=root)" >&2; exit 1; }
  for n in "${nodes[@]}"; do
    getent hosts "$n" >/dev/null || { echo "node name $n does not resolve: add it to /etc/hosts" >&2; exit 1; }
  done
  down quiet
  rm -rf "$dir"/{state,spool,log}  # a drained node's state would come back on restart
  write_conf
  export SLURM_CONF=$conf
  start slurmctld slurmctld -D -i -f "$conf"
  for n in "${nodes[@]}"; do
    mkdir -p "$dir/spool/$n"
    start "slurmd-$n" slurmd -D -N "$n" -f "$conf"
  done
  for _ in $(seq 100); do
    if [[ $(sinfo -h -N -o %T 2>/dev/null | sort -u) == idle ]] && [[ $(sinfo -h -N -o %N | wc -l) -eq 2 ]]; then
      echo "Slurm up: 2 nodes (${nodes[*]}) idle; export SLURM_CONF=$conf"
      return 0
    fi
    sleep 0.2
  done
  echo "Slurm did not come up in 20 s: see $dir/log/" >&2
  sinfo -N 2>&1 >&2 || true
  exit 1
}

down() {
  local pidfile pid
  if [[ -e $dir/run/slurmctld.fgpid ]] && kill -0 "$(<"$dir/run/slurmctld.fgpid")" 2>/dev/null; then
    # this cluster's jobs go first, so that no job step outlives its slurmd
    SLURM_CONF=$conf scancel --full --user=root 2>/dev/null || true
    for _ in $(seq 60); do [[ -z $(SLURM_CONF=$conf squeue -h 2>/dev/null) ]] && break; sleep 0.5; done
  fi
  for pidfile in "$dir"/run/*.fgpid; do
    [[ -e $pidfile ]] || continue
    pid=$(<"$pidfile")
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
  done
  [[ ${1:-} == quiet ]] || echo "Slurm down"
}

case ${1:-} in
  install) install ;;
  up) up ;;
  down) down ;;
  conf) echo "$conf" ;;
  *) echo "usage: $0 install|up|down|conf" >&2; exit 2 ;;
esac
