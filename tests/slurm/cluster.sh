#!/usr/bin/env bash
# A real 4-node Slurm cluster (with accounting, so sacct works) on this one machine,
# for slurmrl's integration tests. Usage: cluster.sh start|stop|status
# See tests/slurm/README.md for the why of the settings and the pitfalls.
set -euo pipefail

# All state, logs, configs and the database; absolute, as it ends up in slurm.conf.
DIR=$(realpath -m "${SLURMRL_CLUSTER_DIR:-/tmp/slurmrl-cluster}")
CPUS=${SLURMRL_NODE_CPUS:-4}      # per virtual node; > real cores is fine (config_overrides)
DB_PORT=${SLURMRL_DB_PORT:-16033} # our own MariaDB, off 3306 so a system one is left alone
ETC_CONF=/etc/slurm/slurm.conf    # Debian's clients read this; we install a copy of ours
MARK="# managed by slurmrl tests/slurm/cluster.sh"
NODES=(node1 node2 node3 node4)
PIDS=$DIR/pids                    # "name pid" per daemon we started
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
export SLURM_CONF=$DIR/etc/slurm.conf  # daemons (and slurmdbd.conf lookup) use the state dir
T0=$(date +%s.%N)

log() { echo "[cluster] $*"; }
die() { echo "[cluster] ERROR: $*" >&2; exit 1; }
since() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1fs", b-a}'; }

# alive NAME PID: the PID still runs that program (PIDs get reused) and is no zombie
# (our daemons are reparented to PID 1, which may reap them only seconds later).
alive() {
  local stat; stat=$(cat /proc/"$2"/stat 2>/dev/null) || return 1
  [[ $stat == "$2 ($1) "[^ZX]* ]]
}

