#!/usr/bin/env bash
# A real single-node Slurm cluster (slurmctld + slurmd + slurmdbd + MariaDB + munge)
# for tests and local runs, on Debian/Ubuntu, as root, without systemd.
#
#   bash tests/infra/slurm_cluster.sh install              # apt packages (idempotent)
#   bash tests/infra/slurm_cluster.sh start  [STATE_DIR]   # default: $PWD/outputs/slurm
#   bash tests/infra/slurm_cluster.sh status [STATE_DIR]
#   bash tests/infra/slurm_cluster.sh stop   [STATE_DIR]
#   bash tests/infra/slurm_cluster.sh restart [STATE_DIR]
#   eval "$(bash tests/infra/slurm_cluster.sh env [STATE_DIR])"   # just the export line
#
# `start` prints `export SLURM_CONF=STATE_DIR/etc/slurm.conf` as its last stdout
# line; every other message goes to stderr, so `eval "$(... start)"` works.
#
# Everything lives under STATE_DIR (config, logs, Slurm state, MariaDB datadir,
# fake GPU devices, pid files) except munged, which uses the system locations
# (/etc/munge/munge.key, /run/munge). Daemons are stopped only by the PIDs
# recorded in STATE_DIR/pids (never by process name). Slurm and database state
# persist across stop/start of one STATE_DIR (job ids continue); delete the
# directory (while stopped) for a fresh cluster whose job ids restart at 1.
#
# Environment overrides:
#   SLURM_CLUSTER_CPUS       CPUs advertised for the node (default: slurmd -C);
#                            more than the real count oversubscribes on purpose
#   SLURM_CLUSTER_GPUS       fake GPUs on the node (default 2)
#   SLURM_CLUSTER_MEM_MB     RealMemory in MB (default: 90% of slurmd -C, min 1 GB headroom)
#   SLURM_CLUSTER_CTLD_PORT / _SLURMD_PORT / _DBD_PORT / _DB_PORT
#                            TCP ports on 127.0.0.1 (6817 / 6818 / 6819 / 16819)
#   SLURM_CLUSTER_CLUSTER_NAME  (default "local")
#   SLURM_CLUSTER_TIMEOUT    seconds to wait for the cluster to come up (default 60)
#   SLURM_CLUSTER_STOP_TIMEOUT  seconds to wait per daemon before SIGKILL (default 15)
#   SLURM_CLUSTER_CANCEL_JOBS=1 `stop` cancels all jobs first (else running job
#                            steps outlive slurmd and reconnect after the next start)
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
# name -> binary (the executable that must exist after install)
REQUIRED_BINARIES=(slurmctld slurmd slurmdbd sinfo sbatch sacct sacctmgr munged munge unmunge)
# start order; stop goes in reverse
DAEMONS=(munged mariadb slurmdbd slurmctld slurmd)

CPUS_OVERRIDE="${SLURM_CLUSTER_CPUS:-}"
NUM_GPUS="${SLURM_CLUSTER_GPUS:-2}"
MEM_OVERRIDE="${SLURM_CLUSTER_MEM_MB:-}"
CTLD_PORT="${SLURM_CLUSTER_CTLD_PORT:-6817}"
SLURMD_PORT="${SLURM_CLUSTER_SLURMD_PORT:-6818}"
DBD_PORT="${SLURM_CLUSTER_DBD_PORT:-6819}"
DB_PORT="${SLURM_CLUSTER_DB_PORT:-16819}"
CLUSTER_NAME="${SLURM_CLUSTER_CLUSTER_NAME:-local}"
START_TIMEOUT="${SLURM_CLUSTER_TIMEOUT:-60}"
STOP_TIMEOUT="${SLURM_CLUSTER_STOP_TIMEOUT:-15}"
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=slurm-local-only

MUNGE_RUN_DIR=/run/munge
MUNGE_SOCKET=$MUNGE_RUN_DIR/munge.socket.2
MUNGE_KEY=/etc/munge/munge.key

log() { printf '[slurm_cluster] %s\n' "$*" >&2; }
STARTING=0
die() {
  printf '[slurm_cluster] ERROR: %s\n' "$*" >&2
  if [ "$STARTING" -eq 1 ]; then
    # do not leave a half-started cluster holding ports and sockets
    STARTING=0
    log "stopping the daemons started so far (logs kept in $LOGS)"
    cmd_stop "$STATE_DIR" || true
  fi
  exit 1
}

