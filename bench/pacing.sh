#!/usr/bin/env bash
# How the reader's pacing changes the work of each process during a catch-up: the source's
# walsender, the target backend and pgapply. One pgbench backlog, made once; each trial applies all
# of it (`pgapply run --endpos`) from a slot of its own, created before the backlog, into a fresh
# copy of the target database, with one reader setting. CPU per process: pgapply's from `time`,
# the walsender's and the target backend's from their postmasters' cutime/cstime (both exit with
# the run, and autovacuum is off, so nothing else exits meanwhile). A diagnostic, not a comparison
# with PostgreSQL's own subscriber: that is bench/run.sh.
#
# Environment:
#   TXNS=100000 SCALE=10 CLIENTS=4   the backlog
#   ROUNDS=2                          trials per setting, settings alternating
#   SETTINGS                          space-separated reader settings, each `pause_us/queued_bytes`:
#                                     pause after a short read (PGAPPLY_READ_PAUSE_US, 0: never) while
#                                     at least that much is queued (PGAPPLY_PACE_WHEN_QUEUED)
#                                     (default "2000/262144 0/0 5000/262144 2000/65536 2000/0")
#   PGAPPLY_BIN                       binary to use (default: cargo build --release)
#   PG_BIN                            PostgreSQL bin dir (default /usr/lib/postgresql/15/bin)
set -euo pipefail

TXNS="${TXNS:-100000}"
SCALE="${SCALE:-10}"
CLIENTS="${CLIENTS:-4}"
ROUNDS="${ROUNDS:-2}"
SETTINGS="${SETTINGS:-2000/262144 0/0 5000/262144 2000/65536 2000/0}"
PG_BIN="${PG_BIN:-/usr/lib/postgresql/15/bin}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

log() { echo "[pacing] $*" >&2; }
die() { echo "[pacing] error: $*" >&2; exit 1; }

for p in initdb pg_ctl psql pgbench; do
    [ -x "$PG_BIN/$p" ] || command -v "$p" >/dev/null || die "$p not found in $PG_BIN"