tails() {  # last lines of every log, for error messages
  for f in "$DIR"/log/*; do [ -s "$f" ] && { echo "--- $f"; tail -n 15 "$f"; }; done >&2 || true
}

fail() { echo "[cluster] ERROR: $*" >&2; tails; exit 1; }

# wait_for DESCRIPTION SECONDS CMD...: poll CMD every 0.1 s until it succeeds.
wait_for() {
  local what=$1 secs=$2; shift 2
  local end=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || fail "timed out after ${secs}s waiting for $what"
    sleep 0.1
  done
}

# [LOG=file] spawn NAME CMD...: run a daemon in the foreground in its own session.
# $! is then the daemon's PID (setsid does not fork when not a group leader), and
# no pipe of our caller stays open (pytest's capture would wait for it forever).
spawn() {
  local name=$1; shift
  setsid "$@" </dev/null >>"$DIR/log/${LOG:-$name}.out" 2>&1 &
  echo "$name $!" >>"$PIDS"
}

install_packages() {
  local missing=() pkg bin
  for pkg in slurmctld:slurmctld slurmd:slurmd slurm-client:sacct munge:munged \
             slurmdbd:slurmdbd mariadb-server:mariadbd; do
    bin=${pkg#*:}; command -v "$bin" >/dev/null || missing+=("${pkg%%:*}")
  done
  [ ${#missing[@]} -eq 0 ] && return
  log "installing packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  mkdir -p "$DIR/log"
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >"$DIR/log/apt.out" 2>&1 || { tail -n 20 "$DIR/log/apt.out" >&2; die "apt-get failed"; }
  log "packages installed after $(since)"
}

write_configs() {
  local host; host=$(hostname -s)
  mkdir -p "$DIR"/{etc,log,state,run} "${NODES[@]/#/$DIR/spool/}"
  chmod 755 "$DIR"  # mysql must traverse it to reach its datadir
  cat >"$DIR/etc/slurm.conf" <<EOF
$MARK (state in $DIR)
ClusterName=ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Requeued jobs wait cred_expire+1 s before they can start again; default is 120.
AuthInfo=cred_expire=10
MpiDefault=none
# No cgroups here (no systemd, container): track processes via /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Hetjobs (and requeued jobs) are only started by the backfill pass: run it every second.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
# Trust the CPUs= below rather than the real (2-core) hardware.
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
MailProg=/bin/true
# Keep finished jobs visible to scontrol/squeue for 5 minutes.
MinJobAge=300
KillWait=5
InactiveLimit=0
Waittime=0
NodeName=node[1-4] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-17004 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # slurmdbd refuses a config readable by others.
  (umask 077; cat >"$DIR/etc/slurmdbd.conf" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$DIR/etc/slurmdbd.conf"
  # Never clobber a slurm.conf we did not write (a real Slurm install).
  if [ -e "$ETC_CONF" ] && ! grep -qF "$MARK" "$ETC_CONF"; then
    die "$ETC_CONF exists and was not written by this script; refusing to overwrite it"
  fi
  mkdir -p "$(dirname "$ETC_CONF")"
  cp "$DIR/etc/slurm.conf" "$ETC_CONF"
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already running (not ours), using it"; return
  fi
  [ -s /etc/munge/munge.key ] || { mungekey -c -k /etc/munge/munge.key; chown munge:munge /etc/munge/munge.key; }
  mkdir -p /run/munge && chown munge:munge /run/munge   # no systemd to create it
  spawn munged setpriv --reuid=munge --regid=munge --init-groups munged -F
  wait_for "munged" 10 bash -c 'munge -n | unmunge'
}

start_mariadb() {
  # Socket and pid live in the datadir: mysql cannot write to root's $DIR.
  local my=(--no-defaults --socket="$DIR/mysql/mysqld.sock")
  if [ ! -d "$DIR/mysql/mysql" ]; then
    mkdir -p "$DIR/mysql" && chown mysql:mysql "$DIR/mysql"
    mariadb-install-db --no-defaults --user=mysql --datadir="$DIR/mysql" --skip-test-db \
      >>"$DIR/log/mariadb-install.out" 2>&1 || fail "mariadb-install-db failed"
  fi
  # --no-defaults: ignore /etc/mysql (system socket/port); our own datadir, port, socket.
  spawn mariadbd mariadbd "${my[@]}" --user=mysql --datadir="$DIR/mysql" --port="$DB_PORT" \
    --bind-address=127.0.0.1 --pid-file="$DIR/mysql/mariadbd.pid"
  wait_for "mariadb" 30 mariadb-admin "${my[@]}" ping
  mariadb "${my[@]}" -u root -e "
    CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || fail "database setup failed"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

nodes_idle() { [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -cx idle)" -ge ${#NODES[@]} ]; }

running() {  # every recorded daemon is alive
  [ -s "$PIDS" ] || return 1
  local name pid
  while read -r name pid; do alive "$name" "$pid" || return 1; done <"$PIDS"
}

do_start() {
  if running && sinfo -h >/dev/null 2>&1; then
    log "already running (state in $DIR)"; return 0
  fi
  if [ -s "$PIDS" ]; then log "partially running, restarting"; do_stop; fi
  [ "$(id -u)" = 0 ] || die "must run as root (apt, /etc/slurm, daemons)"
  install_packages
  write_configs
  : >"$PIDS"
  start_munge
  start_mariadb
  spawn slurmdbd slurmdbd -D
  wait_for "slurmdbd on port 6819" 60 port_open 6819
  # No sacctmgr needed: slurmctld adds cluster "ci" to slurmdbd when it first registers,
  # and without AccountingStorageEnforce jobs need no associations.
  spawn slurmctld slurmctld -D
  wait_for "slurmctld" 30 scontrol ping
  local n; for n in "${NODES[@]}"; do LOG=slurmd-$n spawn slurmd slurmd -D -N "$n"; done
  local end=$(( $(date +%s) + 60 )) resumed=0 name pid
  until nodes_idle; do
    while read -r name pid; do alive "$name" "$pid" || fail "$name (pid $pid) died"; done <"$PIDS"
    # Drained nodes stay drained across restarts (state is saved): resume them once.
    if [ $resumed -eq 0 ] && sinfo -h -N -o '%T' 2>/dev/null | grep -q drain; then
      scontrol update NodeName="node[1-${#NODES[@]}]" State=RESUME 2>/dev/null || true
      resumed=1
    fi
    [ "$(date +%s)" -lt "$end" ] || { sinfo -N >&2 || true; fail "nodes not idle after 60s"; }
    sleep 0.2
  done
  log "${#NODES[@]} nodes idle after $(since) (state in $DIR)"
}

# stop_named NAME...: SIGTERM our daemons of these names, wait up to 10 s, then SIGKILL.
stop_named() {
  local targets=() name pid i
  while read -r name pid; do
    for i in "$@"; do [ "$name" = "$i" ] && alive "$name" "$pid" && targets+=("$name:$pid"); done
  done <"$PIDS"
  [ ${#targets[@]} -eq 0 ] && return
  for i in "${targets[@]}"; do kill -TERM "${i#*:}" 2>/dev/null || true; done
  for _ in $(seq 100); do
    local left=0
    for i in "${targets[@]}"; do alive "${i%%:*}" "${i#*:}" && left=1; done
    [ $left -eq 0 ] && return
    sleep 0.1
  done
  for i in "${targets[@]}"; do
    alive "${i%%:*}" "${i#*:}" && { log "killing ${i%%:*} (pid ${i#*:})"; kill -KILL "${i#*:}" || true; }
  done
  sleep 0.2
}

do_stop() {
  [ -s "$PIDS" ] || { log "not running"; return 0; }
  # Cancel leftover jobs first: their slurmstepds would outlive the slurmds.
  if scontrol ping >/dev/null 2>&1; then
    local jobs; jobs=$(squeue -h -o %A 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      log "cancelling jobs: $(echo $jobs)"
      scancel $jobs 2>/dev/null || true
      local end=$(( $(date +%s) + 15 ))
      while [ -n "$(squeue -h -o %A 2>/dev/null)" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 0.2; done
    fi
  fi
  # Order matters: slurmctld flushes accounting to slurmdbd, which needs mariadb and munge.
  stop_named slurmd slurmctld
  stop_named slurmdbd
  stop_named mariadbd
  stop_named munged
  rm -f "$PIDS"
  log "stopped after $(since)"
}

do_status() {
  if running; then log "running (state in $DIR)"; else log "not running"; fi
  if [ -s "$PIDS" ]; then
    local name pid
    while read -r name pid; do
      if alive "$name" "$pid"; then echo "  $name $pid alive"; else echo "  $name $pid dead"; fi
    done <"$PIDS"
  fi
  running && sinfo
}

case "${1:-}" in
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