usage() {
  local rc="${1:-2}"
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2
  exit "$rc"
}

need_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (daemons run as root/munge; apt-get needs root)"
}

# ---------------------------------------------------------------- paths
set_paths() {
  local dir="${1:-$PWD/outputs/slurm}"
  mkdir -p "$dir"
  STATE_DIR="$(cd "$dir" && pwd -P)"
  ETC="$STATE_DIR/etc"
  LOGS="$STATE_DIR/log"
  PIDS="$STATE_DIR/pids"
  RUN="$STATE_DIR/run"
  DEV="$STATE_DIR/dev"
  SPOOL="$STATE_DIR/spool"
  DATADIR="$STATE_DIR/mysql"
  SLURM_CONF_FILE="$ETC/slurm.conf"
  # Unix socket paths are limited to 107 bytes; fall back to a short path.
  MYSQL_SOCKET="$RUN/mysqld.sock"
  if [ "${#MYSQL_SOCKET}" -gt 100 ]; then
    local h; h="$(printf '%s' "$STATE_DIR" | md5sum | cut -c1-10)"
    MYSQL_SOCKET="/run/slurm-cluster-$h/mysqld.sock"
  fi
}

short_hostname() {
  local h
  h="$(hostname -s 2>/dev/null || true)"
  [ -n "$h" ] || h="$(uname -n)"
  printf '%s' "${h%%.*}"
}

# ---------------------------------------------------------------- pids
pid_file() { printf '%s/%s.pid' "$PIDS" "$1"; }

# the executable name(s) we expect behind a recorded pid (guards against pid reuse)
expected_comm() {
  case "$1" in
    munged) echo munged ;;
    mariadb) echo "mariadbd mysqld" ;;
    *) echo "$1" ;;
  esac
}

# prints the pid if the daemon recorded under NAME is alive (and is that program)
live_pid() {
  local name="$1" f pid comm c
  f="$(pid_file "$name")"
  [ -s "$f" ] || return 1
  pid="$(tr -dc '0-9' <"$f")"
  [ -n "$pid" ] || return 1
  [ -r "/proc/$pid/comm" ] || return 1
  comm="$(cat "/proc/$pid/comm" 2>/dev/null || true)"
  # zombies are not alive
  if grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null; then return 1; fi
  for c in $(expected_comm "$name"); do
    if [ "$comm" = "$c" ]; then printf '%s' "$pid"; return 0; fi
  done
  return 1
}

# ---------------------------------------------------------------- install
binary_for_mariadb() {
  local b
  for b in mariadbd mysqld; do
    if command -v "$b" >/dev/null 2>&1; then command -v "$b"; return 0; fi
    if [ -x "/usr/sbin/$b" ]; then echo "/usr/sbin/$b"; return 0; fi
  done
  return 1
}

missing_binaries() {
  local b missing=()
  for b in "${REQUIRED_BINARIES[@]}"; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b")
  done
  binary_for_mariadb >/dev/null || missing+=(mariadbd)
  command -v mariadb-install-db >/dev/null 2>&1 || command -v mysql_install_db >/dev/null 2>&1 \
    || missing+=(mariadb-install-db)
  printf '%s\n' "${missing[@]}"
}

cmd_install() {
  local missing
  missing="$(missing_binaries | tr '\n' ' ' | sed 's/ *$//')"
  if [ -z "$missing" ]; then
    log "packages already installed ($(slurmctld -V 2>/dev/null || echo slurm))"
    return 0
  fi
  need_root
  log "installing ${PACKAGES[*]} (missing: $missing)"
  export DEBIAN_FRONTEND=noninteractive
  # Keep the packages' maintainer scripts from starting services (no systemd
  # here; a system mariadb/munged/slurmctld would hold the ports and sockets).
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created_policy=1
  fi
  local rc=0
  local apt=(apt-get -q -y -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold
             install --no-install-recommends "${PACKAGES[@]}")
  if ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
    apt-get -q update >&2 || rc=$?
  fi
  if [ "$rc" -eq 0 ]; then
    if ! "${apt[@]}" >&2; then
      log "install failed; running apt-get update and retrying"
      rc=0
      apt-get -q update >&2 || rc=$?
      [ "$rc" -ne 0 ] || "${apt[@]}" >&2 || rc=$?
    fi
  fi
  [ "$created_policy" -eq 0 ] || rm -f "$policy"
  [ "$rc" -eq 0 ] || die "apt-get failed (rc=$rc)"
  missing="$(missing_binaries | tr '\n' ' ' | sed 's/ *$//')"
  [ -z "$missing" ] || die "still missing after install: $missing"
  log "installed $(slurmctld -V 2>/dev/null)"
}

