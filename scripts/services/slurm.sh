#!/usr/bin/env bash
# Start a single-node Slurm cluster on this machine (munge, slurmctld, slurmd), unless it already runs.
# Idempotent; safe to rerun. Needs root. Usage: scripts/services/slurm.sh
#
# - munge: /etc/munge/munge.key created when missing (owner munge, 0400), /run/munge owned by munge,
#   munged run as user munge.
# - /etc/slurm/slurm.conf (rewritten only when it differs; a change restarts the daemons): this host
#   as controller and only node at 127.0.0.1 with the hardware `slurmd -C` reports, proctrack/linuxproc,
#   task/none, select/cons_tres CR_Core_Memory with DefMemPerCPU = RealMemory / CPUs (else one job
#   takes the whole node), batch_sched_delay=0 (else batch jobs wait up to 3 s), ReturnToService=2,
#   MailProg=/bin/true, no accounting, KillWait=2 (default 30: a cancelled job that ignores SIGTERM
#   would hold on for 30 s; with 2 it is gone about 5 s after scancel). See INFRA.md "Slurm, single node".
# - Ready when `sinfo -h -N -o %T` says idle (mixed / allocated when jobs already run); a node that
#   does not answer after 3 s (a slurmd that outlived its slurmctld) gets slurmd restarted once.
# Stop: `scontrol shutdown` (slurmctld and slurmd); munged: kill "$(cat /run/munge/munged.pid)".
# On success prints `export LAKESHORE_TEST_SLURM=1` on stdout; everything else goes to stderr.
set -euo pipefail
conf_dir="/etc/slurm"
conf="$conf_dir/slurm.conf"
state_dir="/var/lib/slurm"
log_dir="/var/log/slurm"
run_dir="/run/slurm"
say() { echo "[slurm] $*" >&2; }

if [ "$(id -u)" != 0 ]; then
  say "needs root (munge key, /etc/slurm, daemons)"
  exit 1
fi
for bin in munged mungekey slurmctld slurmd sbatch scontrol sinfo; do
  if ! command -v "$bin" >/dev/null; then
    say "$bin not found: apt-get install -y slurm-wlm munge"
    exit 1
  fi
done

# --- 1. munge ------------------------------------------------------------------------------------
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  mungekey --create --keyfile /etc/munge/munge.key >&2
  say "created /etc/munge/munge.key"
fi
chown munge: /etc/munge /etc/munge/munge.key
chmod 0700 /etc/munge
chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge: /run/munge /var/log/munge /var/lib/munge
chmod 0755 /run/munge
if munge_ok; then
  say "munged already running"
else
  # a stale pid/socket from a killed munged makes it refuse to start
  rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- /usr/sbin/munged >&2
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  munge_ok || { say "munged does not answer; see /var/log/munge/munged.log"; exit 1; }
  say "started munged"
fi

# --- 2. slurm.conf -------------------------------------------------------------------------------
host="$(hostname -s)"
hw="$(slurmd -C | head -n 1)"  # NodeName=HOST CPUs=.. Boards=.. ... RealMemory=..
case "$hw" in
  NodeName=*) ;;
  *) say "unexpected \`slurmd -C\` output: $hw"; exit 1 ;;
esac
hw="${hw#NodeName=* }"  # the hardware fields, without NodeName
cpus="$(sed -n 's/.*\bCPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
mem="$(sed -n 's/.*\bRealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
[ -n "$cpus" ] && [ -n "$mem" ] || { say "cannot read CPUs / RealMemory from: $hw"; exit 1; }
want="$(
  cat <<EOF