done
PSQL="$PG_BIN/psql"; [ -x "$PSQL" ] || PSQL="$(command -v psql)"
PGBENCH="$PG_BIN/pgbench"; [ -x "$PGBENCH" ] || PGBENCH="$(command -v pgbench)"
IS_ROOT=0
[ "$(id -u)" = 0 ] && IS_ROOT=1
as_pg() { if [ "$IS_ROOT" = 1 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

if [ -n "${PGAPPLY_BIN:-}" ]; then
    BIN="$PGAPPLY_BIN"
else
    log "building pgapply (release)"
    (cd "$ROOT" && cargo build --release --quiet)
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/pgapply"
fi
case "$BIN" in /*) ;; *) BIN="$PWD/$BIN" ;; esac
[ -x "$BIN" ] || die "pgapply binary not found at $BIN"

cd /tmp   # the postgres user must be able to read the current directory
WORK="$(mktemp -d /tmp/pgapply-pacing.XXXXXX)"
chmod 755 "$WORK"
[ "$IS_ROOT" = 1 ] && chown postgres: "$WORK"
DATADIRS=()
cleanup() {
    local d
    for d in "${DATADIRS[@]+"${DATADIRS[@]}"}"; do
        as_pg "$PG_BIN/pg_ctl" -D "$d" -m immediate -w stop >/dev/null 2>&1 || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

free_port() {
    local p
    while :; do
        p=$((20000 + RANDOM % 40000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
    done
}

start_cluster() {  # name -> prints the port
    local dir="$WORK/$1" port
    mkdir -p "$dir"
    [ "$IS_ROOT" = 1 ] && chown postgres: "$dir"
    as_pg "$PG_BIN/initdb" -D "$dir/data" --locale=C -E UTF8 -A trust -U postgres >"$dir/initdb.log" 2>&1 ||
        die "initdb failed for $1 (see $dir/initdb.log)"
    port="$(free_port)"
    cat >>"$dir/data/postgresql.conf" <<EOF
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir/data'
wal_level = logical
max_wal_senders = 10
max_replication_slots = 64
shared_buffers = 1GB
max_wal_size = 8GB
checkpoint_timeout = 1h
autovacuum = off
EOF
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null ||
        die "server start failed for $1 (see $dir/server.log)"
    echo "$port"
}

q() { "$PSQL" -X -q -At -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d "$2" -c "$3"; }
cpu_of_children() {  # postmaster pid -> seconds of CPU its exited children used
    awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($16 + $17) / hz}' "/proc/$1/stat"
}

# (start_cluster runs in a subshell: the data directories are noted here, for cleanup.)
DATADIRS=("$WORK/source/data")
SRC="$(start_cluster source)"
DATADIRS+=("$WORK/target/data")
TGT="$(start_cluster target)"
SRC_PM="$(head -1 "$WORK/source/data/postmaster.pid")"
TGT_PM="$(head -1 "$WORK/target/data/postmaster.pid")"

read -r -a SETTING_LIST <<<"$SETTINGS"
TRIALS=$(( ${#SETTING_LIST[@]} * ROUNDS ))
log "source on port $SRC, target on port $TGT; pgbench scale $SCALE, $TXNS transactions, $TRIALS trials"
q "$SRC" postgres "CREATE DATABASE bench"
"$PGBENCH" -i -q -s "$SCALE" -h 127.0.0.1 -p "$SRC" -U postgres bench >"$WORK/init.log" 2>&1 || die "pgbench -i failed"
q "$SRC" bench "ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY"
q "$SRC" bench "CREATE PUBLICATION pacing FOR ALL TABLES"
q "$TGT" postgres "CREATE DATABASE template_bench"
"$PGBENCH" -i -q -s "$SCALE" -h 127.0.0.1 -p "$TGT" -U postgres template_bench >>"$WORK/init.log" 2>&1 || die "pgbench -i failed"
q "$TGT" template_bench "ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY"
for i in $(seq 1 "$TRIALS"); do
    q "$SRC" bench "SELECT lsn FROM pg_create_logical_replication_slot('pacing_$i', 'pgoutput')" >/dev/null
done
"$PGBENCH" -n -t $((TXNS / CLIENTS)) -c "$CLIENTS" -j 2 -h 127.0.0.1 -p "$SRC" -U postgres bench >"$WORK/pgbench.log" 2>&1 ||
    die "pgbench failed"
END="$(q "$SRC" bench "SELECT pg_current_wal_lsn()")"
q "$SRC" postgres "CHECKPOINT"

echo "| trial | pause µs / from queued bytes | txn/s | walsender CPU s | target backend CPU s | pgapply CPU s |"
echo "| ---: | --- | ---: | ---: | ---: | ---: |"
trial=0
for round in $(seq 1 "$ROUNDS"); do
    for setting in "${SETTING_LIST[@]}"; do
        trial=$((trial + 1))
        pause="${setting%/*}"
        queued="${setting#*/}"
        q "$TGT" postgres "CREATE DATABASE trial_$trial TEMPLATE template_bench"
        q "$TGT" postgres "CHECKPOINT"
        s0="$(cpu_of_children "$SRC_PM")"
        t0="$(cpu_of_children "$TGT_PM")"
        TIMEFORMAT='%3R %3U %3S'
        { time PGAPPLY_READ_PAUSE_US="$pause" PGAPPLY_PACE_WHEN_QUEUED="$queued" "$BIN" run \
            --source "host=127.0.0.1 port=$SRC user=postgres dbname=bench" \
            --target "host=127.0.0.1 port=$TGT user=postgres dbname=trial_$trial" \
            --publication pacing --slot "pacing_$trial" --endpos "$END" >"$WORK/trial_$trial.log" 2>&1; } 2>"$WORK/time" ||
            { tail -n 20 "$WORK/trial_$trial.log" >&2; die "trial $trial failed"; }
        unset TIMEFORMAT
        # The walsender and the target backend exit with the run; wait until both are reaped.
        for _ in $(seq 1 50); do
            [ "$(q "$SRC" postgres "SELECT count(*) FROM pg_stat_replication")" = 0 ] && break
            sleep 0.1
        done
        read -r wall user sys <"$WORK/time"
        s1="$(cpu_of_children "$SRC_PM")"
        t1="$(cpu_of_children "$TGT_PM")"
        printf "| %d | %s / %s | %.0f | %.2f | %.2f | %.2f |\n" "$trial" "$pause" "$queued" \
            "$(echo "$TXNS / $wall" | bc -l)" "$(echo "$s1 - $s0" | bc -l)" "$(echo "$t1 - $t0" | bc -l)" \
            "$(echo "$user + $sys" | bc -l)"
        q "$TGT" postgres "DROP DATABASE trial_$trial"
    done
done