# ---------------------------------------------------------------- helpers
port_in_use() {
  # true if something accepts TCP connections on 127.0.0.1:$1
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

tail_logs() {
  local f
  for f in "$LOGS"/*.log; do
    [ -e "$f" ] || continue
    printf '\n----- tail %s -----\n' "$f" >&2
    tail -n 25 "$f" >&2 || true
  done
}

# wait_for SECONDS DESCRIPTION COMMAND...   (fails the start with log tails)
wait_for() {
  local timeout="$1" what="$2"; shift 2
  local deadline=$((SECONDS + timeout))
  while ! "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "timed out after ${timeout}s waiting for: $what"
      tail_logs
      die "cluster did not come up (state dir: $STATE_DIR)"
    fi
    sleep 0.2
  done
}

# launch NAME LOGFILE COMMAND...: start a foreground daemon in its own session,
# detached from our stdio, and record its pid
launch() {
  local name="$1" logf="$2"; shift 2
  # setsid execs in place (a background job is not a group leader), so $! is the daemon
  setsid "$@" </dev/null >>"$logf" 2>&1 &
  local pid=$!
  echo "$pid" >"$(pid_file "$name")"
  sleep 0.1
  if ! kill -0 "$pid" 2>/dev/null; then
    tail -n 30 "$logf" >&2 || true
    rm -f "$(pid_file "$name")"
    die "$name exited right after start (log: $logf)"
  fi
  log "started $name (pid $pid)"
}

ensure_alive() {
  local name="$1"
  live_pid "$name" >/dev/null || { tail_logs; die "$name died during start-up"; }
}

# ---------------------------------------------------------------- config
# slurm_version_at_least MAJOR MINOR  (from `slurmctld -V`, e.g. "slurm-wlm 22.05.8")
slurm_version_at_least() {
  local v major minor
  v="$(slurmctld -V 2>/dev/null | grep -oE '[0-9]+\.[0-9]+' | head -n 1)"
  [ -n "$v" ] || return 1
  major="${v%%.*}"; minor="${v#*.}"
  [ "$((10#$major))" -gt "$1" ] || { [ "$((10#$major))" -eq "$1" ] && [ "$((10#$minor))" -ge "$2" ]; }
}

write_configs() {
  local host="$1"
  local hw cpus boards sockets cores threads mem node_hw overrides=""
  hw="$(slurmd -C 2>/dev/null | head -n 1)"
  [ -n "$hw" ] || die "slurmd -C printed nothing"
  field() { printf '%s\n' "$hw" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
  cpus="$(field CPUs)"; boards="$(field Boards)"; sockets="$(field SocketsPerBoard)"
  cores="$(field CoresPerSocket)"; threads="$(field ThreadsPerCore)"; mem="$(field RealMemory)"
  if [ -n "$CPUS_OVERRIDE" ]; then
    node_hw="CPUs=$CPUS_OVERRIDE Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS_OVERRIDE ThreadsPerCore=1"
    cpus="$CPUS_OVERRIDE"
    overrides="SlurmdParameters=config_overrides"
  else
    node_hw="CPUs=$cpus Boards=$boards SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads"
  fi
  if [ -n "$MEM_OVERRIDE" ]; then
    mem="$MEM_OVERRIDE"
    overrides="SlurmdParameters=config_overrides"
  else
    # leave 10% (at least 1 GB) for the daemons and the OS
    local spare=$((mem / 10)); [ "$spare" -ge 1024 ] || spare=1024
    mem=$((mem - spare)); [ "$mem" -ge 512 ] || mem=512
  fi
  local def_mem=$((mem / cpus)); [ "$def_mem" -ge 1 ] || def_mem=1
  local gres_line="" gres_types="" gres_conf="AutoDetect=off"
  if [ "$NUM_GPUS" -gt 0 ]; then
    gres_line=" Gres=gpu:$NUM_GPUS"
    gres_types="GresTypes=gpu"
    if [ "$NUM_GPUS" -eq 1 ]; then
      gres_conf+=$'\n'"NodeName=$host Name=gpu File=$DEV/nvidia0"
    else
      gres_conf+=$'\n'"NodeName=$host Name=gpu File=$DEV/nvidia[0-$((NUM_GPUS - 1))]"
    fi
  fi

  cat >"$ETC/slurm.conf.tmp" <<EOF
# Generated by tests/infra/slurm_cluster.sh; rewritten on every start.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
AuthInfo=cred_expire=5
CredType=cred/munge
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$def_mem
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1,sched_min_interval=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu
JobRequeue=1
KillWait=5
InactiveLimit=0
MinJobAge=300
Waittime=0
SlurmctldTimeout=120
SlurmdTimeout=300
ReturnToService=2
$gres_types
$overrides
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host $node_hw RealMemory=$mem$gres_line State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
# a second partition with a time limit, for the dry run that reads it from sinfo (tests/slurm/test_partition_limits.py)
PartitionName=short Nodes=ALL MaxTime=60 State=UP
EOF
  mv "$ETC/slurm.conf.tmp" "$SLURM_CONF_FILE"

  printf '# Generated by tests/infra/slurm_cluster.sh\n%s\n' "$gres_conf" >"$ETC/gres.conf"

  # No cgroup enforcement: proctrack/linuxproc + task/none + jobacct_gather/none.
  # Slurm 22.05's slurmd still initialises the autodetected cgroup plugin (and
  # rejects CgroupPlugin=disabled); 23.11+ accepts "disabled", which also works
  # where /sys/fs/cgroup is unusable. This file shadows /etc/slurm/cgroup.conf.
  local cgroup_plugin=""
  if slurm_version_at_least 23 11; then cgroup_plugin="CgroupPlugin=disabled"; fi
  cat >"$ETC/cgroup.conf" <<EOF
# Generated by tests/infra/slurm_cluster.sh: cgroups are not used by this cluster.
$cgroup_plugin
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF

  # slurmdbd refuses a slurmdbd.conf readable by others
  (umask 077; cat >"$ETC/slurmdbd.conf.tmp" <<EOF
# Generated by tests/infra/slurm_cluster.sh
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOGS/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
  )
  chmod 600 "$ETC/slurmdbd.conf.tmp"
  mv "$ETC/slurmdbd.conf.tmp" "$ETC/slurmdbd.conf"
}

make_fake_gpus() {
  local i f
  for ((i = 0; i < NUM_GPUS; i++)); do
    f="$DEV/nvidia$i"
    [ -c "$f" ] && continue
    rm -f "$f"
    if ! mknod "$f" c 1 3 2>/dev/null; then
      # no CAP_MKNOD (some containers): a symlink to /dev/null stats as the same char device
      ln -s /dev/null "$f"
      log "mknod not permitted; $f is a symlink to /dev/null"
    fi
  done
}

# ---------------------------------------------------------------- daemons
munge_works() { munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }

start_munged() {
  id munge >/dev/null 2>&1 || die "user 'munge' missing (run: $0 install)"
  if live_pid munged >/dev/null; then return 0; fi
  rm -f "$(pid_file munged)"
  if munge_works; then
    log "munged already running (not started by this script); using it"
    return 0
  fi
  mkdir -p "$MUNGE_RUN_DIR" /var/lib/munge /var/log/munge /etc/munge
  chown munge:munge "$MUNGE_RUN_DIR" /var/lib/munge /var/log/munge
  chmod 0755 "$MUNGE_RUN_DIR"
  chmod 0700 /var/lib/munge /var/log/munge
  if [ ! -s "$MUNGE_KEY" ]; then
    log "creating munge key $MUNGE_KEY"
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile="$MUNGE_KEY" --force
    else
      dd if=/dev/urandom bs=1 count=1024 of="$MUNGE_KEY" status=none
    fi
  fi
  chown munge:munge /etc/munge "$MUNGE_KEY"
  chmod 0700 /etc/munge
  chmod 0400 "$MUNGE_KEY"
  # --force: start even if a stale socket from a dead munged is left behind
  launch munged "$LOGS/munged.log" \
    setpriv --reuid=munge --regid=munge --init-groups \
    munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$MUNGE_KEY"
  wait_for 15 "munge credentials" munge_works
}

# shellcheck disable=SC2120  # called with arguments through wait_for
mysql_admin() { mariadb --no-defaults --protocol=socket --socket="$MYSQL_SOCKET" -uroot "$@"; }

start_mariadb() {
  if live_pid mariadb >/dev/null; then return 0; fi
  rm -f "$(pid_file mariadb)"
  local mysqld install_db
  mysqld="$(binary_for_mariadb)" || die "mariadbd not found (run: $0 install)"
  install_db="$(command -v mariadb-install-db || command -v mysql_install_db)"
  mkdir -p "$(dirname "$MYSQL_SOCKET")"
  port_in_use "$DB_PORT" && die "port 127.0.0.1:$DB_PORT is in use (set SLURM_CLUSTER_DB_PORT)"
  if [ ! -d "$DATADIR/mysql" ]; then
    log "initialising MariaDB datadir $DATADIR"
    rm -rf "$DATADIR"
    mkdir -p "$DATADIR"
    "$install_db" --no-defaults --datadir="$DATADIR" --user=root \
      --auth-root-authentication-method=socket --skip-test-db >"$LOGS/mariadb-install.log" 2>&1 \
      || { tail -n 30 "$LOGS/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  fi
  rm -f "$MYSQL_SOCKET"
  launch mariadb "$LOGS/mariadb.stderr.log" \
    "$mysqld" --no-defaults --user=root --datadir="$DATADIR" \
    --socket="$MYSQL_SOCKET" --pid-file="$RUN/mariadb.pid" \
    --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
    --log-error="$LOGS/mariadb.log" \
    --innodb-buffer-pool-size=512M \
    --innodb-lock-wait-timeout=900 --max-allowed-packet=16M
  wait_for 30 "MariaDB on $MYSQL_SOCKET" mysql_admin -e 'SELECT 1'
  mysql_admin <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'127.0.0.1';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF
}

dbd_answers() { sacctmgr -n -P show cluster format=cluster; }
node_ready() {
  # "idle" (or mixed/allocated once jobs run); never down/drain/unknown
  local st
  st="$(sinfo -h -N -n "$HOST" -o '%T' 2>/dev/null | head -n 1)"
  case "$st" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}
accounting_ready() {
  # the cluster is registered in slurmdbd (else sacct shows nothing and submitit waits forever)
  sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER_NAME" \
    && sacct -n -X -a -S now-1hours >/dev/null 2>&1
}

all_running() {
  local d
  for d in "${DAEMONS[@]}"; do
    if [ "$d" = munged ] && [ ! -e "$(pid_file munged)" ] && munge_works; then continue; fi
    live_pid "$d" >/dev/null || return 1
  done
}

any_running() {
  local d
  for d in "${DAEMONS[@]}"; do live_pid "$d" >/dev/null && return 0; done
  return 1
}

print_export() { printf 'export SLURM_CONF=%s\n' "$SLURM_CONF_FILE"; }

cmd_start() {
  need_root
  set_paths "${1:-}"
  export SLURM_CONF="$SLURM_CONF_FILE"
  HOST="$(short_hostname)"
  if all_running; then
    log "already running (state dir $STATE_DIR)"
    print_export
    return 0
  fi
  if any_running; then
    log "some daemons are running and some are not: restarting all"
    cmd_stop "$STATE_DIR"
  fi
  [ -z "$(missing_binaries)" ] || die "Slurm packages missing; run: bash $0 install"
  local p
  for p in "$CTLD_PORT" "$SLURMD_PORT" "$DBD_PORT"; do
    port_in_use "$p" && die "port 127.0.0.1:$p is in use (another Slurm? set SLURM_CLUSTER_*_PORT)"
  done
  local t0=$SECONDS
  STARTING=1
  mkdir -p "$ETC" "$LOGS" "$PIDS" "$RUN" "$DEV" "$SPOOL/ctld" "$SPOOL/slurmd"
  write_configs "$HOST"
  make_fake_gpus

  start_munged
  start_mariadb
  launch slurmdbd "$LOGS/slurmdbd.stderr.log" slurmdbd -D
  wait_for 30 "slurmdbd on port $DBD_PORT" dbd_answers
  launch slurmctld "$LOGS/slurmctld.stderr.log" slurmctld -D -i
  wait_for 30 "slurmctld on port $CTLD_PORT" scontrol ping
  launch slurmd "$LOGS/slurmd.stderr.log" slurmd -D -N "$HOST"
  local remaining=$((START_TIMEOUT - (SECONDS - t0))); [ "$remaining" -ge 10 ] || remaining=10
  wait_for "$remaining" "node $HOST idle in sinfo" node_ready
  wait_for 30 "cluster '$CLUSTER_NAME' registered in slurmdbd and sacct answering" accounting_ready
  for p in "${DAEMONS[@]}"; do
    if [ "$p" = munged ] && [ ! -e "$(pid_file munged)" ]; then continue; fi
    ensure_alive "$p"
  done
  STARTING=0
  log "cluster up in $((SECONDS - t0))s: node $HOST, $(sinfo -h -o '%c CPUs, %m MB, %G' | head -n 1)"
  log "state dir $STATE_DIR; logs in $LOGS"
  print_export
}

# ---------------------------------------------------------------- stop
stop_one() {
  local name="$1" pid deadline
  pid="$(live_pid "$name")" || { rm -f "$(pid_file "$name")"; return 0; }
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + STOP_TIMEOUT))
  while live_pid "$name" >/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "$name (pid $pid) did not exit after ${STOP_TIMEOUT}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.5
      break
    fi
    sleep 0.1
  done
  rm -f "$(pid_file "$name")"
}

cmd_stop() {
  need_root
  set_paths "${1:-}"
  local i
  if [ "${SLURM_CLUSTER_CANCEL_JOBS:-0}" = 1 ] && live_pid slurmctld >/dev/null; then
    cancel_all_jobs
  fi
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    stop_one "${DAEMONS[$i]}"
  done
  # mariadb/slurm pid files written by the daemons themselves
  rm -f "$RUN"/*.pid
  log "stopped (state dir $STATE_DIR kept)"
  local steps
  steps="$(slurmstepd_pids)"
  if [ -n "$steps" ]; then
    log "note: job steps still running (slurmstepd pids: $steps); they finish on their own and"
    log "      report to slurmd after the next start (SLURM_CLUSTER_CANCEL_JOBS=1 cancels jobs on stop)"
  fi
}

slurmstepd_pids() {
  local p out=()
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || continue
    grep -q '^State:[[:space:]]*Z' "$p/status" 2>/dev/null && continue
    out+=("${p#/proc/}")
  done
  printf '%s' "${out[*]:-}"
}

cancel_all_jobs() {
  export SLURM_CONF="$SLURM_CONF_FILE"
  local ids
  ids="$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
  [ -n "${ids// /}" ] || return 0
  log "cancelling jobs: $ids"
  # shellcheck disable=SC2086
  scancel $ids 2>/dev/null || true
  local deadline=$((SECONDS + 20))
  while [ -n "$(squeue -h -o %i 2>/dev/null)" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
}

# ---------------------------------------------------------------- status
cmd_status() {
  set_paths "${1:-}"
  export SLURM_CONF="$SLURM_CONF_FILE"
  local d pid up=0 n=0
  for d in "${DAEMONS[@]}"; do
    n=$((n + 1))
    if pid="$(live_pid "$d")"; then
      printf '%-10s running (pid %s)\n' "$d" "$pid"; up=$((up + 1))
    elif [ "$d" = munged ] && munge_works; then
      printf '%-10s running (external)\n' "$d"; up=$((up + 1))
    else
      printf '%-10s stopped\n' "$d"
    fi
  done
  if [ "$up" -eq "$n" ]; then
    sinfo -N -o '%N %T %c %m %G' 2>/dev/null || true
    squeue 2>/dev/null || true
    print_export
    return 0
  elif [ "$up" -eq 0 ]; then
    return 3
  fi
  return 1
}

main() {
  local cmd="${1:-}"
  [ $# -gt 0 ] && shift
  case "$cmd" in
    install) cmd_install ;;
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    status) cmd_status "$@" ;;
    env) set_paths "${1:-}"; print_export ;;
    restart) cmd_stop "$@"; cmd_start "$@" ;;
    -h|--help|help) usage 0 ;;
    "") usage 2 ;;
    *) log "unknown command: $cmd"; usage ;;
  esac
}

main "$@"