# Written by scripts/services/slurm.sh: a single-node test cluster (see INFRA.md). Edits are overwritten.
ClusterName=lakeshore
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=$state_dir/slurmctld
SlurmdSpoolDir=$state_dir/slurmd
SlurmctldPidFile=$run_dir/slurmctld.pid
SlurmdPidFile=$run_dir/slurmd.pid
SlurmctldLogFile=$log_dir/slurmctld.log
SlurmdLogFile=$log_dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((mem / cpus))
SchedulerParameters=batch_sched_delay=0
DependencyParameters=kill_invalid_depend
ReturnToService=2
KillWait=2
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$host NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
)"
mkdir -p "$conf_dir" "$state_dir/slurmctld" "$state_dir/slurmd" "$log_dir" "$run_dir"
chown slurm: "$state_dir" "$state_dir/slurmctld" "$state_dir/slurmd" "$log_dir" "$run_dir"
changed=no
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$want" ]; then
  printf '%s\n' "$want" >"$conf.tmp"
  chmod 0644 "$conf.tmp"
  mv "$conf.tmp" "$conf"
  changed=yes
  say "wrote $conf ($host: $cpus CPUs, ${mem} MB, DefMemPerCPU=$((mem / cpus)))"
fi

# --- 3. slurmctld and slurmd ---------------------------------------------------------------------
# A pid file names a live daemon only when that pid runs the daemon: a pid file left by a machine
# image or a killed run can name a pid that now belongs to something else.
alive() {
  local pid
  [ -f "$1" ] || return 1
  pid="$(cat "$1" 2>/dev/null)"
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$(basename "$1" .pid)" ]
}
start_slurmd() {
  slurmd >&2 || { say "slurmd failed to start; see $log_dir/slurmd.log"; exit 1; }
}
ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
if [ "$changed" = yes ] && { alive "$run_dir/slurmctld.pid" || alive "$run_dir/slurmd.pid"; }; then
  say "configuration changed: restarting slurmctld and slurmd"
  scontrol shutdown >&2 || true
  for _ in $(seq 100); do
    alive "$run_dir/slurmctld.pid" || alive "$run_dir/slurmd.pid" || break
    sleep 0.1
  done
fi
if alive "$run_dir/slurmctld.pid"; then
  say "slurmctld already running"
else
  slurmctld >&2 || { say "slurmctld failed to start; see $log_dir/slurmctld.log"; exit 1; }
  say "started slurmctld"
fi
for _ in $(seq 100); do ctld_up && break; sleep 0.1; done
ctld_up || { say "slurmctld does not answer \`scontrol ping\`; see $log_dir/slurmctld.log"; exit 1; }
if alive "$run_dir/slurmd.pid"; then
  say "slurmd already running"
else
  start_slurmd
  say "started slurmd"
fi

# --- 4. wait for the node ------------------------------------------------------------------------
node_state() { sinfo -h -N -n "$host" -o %T 2>/dev/null | head -n 1 || true; }  # a busy controller: try again
state=""
# A trailing * means the node does not answer slurmctld. A slurmd that outlived its slurmctld (a past
# run, a restarted controller) registers again only when the controller pings it, every 100 s by
# default: after 3 s without an answer it is restarted once, so it registers at once.
for i in $(seq 300); do
  state="$(node_state)"
  case "$state" in
    idle | mixed | allocated) break ;;
  esac
  if [ "$i" = 30 ] && { [ -z "$state" ] || [[ "$state" == unknown* ]] || [[ "$state" == *'*' ]]; }; then
    say "node $host is '${state:-unknown}' after 3 s: restarting slurmd"
    pkill -x slurmd 2>/dev/null || true
    for _ in $(seq 50); do pgrep -x slurmd >/dev/null || break; sleep 0.1; done
    start_slurmd
  fi
  case "$state" in
    down* | drain* | drained*)
      # ReturnToService=2 brings a registered node back; a node drained by a past run needs this
      [ "$i" = 20 ] && scontrol update NodeName="$host" State=RESUME >&2 2>/dev/null || true
      ;;
  esac
  sleep 0.1
done
case "$state" in
  idle | mixed | allocated) say "node $host is $state" ;;
  *)
    say "node $host is '${state:-unknown}', not idle; see $log_dir/slurmd.log and $log_dir/slurmctld.log"
    tail -n 10 "$log_dir/slurmd.log" >&2 || true
    exit 1
    ;;
esac
echo "export LAKESHORE_TEST_SLURM=1"
