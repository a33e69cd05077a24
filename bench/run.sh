#!/usr/bin/env bash
# Catch-up benchmark: pgapply against PostgreSQL's built-in logical replication
# subscriber, both applying the same pgbench (tpcb-like) backlog. See bench/README.md.
#
# Environment:
#   SCALE=10 TXNS=150000 ROUNDS=3 CLIENTS=4   workload size
#   PGAPPLY_BIN      use this binary instead of `cargo build --release`
#   PGAPPLY_ARGS     extra options for pgapply in the catch-up rounds (e.g. "--binary"), split on spaces
#   PG_BIN           PostgreSQL 15 bin dir (default /usr/lib/postgresql/15/bin)
#   CATCHUP_TIMEOUT  seconds an applier may take per round before the run fails (default 3600)
#   SHARED_BUFFERS   shared_buffers of both clusters (default 1GB)
#   RESULTS          markdown output (default bench/results/latest.md)
#   COPY_BENCH=1     also time the initial copy (built-in copy_data vs pgapply --copy-data); 0 skips it
#   COPY_SCALE       pgbench scale of the copy dataset (default SCALE)
#   COPY_JOBS        pgapply --copy-jobs for the copy phase (default 4)
#   COPY_ROUNDS      copies by each applier, alternating which goes first (default ROUNDS)
#   COPY_INDEXES     how pgapply copies: into tables with their primary keys in place ("before", as
#                    the built-in does), by the README's migration flow with the keys built after the
#                    rows ("after": tables without keys, `run --copy-data --copy-only`, then `schema
#                    --section post-data`, both timed), or each way in every round ("both", default)
#   LATENCY_BENCH=1  also apply one backlog with pgapply directly and through examples/delay_proxy.rs
#                    (DELAY_MS each way in front of the target, and 0 ms to show the proxy's own
#                    cost); 0 skips it
#   LATENCY_TXNS     transactions of that backlog (default TXNS)
#   DELAY_MS         proxy delay per direction in milliseconds (default 1)
#   LAT_WORKERS      also apply that backlog through the proxy with --apply-workers LAT_WORKERS
#                    (default 4; 1 skips it)
#   PROFILE=1        record a system-wide CPU profile (perf record -a) of every catch-up phase,
#                    report per process where the CPU went, and keep the data next to RESULTS
#                    as perf-<applier>-round<r>.data (needs perf); 0 (default) skips it
#   LAG_BENCH=1      also measure replication lag under a fixed-rate pgbench load; 0 skips it
#   LAG_SECONDS      length of that load per applier (default 20)
#   RATE             its pgbench -R rate in txn/s (default: 80% of the built-in's catch-up txn/s,
#                    at most 80% of the source's own pgbench tps)
#   BIGTXN_BENCH=1   also apply one large transaction (BIGTXN_ROWS inserted, half of them updated)
#                    with the built-in (streaming = on, and parallel on 16+) and pgapply; 0 skips it
#   BIGTXN_ROWS      rows of that transaction (default 1000000)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PG_BIN="${PG_BIN:-/usr/lib/postgresql/15/bin}"
SCALE="${SCALE:-10}"
TXNS="${TXNS:-150000}"
ROUNDS="${ROUNDS:-3}"
CLIENTS="${CLIENTS:-4}"
CATCHUP_TIMEOUT="${CATCHUP_TIMEOUT:-3600}"
SHARED_BUFFERS="${SHARED_BUFFERS:-1GB}"
RESULTS="${RESULTS:-$ROOT/bench/results/latest.md}"
ROWS_PER_TXN=4   # tpcb-like: 3 UPDATEs + 1 INSERT change rows (the SELECT does not)
COPY_BENCH="${COPY_BENCH:-1}"
COPY_SCALE="${COPY_SCALE:-$SCALE}"
COPY_JOBS="${COPY_JOBS:-4}"
COPY_ROUNDS="${COPY_ROUNDS:-$ROUNDS}"
COPY_INDEXES="${COPY_INDEXES:-both}"
LATENCY_BENCH="${LATENCY_BENCH:-1}"
LATENCY_TXNS="${LATENCY_TXNS:-$TXNS}"
DELAY_MS="${DELAY_MS:-1}"
LAT_WORKERS="${LAT_WORKERS:-4}"
LAG_BENCH="${LAG_BENCH:-1}"
LAG_SECONDS="${LAG_SECONDS:-20}"
RATE="${RATE:-}"
BIGTXN_BENCH="${BIGTXN_BENCH:-1}"
BIGTXN_ROWS="${BIGTXN_ROWS:-1000000}"
PROFILE="${PROFILE:-0}"

log() { echo "bench: $*" >&2; }
die() { log "error: $*"; exit 1; }

for v in COPY_BENCH LATENCY_BENCH LAG_BENCH BIGTXN_BENCH PROFILE; do
    [[ "${!v}" =~ ^[01]$ ]] || die "$v must be 0 or 1 (got '${!v}')"
done
[[ "$COPY_INDEXES" =~ ^(before|after|both)$ ]] || die "COPY_INDEXES must be before, after or both (got '$COPY_INDEXES')"
[[ "$DELAY_MS" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "DELAY_MS must be a number of milliseconds (got '$DELAY_MS')"
[ -z "$RATE" ] || [[ "$RATE" =~ ^[1-9][0-9]*$ ]] || die "RATE must be a positive integer (got '$RATE')"
for v in SCALE TXNS ROUNDS CLIENTS CATCHUP_TIMEOUT COPY_SCALE COPY_JOBS COPY_ROUNDS LATENCY_TXNS LAG_SECONDS BIGTXN_ROWS LAT_WORKERS; do
    [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer (got '${!v}')"
done
PER_CLIENT=$((TXNS / CLIENTS))
[ "$PER_CLIENT" -ge 1 ] || die "TXNS ($TXNS) must be at least CLIENTS ($CLIENTS)"
NTXN=$((PER_CLIENT * CLIENTS))   # transactions per round actually run
LAT_PER_CLIENT=$((LATENCY_TXNS / CLIENTS))
[ "$LATENCY_BENCH" = 0 ] || [ "$LAT_PER_CLIENT" -ge 1 ] || die "LATENCY_TXNS ($LATENCY_TXNS) must be at least CLIENTS ($CLIENTS)"
JOBS=2
[ "$CLIENTS" -ge 2 ] || JOBS=1
for p in initdb pg_ctl postgres psql pgbench; do
    [ -x "$PG_BIN/$p" ] || die "$PG_BIN/$p not found (set PG_BIN)"
done
PSQL="$PG_BIN/psql"
if [ "$PROFILE" = 1 ]; then
    command -v perf >/dev/null || die "PROFILE=1 needs perf (Debian package linux-perf)"
fi

IS_ROOT=0
if [ "$(id -u)" = 0 ]; then
    IS_ROOT=1
    id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' OS user"
fi
as_pg() {  # server programs must not run as root
    if [ "$IS_ROOT" = 1 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

read -r -a EXTRA_ARGS <<<"${PGAPPLY_ARGS:-}"

# ---------------------------------------------------------------------------
# 1. the binary

if [ -n "${PGAPPLY_BIN:-}" ]; then
    BIN="$PGAPPLY_BIN"
else
    log "building pgapply (release)"
    (cd "$ROOT" && cargo build --release --quiet)
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/pgapply"
fi
[ -x "$BIN" ] || die "pgapply binary not found at $BIN"
if [ "$LATENCY_BENCH" = 1 ]; then
    log "building the delay proxy (examples/delay_proxy.rs, release)"
    (cd "$ROOT" && cargo build --release --quiet --example delay_proxy)
    PROXY_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/delay_proxy"
    case "$PROXY_BIN" in /*) ;; *) PROXY_BIN="$PWD/$PROXY_BIN" ;; esac
fi
case "$BIN" in /*) ;; *) BIN="$PWD/$BIN" ;; esac
mkdir -p "$(dirname "$RESULTS")"
case "$RESULTS" in /*) ;; *) RESULTS="$PWD/$RESULTS" ;; esac
PROFILE_DIR="$(dirname "$RESULTS")"   # PROFILE=1: perf-<applier>-round<r>.data, kept for perf report

# ---------------------------------------------------------------------------
# 2. throwaway clusters

cd /tmp   # the postgres user must be able to read the current directory
WORK="$(mktemp -d /tmp/pgapply-bench.XXXXXX)"
chmod 755 "$WORK"
if [ "$IS_ROOT" = 1 ]; then chown postgres: "$WORK"; fi

DATADIRS=()
SAMPLER_PID=""
PROXY_PID=""
PROXY0_PID=""
PERF_PID=""
LAG_SAMPLER_PID=""
LAG_APPLIER_PID=""
cleanup() {
    local d p
    for p in "$SAMPLER_PID" "$PERF_PID" "$PROXY_PID" "$PROXY0_PID" "$LAG_SAMPLER_PID" "$LAG_APPLIER_PID"; do
        if [ -n "$p" ]; then kill "$p" 2>/dev/null || true; fi
    done
    for d in "${DATADIRS[@]+"${DATADIRS[@]}"}"; do
        as_pg "$PG_BIN/pg_ctl" -D "$d" -m immediate -w stop >/dev/null 2>&1 || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    local p
    while :; do
        p=$((20000 + RANDOM % 40000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            echo "$p"
            return
        fi
    done
}

PORT=""
start_cluster() {  # name -> sets PORT
    local name="$1" dir="$WORK/$1"
    mkdir -p "$dir"
    if [ "$IS_ROOT" = 1 ]; then chown postgres: "$dir"; fi
    as_pg "$PG_BIN/initdb" -D "$dir/data" --locale=C -E UTF8 -A trust -U postgres >"$dir/initdb.log" 2>&1 ||
        { cat "$dir/initdb.log" >&2; die "initdb failed for $name"; }
    PORT="$(free_port)"
    cat >>"$dir/data/postgresql.conf" <<EOF

# added by bench/run.sh
port = $PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir/data'
wal_level = logical
max_wal_senders = 10
max_replication_slots = 64
max_worker_processes = 16
max_logical_replication_workers = 8
shared_buffers = $SHARED_BUFFERS
max_wal_size = 8GB
checkpoint_timeout = 1h
EOF
    DATADIRS+=("$dir/data")
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null ||
        { cat "$dir/server.log" >&2 || true; die "server start failed for $name"; }
}

q() {  # port db sql -> unaligned output
    "$PSQL" -X -q -At -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d "$2" -c "$3"
}

start_cluster source
SRC_PORT="$PORT"
start_cluster target
TGT_PORT="$PORT"
TGT_LOG="$WORK/target/server.log"
TGT_POSTMASTER="$(head -n 1 "$WORK/target/data/postmaster.pid")"
SRC_CONN="host=127.0.0.1 port=$SRC_PORT user=postgres dbname=bench"
log "source on port $SRC_PORT, target on port $TGT_PORT, work dir $WORK"

# ---------------------------------------------------------------------------
# 3. schema and initial data

pgbench_init() {  # port db
    "$PG_BIN/pgbench" -i -q -s "$SCALE" -h 127.0.0.1 -p "$1" -U postgres "$2" >"$WORK/init-$2.log" 2>&1 ||
        { cat "$WORK/init-$2.log" >&2; die "pgbench -i failed for $2"; }
    q "$1" "$2" "ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY" >/dev/null
    q "$1" "$2" "TRUNCATE pgbench_history" >/dev/null
}

log "initialising pgbench scale $SCALE on source and target"
q "$SRC_PORT" postgres "CREATE DATABASE bench" >/dev/null
pgbench_init "$SRC_PORT" bench
q "$TGT_PORT" postgres "CREATE DATABASE bench_template" >/dev/null
pgbench_init "$TGT_PORT" bench_template
# pgbench -i is deterministic; copying one initialised database makes both targets start
# byte-for-byte equal, and equally cold until the prewarm below.
for db in target_builtin target_pgapply; do
    q "$TGT_PORT" postgres "CREATE DATABASE $db TEMPLATE bench_template" >/dev/null
done
# The latency and lag phases make more target databases from the template later.
if [ "$LATENCY_BENCH" = 0 ] && [ "$LAG_BENCH" = 0 ]; then
    q "$TGT_PORT" postgres "DROP DATABASE bench_template" >/dev/null
fi
HAVE_PREWARM=0
[ -f "$("$PG_BIN/pg_config" --sharedir 2>/dev/null)/extension/pg_prewarm.control" ] && HAVE_PREWARM=1
prewarm() {  # port db: load the pgbench tables and indexes into shared_buffers
    [ "$HAVE_PREWARM" = 1 ] || return 0
    q "$1" "$2" "CREATE EXTENSION IF NOT EXISTS pg_prewarm" >/dev/null
    q "$1" "$2" "SELECT sum(pg_prewarm(c.oid)) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relname LIKE 'pgbench%' AND c.relkind IN ('r', 'i')" >/dev/null
}
[ "$HAVE_PREWARM" = 1 ] || log "pg_prewarm not available: target tables start cold in shared_buffers"
for db in target_builtin target_pgapply; do prewarm "$TGT_PORT" "$db"; done

q "$SRC_PORT" bench "CREATE PUBLICATION bench FOR ALL TABLES" >/dev/null
q "$SRC_PORT" bench "SELECT pg_create_logical_replication_slot('builtin_slot', 'pgoutput')" >/dev/null
q "$SRC_PORT" bench "SELECT pg_create_logical_replication_slot('pgapply_slot', 'pgoutput')" >/dev/null
q "$TGT_PORT" target_builtin "CREATE SUBSCRIPTION builtin_sub CONNECTION '$SRC_CONN' PUBLICATION bench
    WITH (copy_data = false, create_slot = false, slot_name = 'builtin_slot', enabled = false, synchronous_commit = off)" >/dev/null

CHECK_DESC="sum(abalance) count(accounts) sum(tbalance) sum(bbalance) count(history)"
CHECK_SQL="SELECT (SELECT sum(abalance) || ' ' || count(*) FROM pgbench_accounts)
    || ' ' || (SELECT sum(tbalance) FROM pgbench_tellers) || ' ' || (SELECT sum(bbalance) FROM pgbench_branches)
    || ' ' || (SELECT count(*) FROM pgbench_history)"
INIT_SRC="$(q "$SRC_PORT" bench "$CHECK_SQL")"
for db in target_builtin target_pgapply; do
    [ "$(q "$TGT_PORT" "$db" "$CHECK_SQL")" = "$INIT_SRC" ] || die "initial data of $db differs from the source"
done
q "$SRC_PORT" bench "CHECKPOINT" >/dev/null

# ---------------------------------------------------------------------------
# helpers for the rounds

now() { echo "$EPOCHREALTIME"; }
calc() { awk "BEGIN { printf(\"%.${2:-3}f\", ($1)) }"; }
CLK_TCK="$(getconf CLK_TCK)"

proc_cpu_ticks() {  # pid -> utime+stime in clock ticks (empty when gone)
    local stat f
    { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 0
    read -r -a f <<<"${stat##*) }"   # fields from #3 (state) on: utime is #14, stime #15
    echo $((f[11] + f[12]))
}

wait_slot_inactive() {  # slot
    local i
    for ((i = 0; i < 600; i++)); do
        [ "$(q "$SRC_PORT" bench "SELECT active FROM pg_replication_slots WHERE slot_name = '$1'")" = f ] && return
        sleep 0.1
    done
    die "slot $1 still in use after 60s"
}

wait_confirmed() {  # slot lsn: blocks until the slot's confirmed_flush_lsn reaches lsn (polls every 50ms)
    "$PSQL" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$SRC_PORT" -U postgres -d bench >/dev/null <<SQL
DO \$\$
DECLARE deadline timestamptz := clock_timestamp() + interval '$CATCHUP_TIMEOUT seconds';
BEGIN
    WHILE coalesce((SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '$1') < '$2'::pg_lsn, true) LOOP
        IF clock_timestamp() > deadline THEN
            RAISE EXCEPTION 'slot $1 did not reach $2 within $CATCHUP_TIMEOUT s';
        END IF;
        PERFORM pg_sleep(0.05);
    END LOOP;
END
\$\$;
SQL
}

# Background sampler: CPU of the target backends serving target_pgapply. Every 50ms it lists the
# target postmaster's children, keeps those whose process title is a client backend of
# target_pgapply (what pg_stat_activity shows as datname = target_pgapply), and remembers each
# one's latest utime+stime. On SIGTERM it samples once more and writes "ticks backends" to $1.
sample_backends() {  # outfile
    set +e
    trap - EXIT
    local out="$1" stop=0 pid title total=0 stat
    local -a kids f
    local -A ticks=()
    trap 'stop=1' TERM
    while :; do
        kids=()
        { read -r -a kids <"/proc/$TGT_POSTMASTER/task/$TGT_POSTMASTER/children"; } 2>/dev/null
        for pid in "${kids[@]+"${kids[@]}"}"; do
            title=""
            { read -r -d '' title <"/proc/$pid/cmdline"; } 2>/dev/null
            case "$title" in "postgres: postgres target_pgapply "*) ;; *) continue ;; esac
            { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || continue
            read -r -a f <<<"${stat##*) }"
            ticks[$pid]=$((f[11] + f[12]))
        done
        [ "$stop" = 1 ] && break
        sleep 0.05
    done
    for pid in "${!ticks[@]}"; do total=$((total + ticks[$pid])); done
    echo "$total ${#ticks[@]}" >"$out"
}

# Results per round r: SECS_<applier>[r], CPU_<applier>[r] (seconds).
declare -a SECS_builtin SECS_pgapply CPU_builtin CPU_pgapply CPUNOTE_pgapply WAL_MB SRC_TPS ORDER CEIL_SECS
LAST_WORKER_PID=""
LAST_ENABLE_AT=""
RETRY_MS="$(q "$TGT_PORT" postgres "SELECT setting FROM pg_settings WHERE name = 'wal_retrieve_retry_interval'")"

run_builtin() {  # round end_lsn
    local r="$1" end="$2" t0 t1 pid ticks starts_before starts_after pause
    # The launcher starts apply workers at most once per wal_retrieve_retry_interval; wait that
    # out (untimed) so ENABLE is not held back by the previous round's start.
    if [ -n "$LAST_ENABLE_AT" ]; then
        pause="$(calc "$RETRY_MS / 1000 + 0.3 - ($(now) - $LAST_ENABLE_AT)")"
        if [ "$(calc "($pause > 0)" 0)" = 1 ]; then sleep "$pause"; fi
    fi
    starts_before="$(grep -c 'apply worker for subscription "builtin_sub" has started' "$TGT_LOG" || true)"
    t0="$(now)"
    LAST_ENABLE_AT="$t0"
    q "$TGT_PORT" target_builtin "ALTER SUBSCRIPTION builtin_sub ENABLE" >/dev/null
    wait_confirmed builtin_slot "$end"
    t1="$(now)"
    pid="$(q "$TGT_PORT" target_builtin "SELECT pid FROM pg_stat_subscription WHERE subname = 'builtin_sub' AND relid IS NULL")"
    [ -n "$pid" ] || die "round $r: no built-in apply worker running after catch-up"
    # The worker starts fresh at ENABLE, so its cumulative CPU is this round's CPU.
    ticks="$(proc_cpu_ticks "$pid")"
    q "$TGT_PORT" target_builtin "ALTER SUBSCRIPTION builtin_sub DISABLE" >/dev/null
    starts_after="$(grep -c 'apply worker for subscription "builtin_sub" has started' "$TGT_LOG" || true)"
    if [ "$pid" = "$LAST_WORKER_PID" ] || [ $((starts_after - starts_before)) -gt 1 ]; then
        log "warning: round $r: the built-in apply worker restarted during catch-up; its CPU is undercounted"
    fi
    LAST_WORKER_PID="$pid"
    SECS_builtin[r]="$(calc "$t1 - $t0")"
    CPU_builtin[r]="$(calc "${ticks:-0} / $CLK_TCK" 2)"
    wait_slot_inactive builtin_slot
}

run_pgapply() {  # round end_lsn
    local r="$1" end="$2" rc=0 wall user sys bticks nback
    local plog="$WORK/pgapply-round$r.log" sample="$WORK/sample-round$r"
    sample_backends "$sample" &
    SAMPLER_PID=$!
    local TIMEFORMAT='%3R %3U %3S'
    local rss_cmd=()
    # Peak RSS from GNU time when it is installed.
    if [ -x /usr/bin/time ] && /usr/bin/time -f '%M' true >/dev/null 2>&1; then
        rss_cmd=(/usr/bin/time -o "$WORK/rss-round$r" -f '%M')
    fi
    { time "${rss_cmd[@]}" "$BIN" run --source "$SRC_CONN" \
        --target "host=127.0.0.1 port=$TGT_PORT user=postgres dbname=target_pgapply" \
        --publication bench --slot pgapply_slot --endpos "$end" --status-interval 1s \
        "${EXTRA_ARGS[@]}" >"$plog" 2>&1; } 2>"$WORK/time-round$r" || rc=$?
    kill -TERM "$SAMPLER_PID"
    wait "$SAMPLER_PID" || true
    SAMPLER_PID=""
    if [ "$rc" != 0 ]; then
        tail -n 30 "$plog" >&2
        die "round $r: pgapply exited with status $rc (log above)"
    fi
    read -r wall user sys <"$WORK/time-round$r"
    read -r bticks nback <"$sample"
    SECS_pgapply[r]="$wall"
    CPU_pgapply[r]="$(calc "$user + $sys + $bticks / $CLK_TCK" 2)"
    CPUNOTE_pgapply[r]="pgapply $(calc "$user + $sys" 2) s + $nback target backend(s) $(calc "$bticks / $CLK_TCK" 2) s"
    if [ -s "$WORK/rss-round$r" ]; then
        CPUNOTE_pgapply[r]+="; pgapply peak RSS $(calc "$(tail -n 1 "$WORK/rss-round$r") / 1024" 0) MB"
    fi
    wait_slot_inactive pgapply_slot
}

# ---------------------------------------------------------------------------
# 4. rounds

profile_start() {  # data file: sample every CPU at 499 Hz until profile_stop
    perf record -a -g -F 499 -o "$1" >"$1.log" 2>&1 &
    PERF_PID=$!
    sleep 0.5   # perf needs a moment before it samples; the applier has not started yet
}
profile_stop() {
    kill -INT "$PERF_PID" 2>/dev/null || true
    wait "$PERF_PID" 2>/dev/null || true
    PERF_PID=""
}
# Per process (name and pid: the walsender, the target backends and the apply worker are all
# "postgres"), CPU seconds = samples / 499 Hz; then the top functions of each busy process.
profile_report() {  # data file
    perf report -i "$1" --stdio --no-children -g none --sort comm,pid -F sample,comm,pid 2>/dev/null |
        awk '$1 ~ /^[0-9]+$/ && $1 >= 50 { printf "  %6.2f s  %s\n", $1 / 499, $3 }' | head -n 12
}

log "$ROUNDS round(s) of $NTXN tpcb-like transactions ($CLIENTS clients x $PER_CLIENT, -j $JOBS)"
for ((r = 1; r <= ROUNDS; r++)); do
    start_lsn="$(q "$SRC_PORT" bench "SELECT pg_current_wal_flush_lsn()")"
    "$PG_BIN/pgbench" -n -t "$PER_CLIENT" -c "$CLIENTS" -j "$JOBS" -h 127.0.0.1 -p "$SRC_PORT" -U postgres bench \
        >"$WORK/pgbench-round$r.log" 2>&1 || { cat "$WORK/pgbench-round$r.log" >&2; die "pgbench failed"; }
    end_lsn="$(q "$SRC_PORT" bench "SELECT pg_current_wal_flush_lsn()")"
    WAL_MB[r]="$(q "$SRC_PORT" bench "SELECT round(pg_wal_lsn_diff('$end_lsn', '$start_lsn') / 1048576.0, 1)")"
    SRC_TPS[r]="$(sed -n 's/^tps = \([0-9]*\).*/\1/p' "$WORK/pgbench-round$r.log" | head -n 1)"
    if ((r % 2 == 1)); then ORDER[r]="builtin pgapply"; else ORDER[r]="pgapply builtin"; fi
    log "round $r: workload done (${WAL_MB[r]} MB WAL, end $end_lsn); order: ${ORDER[r]}"
    # The source's ceiling: the same backlog read by pgapply's reader with nothing applied (the
    # slot is not moved).
    "$BIN" source-speed --source "$SRC_CONN" --publication bench --slot pgapply_slot --endpos "$end_lsn" \
        >"$WORK/ceiling-round$r.log" 2>&1 || { cat "$WORK/ceiling-round$r.log" >&2; die "round $r: pgapply source-speed failed"; }
    CEIL_SECS[r]="$(sed -n 's/^read .* in \([0-9.]*\) s: .*/\1/p' "$WORK/ceiling-round$r.log")"
    [ -n "${CEIL_SECS[r]}" ] || { cat "$WORK/ceiling-round$r.log" >&2; die "round $r: no result from pgapply source-speed"; }
    wait_slot_inactive pgapply_slot
    log "round $r: source ceiling ${CEIL_SECS[r]} s"
    for a in ${ORDER[r]}; do
        q "$TGT_PORT" postgres "CHECKPOINT" >/dev/null   # every phase starts right after a checkpoint
        [ "$PROFILE" = 1 ] && profile_start "$PROFILE_DIR/perf-$a-round$r.data"
        "run_$a" "$r" "$end_lsn"
        [ "$PROFILE" = 1 ] && profile_stop
    done
    log "round $r: built-in ${SECS_builtin[r]} s, pgapply ${SECS_pgapply[r]} s"
done

# ---------------------------------------------------------------------------
# 6. report

median() { tr ' ' '\n' | sed '/^$/d' | sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "n/a"; else if (NR % 2) printf "%.2f", v[(NR + 1) / 2]; else printf "%.2f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

PG_VERSION="$(q "$SRC_PORT" bench "SHOW server_version")"
GIT_REV="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]; then GIT_REV="$GIT_REV (modified)"; fi
# A binary given from elsewhere may not be the checkout's build: named as given.
if [ -n "${PGAPPLY_BIN:-}" ]; then GIT_REV="binary $PGAPPLY_BIN (checkout $GIT_REV)"; fi
CPU_MODEL="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)"

speed_ratios="" cpu_ratios="" ceil_b="" ceil_p="" ceil_t=""
TABLE=""
for ((r = 1; r <= ROUNDS; r++)); do
    TABLE+=$'\n'"Round $r: order ${ORDER[r]/ /, then }; ${WAL_MB[r]} MB source WAL; source pgbench ${SRC_TPS[r]:-?} tps"$'\n\n'
    TABLE+="| applier  | seconds | txn/s | row changes/s | CPU s | CPU s/1k txn |"$'\n'
    TABLE+="|----------|--------:|------:|--------------:|------:|-------------:|"$'\n'
    for a in builtin pgapply; do
        secs="SECS_$a[$r]" cpu="CPU_$a[$r]"
        secs="${!secs}" cpu="${!cpu}"
        name=built-in
        [ "$a" = pgapply ] && name=pgapply
        TABLE+="$(printf '| %-8s | %7.2f | %5.0f | %13.0f | %5.2f | %12.3f |' "$name" "$secs" \
            "$(calc "$NTXN / $secs" 1)" "$(calc "$NTXN * $ROWS_PER_TXN / $secs" 1)" "$cpu" \
            "$(calc "$cpu / ($NTXN / 1000)" 4)")"$'\n'
    done
    sr="$(calc "${SECS_builtin[r]} / ${SECS_pgapply[r]}" 2)"
    if [ "$(calc "${CPU_builtin[r]} > 0" 0)" = 1 ]; then cr="$(calc "${CPU_pgapply[r]} / ${CPU_builtin[r]}" 2)"; else cr="n/a"; fi
    speed_ratios+=" $sr"
    [ "$cr" = n/a ] || cpu_ratios+=" $cr"
    TABLE+=$'\n'"pgapply/built-in: throughput x$sr, CPU x$cr (pgapply CPU: ${CPUNOTE_pgapply[r]})"$'\n'
    TABLE+="source ceiling: $(calc "$NTXN / ${CEIL_SECS[r]}" 0) txn/s (${CEIL_SECS[r]} s); built-in at $(calc "100 * ${CEIL_SECS[r]} / ${SECS_builtin[r]}" 0)% of it, pgapply at $(calc "100 * ${CEIL_SECS[r]} / ${SECS_pgapply[r]}" 0)%"$'\n'
    ceil_b+=" $(calc "${CEIL_SECS[r]} / ${SECS_builtin[r]}" 2)"
    ceil_p+=" $(calc "${CEIL_SECS[r]} / ${SECS_pgapply[r]}" 2)"
    ceil_t+=" $(calc "$NTXN / ${CEIL_SECS[r]}" 0)"
    if [ "$PROFILE" = 1 ]; then
        for a in builtin pgapply; do
            TABLE+="CPU by process while $a applied (perf, all CPUs, seconds):"$'\n'
            TABLE+='```'$'\n'"$(profile_report "$PROFILE_DIR/perf-$a-round$r.data")"$'\n''```'$'\n'
        done
    fi
done
MED_SPEED="$(echo "$speed_ratios" | median)"
MED_CPU="$(echo "$cpu_ratios" | median)"
SUMMARY="Median pgapply/built-in over $ROUNDS round(s): throughput x$MED_SPEED, CPU x$MED_CPU (throughput > 1: pgapply faster; CPU < 1: pgapply cheaper)"
CEILING="Source ceiling (pgapply source-speed: the same backlog read with pgapply's reader, nothing applied), median: $(echo "$ceil_t" | median) txn/s; built-in at x$(echo "$ceil_b" | median) of it, pgapply at x$(echo "$ceil_p" | median)"

# ---------------------------------------------------------------------------
# 7. correctness

RES_SRC="$(q "$SRC_PORT" bench "$CHECK_SQL")"
RES_BUILTIN="$(q "$TGT_PORT" target_builtin "$CHECK_SQL")"
RES_PGAPPLY="$(q "$TGT_PORT" target_pgapply "$CHECK_SQL")"
if [ "$RES_SRC" = "$RES_BUILTIN" ] && [ "$RES_SRC" = "$RES_PGAPPLY" ]; then VERDICT=MATCH; else VERDICT=MISMATCH; fi

{
    echo "# pgapply catch-up benchmark"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), pgapply $GIT_REV, made by bench/run.sh"
    echo
    echo "- machine: $(nproc) CPUs ($CPU_MODEL), kernel $(uname -r)"
    echo "- PostgreSQL $PG_VERSION, source and target clusters on the same machine"
    echo "- SCALE=$SCALE TXNS=$TXNS ($NTXN run) ROUNDS=$ROUNDS CLIENTS=$CLIENTS; row changes = $ROWS_PER_TXN per transaction (3 UPDATE + 1 INSERT)"
    echo "- built-in: subscription with synchronous_commit = off, timed from ENABLE until the slot's confirmed_flush_lsn reaches the round's end LSN; CPU = apply worker"
    echo "- pgapply: \`pgapply run --endpos${PGAPPLY_ARGS:+ $PGAPPLY_ARGS}\`, timed until it exits; CPU = pgapply process + its target backends (sampled every 50ms)"
    echo "$TABLE"
    echo "$SUMMARY"
    echo
    echo "$CEILING"
    echo
    echo "Correctness (sum(abalance) count(accounts) sum(tbalance) sum(bbalance) count(history)): $VERDICT"
    echo
    echo "- source: $RES_SRC"
    echo "- target_builtin: $RES_BUILTIN"
    echo "- target_pgapply: $RES_PGAPPLY"
} >"$RESULTS"

echo
echo "pgapply catch-up benchmark: SCALE=$SCALE, $NTXN txns/round, $ROUNDS round(s), $CLIENTS clients; PostgreSQL $PG_VERSION; $(nproc) CPUs; kernel $(uname -r)"
echo "row changes/s counts $ROWS_PER_TXN row changes per tpcb-like transaction (3 UPDATE + 1 INSERT)"
echo "$TABLE"
echo "$SUMMARY"
echo "$CEILING"
echo
echo "correctness: source [$RES_SRC] built-in [$RES_BUILTIN] pgapply [$RES_PGAPPLY]"
echo "$VERDICT"

# ---------------------------------------------------------------------------
# 8. initial copy (after the catch-up rounds, so it does not disturb them)
#
# Source database copysrc (pgbench -i -s COPY_SCALE, PUBLICATION copypub FOR ALL TABLES); two
# empty target databases with the same tables and primary keys (pgbench -i -I dtp). Built-in:
# CREATE SUBSCRIPTION with copy_data until every table is 'r' or 's'; pgapply: run --copy-data
# --endpos <source LSN taken just before>, until it exits. Built-in first, then pgapply.

COPY_VERDICT=SKIPPED
if [ "$COPY_BENCH" = 1 ]; then
    COPY_SRC_CONN="host=127.0.0.1 port=$SRC_PORT user=postgres dbname=copysrc"
    log "initial copy: pgbench scale $COPY_SCALE in source database copysrc"
    q "$SRC_PORT" postgres "CREATE DATABASE copysrc" >/dev/null
    "$PG_BIN/pgbench" -i -q -s "$COPY_SCALE" -h 127.0.0.1 -p "$SRC_PORT" -U postgres copysrc >"$WORK/init-copysrc.log" 2>&1 ||
        { cat "$WORK/init-copysrc.log" >&2; die "pgbench -i failed for copysrc"; }
    q "$SRC_PORT" copysrc "CREATE PUBLICATION copypub FOR ALL TABLES" >/dev/null
    IDX_SQL="SELECT string_agg(tablename || '.' || indexname, ' ' ORDER BY indexname) FROM pg_indexes WHERE schemaname = 'public'"
    idx_src="$(q "$SRC_PORT" copysrc "$IDX_SQL")"
    copy_fresh_target() {  # db [steps]: an empty copy of the tables, with their primary keys unless steps say otherwise
        local steps="${2:-dtp}"
        q "$TGT_PORT" postgres "DROP DATABASE IF EXISTS $1" >/dev/null
        q "$TGT_PORT" postgres "CREATE DATABASE $1" >/dev/null
        # d: drop, t: create tables, p: primary keys -- no data
        "$PG_BIN/pgbench" -i -q -s 1 -I "$steps" -h 127.0.0.1 -p "$TGT_PORT" -U postgres "$1" >"$WORK/init-$1.log" 2>&1 ||
            { cat "$WORK/init-$1.log" >&2; die "pgbench -i -I $steps failed for $1"; }
        [ "$steps" != dtp ] || [ "$(q "$TGT_PORT" "$1" "$IDX_SQL")" = "$idx_src" ] || die "indexes of $1 differ from copysrc"
        [ "$(q "$TGT_PORT" "$1" "SELECT count(*) FROM pgbench_accounts")" = 0 ] || die "$1 is not empty"
    }
    COPY_TABLES="$(q "$SRC_PORT" copysrc "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'copypub'")"
    COPY_BYTES="$(q "$SRC_PORT" copysrc "SELECT sum(pg_total_relation_size(format('%I.%I', schemaname, tablename)::regclass))
        FROM pg_publication_tables WHERE pubname = 'copypub'")"
    COPY_MB="$(calc "$COPY_BYTES / 1048576" 1)"
    if [ -f "$("$PG_BIN/pg_config" --sharedir 2>/dev/null)/extension/pg_prewarm.control" ]; then
        # Both appliers read the source from shared_buffers, not the first one from disk.
        q "$SRC_PORT" copysrc "CREATE EXTENSION pg_prewarm" >/dev/null
        q "$SRC_PORT" copysrc "SELECT sum(pg_prewarm(c.oid)) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = 'public' AND c.relname LIKE 'pgbench%' AND c.relkind IN ('r', 'i')" >/dev/null
    fi
    q "$SRC_PORT" copysrc "CHECKPOINT" >/dev/null
    COPY_CHECK_SQL="SELECT count(*) || ' ' || sum(abalance) FROM pgbench_accounts"
    COPY_SRC_RES="$(q "$SRC_PORT" copysrc "$COPY_CHECK_SQL")"
    COPY_SYNC_WORKERS="$(q "$TGT_PORT" postgres "SHOW max_sync_workers_per_subscription")"
    log "initial copy: $COPY_TABLES tables, $COPY_MB MB; $COPY_ROUNDS round(s), built-in (max_sync_workers_per_subscription = $COPY_SYNC_WORKERS) and pgapply (--copy-jobs $COPY_JOBS)"

    copy_builtin() {  # round: sets COPY_SECS_builtin, COPY_RES_builtin
        copy_fresh_target copy_target_builtin
        # The launcher starts workers at most once per wal_retrieve_retry_interval (and then
        # sleeps a full interval): wait that out since the last ENABLE or CREATE SUBSCRIPTION
        # (untimed), as on an idle cluster the worker would start right away.
        if [ -n "$LAST_ENABLE_AT" ]; then
            pause="$(calc "$RETRY_MS / 1000 + 0.3 - ($(now) - $LAST_ENABLE_AT)")"
            if [ "$(calc "($pause > 0)" 0)" = 1 ]; then sleep "$pause"; fi
        fi
        q "$TGT_PORT" postgres "CHECKPOINT" >/dev/null
        t0="$(now)"
        LAST_ENABLE_AT="$t0"
        PGOPTIONS="-c client_min_messages=warning" q "$TGT_PORT" copy_target_builtin "CREATE SUBSCRIPTION copy_sub CONNECTION '$COPY_SRC_CONN' PUBLICATION copypub
            WITH (copy_data = true, create_slot = true, slot_name = 'copy_builtin', synchronous_commit = off)" >/dev/null
        "$PSQL" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$TGT_PORT" -U postgres -d copy_target_builtin >/dev/null <<SQL
DO \$\$
DECLARE deadline timestamptz := clock_timestamp() + interval '$CATCHUP_TIMEOUT seconds';
BEGIN
    WHILE (SELECT count(*) FILTER (WHERE r.srsubstate NOT IN ('r', 's')) > 0 OR count(*) = 0
           FROM pg_subscription_rel r JOIN pg_subscription s ON s.oid = r.srsubid WHERE s.subname = 'copy_sub') LOOP
        IF clock_timestamp() > deadline THEN
            RAISE EXCEPTION 'built-in initial copy not done within $CATCHUP_TIMEOUT s';
        END IF;
        PERFORM pg_sleep(0.05);
    END LOOP;
END
\$\$;
SQL
        t1="$(now)"
        COPY_SECS_builtin="$(calc "$t1 - $t0")"
        COPY_RES_builtin="$(q "$TGT_PORT" copy_target_builtin "$COPY_CHECK_SQL")"
        PGOPTIONS="-c client_min_messages=warning" q "$TGT_PORT" copy_target_builtin "DROP SUBSCRIPTION copy_sub" >/dev/null   # also drops slot copy_builtin
        log "initial copy, round $1: built-in $COPY_SECS_builtin s"
    }
    copy_pgapply() {  # round mode (before|after): sets COPY_SECS_<mode>, COPY_RES_<mode>
        local tgt="host=127.0.0.1 port=$TGT_PORT user=postgres dbname=copy_target_pgapply" secs post_secs
        local args=(--copy-data --copy-jobs "$COPY_JOBS")
        rm -f "$WORK/pgapply-postdata.log"   # (a failed copy must not show an earlier round's)
        if [ "$2" = after ]; then
            copy_fresh_target copy_target_pgapply dt   # tables without their keys (pre-data)
            args+=(--copy-only)
        else
            copy_fresh_target copy_target_pgapply
            args+=(--endpos "$(q "$SRC_PORT" copysrc "SELECT pg_current_wal_lsn()")")
        fi
        q "$TGT_PORT" postgres "CHECKPOINT" >/dev/null
        rc=0
        TIMEFORMAT='%3R %3U %3S'
        { time "$BIN" run --source "$COPY_SRC_CONN" --target "$tgt" --publication copypub --slot copy_pgapply "${args[@]}" \
            >"$WORK/pgapply-copy.log" 2>&1; } 2>"$WORK/time-copy" || rc=$?
        if [ "$rc" = 0 ] && [ "$2" = after ]; then
            { time PGAPPLY_PG_DUMP="$PG_BIN/pg_dump" "$BIN" schema --source "$COPY_SRC_CONN" --target "$tgt" \
                --publication copypub --section post-data >"$WORK/pgapply-postdata.log" 2>&1; } 2>"$WORK/time-postdata" || rc=$?
        fi
        unset TIMEFORMAT
        if [ "$rc" != 0 ]; then
            tail -n 30 "$WORK/pgapply-copy.log" >&2
            [ "$2" != after ] || tail -n 30 "$WORK/pgapply-postdata.log" >&2 2>/dev/null || true
            die "initial copy ($2): pgapply exited with status $rc (log above)"
        fi
        read -r secs copy_user copy_sys <"$WORK/time-copy"
        if [ "$2" = after ]; then
            read -r post_secs _ _ <"$WORK/time-postdata"
            log "initial copy, round $1: pgapply copy $secs s, then the keys (schema --section post-data) $post_secs s"
            secs="$(calc "$secs + $post_secs" 3)"
            [ "$(q "$TGT_PORT" copy_target_pgapply "$IDX_SQL")" = "$idx_src" ] || die "indexes of copy_target_pgapply differ from copysrc after post-data"
        fi
        printf -v "COPY_SECS_$2" '%s' "$secs"
        printf -v "COPY_RES_$2" '%s' "$(q "$TGT_PORT" copy_target_pgapply "$COPY_CHECK_SQL")"
        wait_slot_inactive copy_pgapply
        q "$SRC_PORT" copysrc "SELECT pg_drop_replication_slot('copy_pgapply')" >/dev/null
        log "initial copy, round $1: pgapply (keys $2) $secs s (pgapply process CPU $(calc "$copy_user + $copy_sys" 2) s)"
    }

    COPY_VERDICT=MATCH
    if [ "$COPY_INDEXES" = both ]; then COPY_MODES=(before after); else COPY_MODES=("$COPY_INDEXES"); fi
    copy_ratios_before=""
    copy_ratios_after=""
    COPY_TABLE="| round | order | built-in s | pgapply s, keys in place | pgapply s, keys after | built-in s / pgapply s, keys in place | built-in s / pgapply s, keys after |"$'\n'
    COPY_TABLE+="|------:|-------|-----------:|-------------------------:|----------------------:|--------------------------------------:|-----------------------------------:|"$'\n'
    for ((r = 1; r <= COPY_ROUNDS; r++)); do
        # The order alternates, as in the catch-up rounds: neither always goes first.
        COPY_SECS_before=""
        COPY_SECS_after=""
        if ((r % 2)); then
            order="built-in, pgapply"
            copy_builtin "$r"
            for m in "${COPY_MODES[@]}"; do copy_pgapply "$r" "$m"; done
        else
            order="pgapply, built-in"
            for m in "${COPY_MODES[@]}"; do copy_pgapply "$r" "$m"; done
            copy_builtin "$r"
        fi
        [ "$COPY_RES_builtin" = "$COPY_SRC_RES" ] || COPY_VERDICT=MISMATCH
        cells=()
        for m in before after; do
            secs_var="COPY_SECS_$m"
            res_var="COPY_RES_$m"
            if [ -n "${!secs_var}" ]; then
                [ "${!res_var}" = "$COPY_SRC_RES" ] || COPY_VERDICT=MISMATCH
                ratio="$(calc "$COPY_SECS_builtin / ${!secs_var}" 2)"
                if [ "$m" = before ]; then copy_ratios_before+=" $ratio"; else copy_ratios_after+=" $ratio"; fi
                cells+=("$(printf '%.2f' "${!secs_var}")" "x$ratio")
            else
                cells+=("-" "-")
            fi
        done
        COPY_TABLE+="$(printf '| %5s | %-17s | %10.2f | %24s | %21s | %37s | %34s |' "$r" "$order" "$COPY_SECS_builtin" \
            "${cells[0]}" "${cells[2]}" "${cells[1]}" "${cells[3]}")"$'\n'
    done
    COPY_SUMMARY=""
    if [ -n "$copy_ratios_before" ]; then
        COPY_RATIO="$(echo "$copy_ratios_before" | median)"
        COPY_SUMMARY+="Median built-in seconds / pgapply seconds over $COPY_ROUNDS round(s), keys in place: x$COPY_RATIO (above 1: pgapply faster)"$'\n'
    fi
    if [ -n "$copy_ratios_after" ]; then
        COPY_RATIO_AFTER="$(echo "$copy_ratios_after" | median)"
        COPY_SUMMARY+="Median built-in seconds / pgapply seconds over $COPY_ROUNDS round(s), keys built after the rows: x$COPY_RATIO_AFTER"$'\n'
    fi
    COPY_CORRECT="Correctness (count(*) sum(abalance) of pgbench_accounts, every copy): $COPY_VERDICT (source [$COPY_SRC_RES], last round: built-in [$COPY_RES_builtin] pgapply [${COPY_RES_before:-${COPY_RES_after:-}}])"
    {
        echo
        echo "## Initial copy"
        echo
        echo "- COPY_SCALE=$COPY_SCALE: $COPY_TABLES tables (pgbench, pgbench_history empty), $COPY_MB MB = sum of pg_total_relation_size of the published tables on the source (heap + primary key indexes)"
        echo "- $COPY_ROUNDS round(s), the order alternating (built-in first in odd rounds); each copy into new empty tables with the same primary keys (\`pgbench -i -I dtp\`); source tables prewarmed; target CHECKPOINT before each"
        echo "- built-in: timed from CREATE SUBSCRIPTION (copy_data = true, create_slot = true) until every table's srsubstate is 'r' or 's' (polled every 50 ms); max_sync_workers_per_subscription = $COPY_SYNC_WORKERS (default), so at most $COPY_SYNC_WORKERS tables copy at once, each by one worker"
        echo "- pgapply, keys in place: \`pgapply run --copy-data --copy-jobs $COPY_JOBS --endpos <source WAL LSN just before>\` into the same tables as the built-in's, timed until it exits"
        echo "- pgapply, keys after (the README's migration flow): tables without their primary keys (\`pgbench -i -I dt\`), \`pgapply run --copy-data --copy-only --copy-jobs $COPY_JOBS\`, then \`pgapply schema --section post-data\` (pg_dump, then the keys built on the target), timed from the start of the first to the end of the second"
        echo
        echo "$COPY_TABLE"
        echo "$COPY_SUMMARY"
        echo "$COPY_CORRECT"
    } >>"$RESULTS"
    echo
    echo "initial copy: COPY_SCALE=$COPY_SCALE, $COPY_TABLES tables, $COPY_MB MB (pg_total_relation_size); max_sync_workers_per_subscription = $COPY_SYNC_WORKERS, pgapply --copy-jobs $COPY_JOBS"
    echo
    echo "$COPY_TABLE"
    echo "$COPY_SUMMARY"
    echo "$COPY_CORRECT"
    echo "$COPY_VERDICT"
fi

# ---------------------------------------------------------------------------
# helpers for the latency and lag phases

new_pair() {  # srcdb tgtdb...: source database srcdb (pgbench -i, PUBLICATION <srcdb>_pub), target copies of the template
    local src="$1" db init
    shift
    q "$SRC_PORT" postgres "CREATE DATABASE $src" >/dev/null
    pgbench_init "$SRC_PORT" "$src"
    q "$SRC_PORT" "$src" "CREATE PUBLICATION ${src}_pub FOR ALL TABLES" >/dev/null
    init="$(q "$SRC_PORT" "$src" "$CHECK_SQL")"
    for db in "$@"; do
        q "$TGT_PORT" postgres "CREATE DATABASE $db TEMPLATE bench_template" >/dev/null
        [ "$(q "$TGT_PORT" "$db" "$CHECK_SQL")" = "$init" ] || die "initial data of $db differs from $src"
        prewarm "$TGT_PORT" "$db"
    done
    q "$SRC_PORT" "$src" "CHECKPOINT" >/dev/null
}

create_slot() {  # db slot
    q "$SRC_PORT" "$1" "SELECT pg_create_logical_replication_slot('$2', 'pgoutput')" >/dev/null
}

drop_slot() {  # slot (must be inactive)
    wait_slot_inactive "$1"
    q "$SRC_PORT" postgres "SELECT pg_drop_replication_slot('$1')" >/dev/null
}

# ---------------------------------------------------------------------------
# 9. latency hiding (after the other phases, in databases of its own)
#
# Source database latsrc gets one backlog of LATENCY_TXNS tpcb-like transactions while nothing
# applies it; one slot per mode (created before the backlog) feeds its own target copy of the
# template. pgapply catches up to the same end LSN in each mode: directly into lat_direct; through
# examples/delay_proxy.rs with no delay into lat_proxy0 (what the proxy itself costs); through the
# proxy adding DELAY_MS in each direction into lat_delay; and (LAT_WORKERS > 1) through that proxy
# again with --apply-workers LAT_WORKERS into lat_workers. With enough pipelining the delay costs
# little throughput; a round trip per transaction would cost ~2*DELAY_MS each.

LAT_VERDICT=SKIPPED
if [ "$LATENCY_BENCH" = 1 ]; then
    LAT_NTXN=$((LAT_PER_CLIENT * CLIENTS))
    log "latency hiding: $LAT_NTXN tpcb-like transactions in source database latsrc; pgapply directly, then through a proxy adding 0 and $DELAY_MS ms each way"
    LAT_MODES="direct proxy0 delay"
    [ "$LAT_WORKERS" -gt 1 ] && LAT_MODES+=" workers"
    # shellcheck disable=SC2086 # one database per mode
    new_pair latsrc $(for m in $LAT_MODES; do echo "lat_$m"; done)
    for m in $LAT_MODES; do create_slot latsrc "lat_$m"; done
    "$PG_BIN/pgbench" -n -t "$LAT_PER_CLIENT" -c "$CLIENTS" -j "$JOBS" -h 127.0.0.1 -p "$SRC_PORT" -U postgres latsrc \
        >"$WORK/pgbench-latency.log" 2>&1 || { cat "$WORK/pgbench-latency.log" >&2; die "pgbench failed (latency phase)"; }
    lat_end="$(q "$SRC_PORT" latsrc "SELECT pg_current_wal_flush_lsn()")"

    start_proxy() {  # delay_ms log -> sets STARTED_PORT, STARTED_PID
        local port pid
        port="$(free_port)"
        "$PROXY_BIN" "$port" "$TGT_PORT" "$1" >"$2" 2>&1 &
        pid=$!
        for ((i = 0; i < 100; i++)); do
            grep -q '^ready' "$2" && break
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        grep -q '^ready' "$2" || { cat "$2" >&2; die "the delay proxy did not start"; }
        STARTED_PORT="$port"
        STARTED_PID="$pid"
    }
    start_proxy "$DELAY_MS" "$WORK/proxy.log"
    PROXY_PORT="$STARTED_PORT"
    PROXY_PID="$STARTED_PID"
    start_proxy 0 "$WORK/proxy0.log"
    PROXY0_PORT="$STARTED_PORT"
    PROXY0_PID="$STARTED_PID"

    # The round trip a client sees: average latency of 200 one-statement transactions, 1 client.
    echo "SELECT 1;" >"$WORK/select1.sql"
    rtt_ms() {  # port
        "$PG_BIN/pgbench" -n -t 200 -c 1 -f "$WORK/select1.sql" -h 127.0.0.1 -p "$1" -U postgres postgres 2>&1 |
            sed -n 's/^latency average = \([0-9.]*\) ms$/\1/p'
    }
    RTT_direct="$(rtt_ms "$TGT_PORT")"
    RTT_proxy0="$(rtt_ms "$PROXY0_PORT")"
    RTT_delay="$(rtt_ms "$PROXY_PORT")"
    log "latency hiding: SELECT 1 round trip ${RTT_direct:-?} ms direct, ${RTT_proxy0:-?} ms through the proxy with no delay, ${RTT_delay:-?} ms with the delay"

    declare -A LAT_SECS=() LAT_CPU=() LAT_PROXY_CPU=()
    for mode in $LAT_MODES; do
        port="$PROXY_PORT"
        [ "$mode" = direct ] && port="$TGT_PORT"
        [ "$mode" = proxy0 ] && port="$PROXY0_PORT"
        workers=1
        [ "$mode" = workers ] && workers="$LAT_WORKERS"
        # Each mode's target is loaded into shared_buffers just before its run: the targets of
        # all modes together may not fit.
        prewarm "$TGT_PORT" "lat_$mode"
        q "$TGT_PORT" postgres "CHECKPOINT" >/dev/null
        proxy_pid=""
        [ "$mode" = proxy0 ] && proxy_pid="$PROXY0_PID"
        [ "$mode" != direct ] && [ "$mode" != proxy0 ] && proxy_pid="$PROXY_PID"
        proxy_before=0
        [ -n "$proxy_pid" ] && proxy_before="$(proc_cpu_ticks "$proxy_pid")"
        rc=0
        TIMEFORMAT='%3R %3U %3S'
        { time "$BIN" run --source "host=127.0.0.1 port=$SRC_PORT user=postgres dbname=latsrc" \
            --target "host=127.0.0.1 port=$port user=postgres dbname=lat_$mode" \
            --publication latsrc_pub --slot "lat_$mode" --endpos "$lat_end" --status-interval 1s \
            --apply-workers "$workers" >"$WORK/pgapply-lat-$mode.log" 2>&1; } 2>"$WORK/time-lat-$mode" || rc=$?
        unset TIMEFORMAT
        if [ "$rc" != 0 ]; then
            tail -n 30 "$WORK/pgapply-lat-$mode.log" >&2
            die "latency hiding ($mode): pgapply exited with status $rc (log above)"
        fi
        read -r lat_wall lat_user lat_sys <"$WORK/time-lat-$mode"
        LAT_SECS[$mode]="$lat_wall"
        LAT_CPU[$mode]="$(calc "$lat_user + $lat_sys" 2)"
        LAT_PROXY_CPU[$mode]="-"
        if [ -n "$proxy_pid" ]; then
            LAT_PROXY_CPU[$mode]="$(calc "($(proc_cpu_ticks "$proxy_pid") - $proxy_before) / $CLK_TCK" 2)"
        fi
        drop_slot "lat_$mode"
        log "latency hiding: $mode ${LAT_SECS[$mode]} s (pgapply CPU ${LAT_CPU[$mode]} s, proxy CPU ${LAT_PROXY_CPU[$mode]} s)"
    done
    for p in "$PROXY_PID" "$PROXY0_PID"; do
        kill "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    PROXY_PID=""
    PROXY0_PID=""

    LAT_SRC_RES="$(q "$SRC_PORT" latsrc "$CHECK_SQL")"
    LAT_RES_direct="$(q "$TGT_PORT" lat_direct "$CHECK_SQL")"
    LAT_RES_proxy0="$(q "$TGT_PORT" lat_proxy0 "$CHECK_SQL")"
    LAT_RES_delay="$(q "$TGT_PORT" lat_delay "$CHECK_SQL")"
    LAT_RES_workers="$LAT_SRC_RES"
    [ "$LAT_WORKERS" -gt 1 ] && LAT_RES_workers="$(q "$TGT_PORT" lat_workers "$CHECK_SQL")"
    if [ "$LAT_RES_direct" = "$LAT_SRC_RES" ] && [ "$LAT_RES_proxy0" = "$LAT_SRC_RES" ] && [ "$LAT_RES_delay" = "$LAT_SRC_RES" ] && [ "$LAT_RES_workers" = "$LAT_SRC_RES" ]; then LAT_VERDICT=MATCH; else LAT_VERDICT=MISMATCH; fi
    LAT_RATIO="$(calc "${LAT_SECS[direct]} / ${LAT_SECS[delay]}" 2)"
    LAT_GOAL=met
    [ "$(calc "$LAT_RATIO >= 0.8" 0)" = 1 ] || LAT_GOAL="not met"
    LAT_TABLE="| pgapply target connection        | seconds | txn/s | row changes/s | pgapply CPU s | proxy CPU s |"$'\n'
    LAT_TABLE+="|----------------------------------|--------:|------:|--------------:|--------------:|------------:|"$'\n'
    for mode in $LAT_MODES; do
        name="direct"
        [ "$mode" = proxy0 ] && name="through proxy, no delay"
        [ "$mode" = delay ] && name="through proxy, +$DELAY_MS ms each way"
        [ "$mode" = workers ] && name="the same, --apply-workers $LAT_WORKERS"
        LAT_TABLE+="$(printf '| %-32s | %7.2f | %5.0f | %13.0f | %13s | %11s |' "$name" "${LAT_SECS[$mode]}" \
            "$(calc "$LAT_NTXN / ${LAT_SECS[$mode]}" 1)" "$(calc "$LAT_NTXN * $ROWS_PER_TXN / ${LAT_SECS[$mode]}" 1)" \
            "${LAT_CPU[$mode]}" "${LAT_PROXY_CPU[$mode]}")"$'\n'
    done
    LAT_SUMMARY="throughput with delay / without: x$LAT_RATIO (goal >= 0.8: $LAT_GOAL); the proxy alone: x$(calc "${LAT_SECS[direct]} / ${LAT_SECS[proxy0]}" 2)"
    if [ "$LAT_WORKERS" -gt 1 ]; then
        LAT_SUMMARY+="; with --apply-workers $LAT_WORKERS: x$(calc "${LAT_SECS[direct]} / ${LAT_SECS[workers]}" 2)"
    fi
    LAT_RTT="round trip of SELECT 1 (pgbench, 1 client, average): direct ${RTT_direct:-?} ms, through the proxy ${RTT_proxy0:-?} ms with no delay and ${RTT_delay:-?} ms with the delay"
    LAT_CORRECT="Correctness ($CHECK_DESC): $LAT_VERDICT (source [$LAT_SRC_RES] direct [$LAT_RES_direct] proxy [$LAT_RES_proxy0] delayed [$LAT_RES_delay] workers [$LAT_RES_workers])"
    {
        echo
        echo "## Latency hiding"
        echo
        echo "- one backlog of $LAT_NTXN tpcb-like transactions (SCALE=$SCALE, $CLIENTS clients) in source database latsrc, applied by \`pgapply run --endpos\` once per row of the table, each into its own prewarmed target copy and slot"
        echo "- proxy: the target connection goes through examples/delay_proxy.rs (127.0.0.1), which holds every chunk DELAY_MS=$DELAY_MS ms (or 0 ms) in each direction without limiting throughput"
        echo "- $LAT_RTT"
        echo
        echo "$LAT_TABLE"
        echo "$LAT_SUMMARY"
        echo
        echo "$LAT_CORRECT"
    } >>"$RESULTS"
    echo
    echo "latency hiding: $LAT_NTXN transactions, target delay $DELAY_MS ms each way"
    echo "$LAT_RTT"
    echo
    echo "$LAT_TABLE"
    echo "$LAT_SUMMARY"
    echo "$LAT_CORRECT"
    echo "$LAT_VERDICT"
fi

# ---------------------------------------------------------------------------
# 10. lag under load
#
# For each applier in turn (built-in, then pgapply): a source database lagsrc_<applier> and a
# target copy lag_<applier>, a fresh slot, the applier running and idle; then pgbench -R RATE for
# LAG_SECONDS. A sampler on the source (database postgres) records every 200 ms the time,
# pg_current_wal_lsn() and the slot's confirmed_flush_lsn. The lag of a sample is now minus the
# time the source WAL reached the confirmed position (interpolated between the two samples
# around it); 0 when confirmed has reached the current WAL. p50/p99 over the samples taken
# while pgbench ran.

LAG_VERDICT=SKIPPED
if [ "$LAG_BENCH" = 1 ]; then
    RATE_NOTE="RATE given"
    if [ -z "$RATE" ]; then
        bi_tps=""
        for ((r = 1; r <= ROUNDS; r++)); do bi_tps+=" $(calc "$NTXN / ${SECS_builtin[r]}" 1)"; done
        bi_tps="$(echo "$bi_tps" | median)"
        src_tps="$(echo "${SRC_TPS[*]}" | median)"
        if [ "$bi_tps" != n/a ]; then
            RATE="$(calc "0.8 * $bi_tps" 0)"
            RATE_NOTE="80% of the built-in's median catch-up rate ($bi_tps txn/s)"
            if [ "$src_tps" != n/a ] && [ "$(calc "0.8 * $src_tps < $RATE" 0)" = 1 ]; then
                RATE="$(calc "0.8 * $src_tps" 0)"
                RATE_NOTE="80% of the source's own pgbench rate ($src_tps tps; below 80% of the built-in's catch-up rate, $bi_tps txn/s)"
            fi
        fi
        if ! [[ "$RATE" =~ ^[1-9][0-9]*$ ]]; then
            RATE=2000
            RATE_NOTE="fallback"
        fi
    fi
    log "lag under load: pgbench -R $RATE for $LAG_SECONDS s per applier ($RATE_NOTE)"
    q "$SRC_PORT" postgres "CREATE UNLOGGED TABLE lag_samples (run text, t float8, cur numeric, conf numeric)" >/dev/null
    q "$SRC_PORT" postgres "CREATE UNLOGGED TABLE lag_stop (run text)" >/dev/null

    wait_slot_active() {  # slot [pid that must stay alive]
        local i
        for ((i = 0; i < 600; i++)); do
            [ "$(q "$SRC_PORT" postgres "SELECT active FROM pg_replication_slots WHERE slot_name = '$1'")" = t ] && return
            if [ -n "${2:-}" ] && ! kill -0 "$2" 2>/dev/null; then return 1; fi
            sleep 0.1
        done
        return 1
    }

    declare -A LAG_STATS=() LAG_TPS=() LAG_RES=() LAG_SRC_RES=() LAG_CPU=() LAG_WS_CPU=()

    # The applier's processes while it follows the load: the built-in's apply worker, or pgapply
    # and its sessions on the target; and the walsender that feeds it (the slot's active pid).
    lag_applier_pids() {  # builtin|pgapply db
        if [ "$1" = builtin ]; then
            q "$TGT_PORT" "$2" "SELECT pid FROM pg_stat_subscription WHERE subname = 'lag_sub' AND pid IS NOT NULL"
        else
            echo "$LAG_APPLIER_PID"
            q "$TGT_PORT" postgres "SELECT pid FROM pg_stat_activity WHERE datname = '$2' AND backend_type = 'client backend'"
        fi
    }
    ticks_of() {  # pid... -> "pid:ticks" per line
        local pid
        for pid in "$@"; do echo "$pid:$(proc_cpu_ticks "$pid")"; done
    }
    ticks_delta() {  # "before" "after" (ticks_of lines) -> seconds used in between by those processes
        awk -v tck="$CLK_TCK" -v before="$1" -v after="$2" 'BEGIN {
            n = split(before, b, "\n"); for (i = 1; i <= n; i++) { split(b[i], kv, ":"); was[kv[1]] = kv[2] + 0 }
            n = split(after, a, "\n"); for (i = 1; i <= n; i++) { split(a[i], kv, ":"); if (kv[2] != "") sum += kv[2] - was[kv[1]] }
            printf("%.2f", sum / tck) }'
    }
    lag_run() {  # builtin|pgapply
        local a="$1" src="lagsrc_$1" db="lag_$1" slot="lag_$1" t0 t1 end rc=0
        local src_conn="host=127.0.0.1 port=$SRC_PORT user=postgres dbname=$src"
        new_pair "$src" "$db"
        create_slot "$src" "$slot"
        q "$TGT_PORT" postgres "CHECKPOINT" >/dev/null
        if [ "$a" = builtin ]; then
            q "$TGT_PORT" "$db" "CREATE SUBSCRIPTION lag_sub CONNECTION '$src_conn' PUBLICATION ${src}_pub
                WITH (copy_data = false, create_slot = false, slot_name = '$slot', synchronous_commit = off)" >/dev/null
            wait_slot_active "$slot" ||
                { tail -n 30 "$TGT_LOG" >&2; die "lag ($a): the subscription did not start streaming within 60 s (target server log above)"; }
        else
            "$BIN" run --source "$src_conn" --target "host=127.0.0.1 port=$TGT_PORT user=postgres dbname=$db" \
                --publication "${src}_pub" --slot "$slot" --status-interval 1s >"$WORK/pgapply-lag.log" 2>&1 &
            LAG_APPLIER_PID=$!
            wait_slot_active "$slot" "$LAG_APPLIER_PID" ||
                { tail -n 30 "$WORK/pgapply-lag.log" >&2; die "lag ($a): pgapply did not start streaming (log above)"; }
        fi

        "$PSQL" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$SRC_PORT" -U postgres -d postgres >"$WORK/lag-sampler-$a.log" 2>&1 <<SQL &
DO \$\$
DECLARE
    next float8 := extract(epoch FROM clock_timestamp());
    deadline timestamptz := clock_timestamp() + interval '$((LAG_SECONDS + CATCHUP_TIMEOUT + 120)) seconds';
BEGIN
    LOOP
        INSERT INTO lag_samples
            SELECT '$a', extract(epoch FROM clock_timestamp()), pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0'),
                   pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')
            FROM pg_replication_slots WHERE slot_name = '$slot';
        COMMIT;
        EXIT WHEN EXISTS (SELECT FROM lag_stop WHERE run = '$a') OR clock_timestamp() > deadline;
        next := next + 0.2;
        PERFORM pg_sleep(greatest(0, next - extract(epoch FROM clock_timestamp())));
    END LOOP;
END
\$\$;
SQL
        LAG_SAMPLER_PID=$!
        sleep 1
        local pids ws_pid cpu0 ws0
        pids="$(lag_applier_pids "$a" "$db")"
        ws_pid="$(q "$SRC_PORT" postgres "SELECT active_pid FROM pg_replication_slots WHERE slot_name = '$slot'")"
        # shellcheck disable=SC2086
        cpu0="$(ticks_of $pids)"
        ws0="$(ticks_of "$ws_pid")"
        t0="$(now)"
        "$PG_BIN/pgbench" -n -R "$RATE" -T "$LAG_SECONDS" -c "$CLIENTS" -j "$JOBS" -h 127.0.0.1 -p "$SRC_PORT" -U postgres "$src" \
            >"$WORK/pgbench-lag-$a.log" 2>&1 || { cat "$WORK/pgbench-lag-$a.log" >&2; die "pgbench failed (lag phase, $a)"; }
        t1="$(now)"
        end="$(q "$SRC_PORT" "$src" "SELECT pg_current_wal_flush_lsn()")"
        wait_confirmed "$slot" "$end"
        # (Sessions pgapply opened during the load count whole: they started after t0.)
        pids="$(printf '%s\n%s\n' "$pids" "$(lag_applier_pids "$a" "$db")" | sort -u)"
        # shellcheck disable=SC2086
        LAG_CPU[$a]="$(ticks_delta "$cpu0" "$(ticks_of $pids)")"
        LAG_WS_CPU[$a]="$(ticks_delta "$ws0" "$(ticks_of "$ws_pid")")"
        q "$SRC_PORT" postgres "INSERT INTO lag_stop VALUES ('$a')" >/dev/null
        wait "$LAG_SAMPLER_PID" || { cat "$WORK/lag-sampler-$a.log" >&2; die "lag ($a): the sampler failed"; }
        LAG_SAMPLER_PID=""

        if [ "$a" = builtin ]; then
            PGOPTIONS="-c client_min_messages=warning" q "$TGT_PORT" "$db" "DROP SUBSCRIPTION lag_sub" >/dev/null   # drops the slot too
        else
            kill -TERM "$LAG_APPLIER_PID"
            wait "$LAG_APPLIER_PID" || rc=$?
            LAG_APPLIER_PID=""
            if [ "$rc" != 0 ]; then
                tail -n 30 "$WORK/pgapply-lag.log" >&2
                die "lag ($a): pgapply exited with status $rc after SIGTERM (log above)"
            fi
            drop_slot "$slot"
        fi

        LAG_STATS[$a]="$(q "$SRC_PORT" postgres "
            WITH s AS (SELECT t, cur, conf FROM lag_samples WHERE run = '$a'),
            l AS (
                SELECT CASE WHEN x.conf >= x.cur THEN 0
                    ELSE greatest(0, x.t - CASE WHEN pv.t IS NULL OR nx.cur = pv.cur THEN nx.t
                        ELSE pv.t + (nx.t - pv.t) * ((x.conf - pv.cur) / (nx.cur - pv.cur))::float8 END) END AS lag
                FROM s x
                CROSS JOIN LATERAL (SELECT s.t, s.cur FROM s WHERE s.cur >= x.conf ORDER BY s.t LIMIT 1) nx
                LEFT JOIN LATERAL (SELECT s.t, s.cur FROM s WHERE s.t < nx.t ORDER BY s.t DESC LIMIT 1) pv ON true
                WHERE x.t BETWEEN $t0 AND $t1)
            SELECT count(*) || ' ' || coalesce(round(percentile_cont(0.5) WITHIN GROUP (ORDER BY lag)::numeric, 3)::text, 'n/a')
                || ' ' || coalesce(round(percentile_cont(0.99) WITHIN GROUP (ORDER BY lag)::numeric, 3)::text, 'n/a')
                || ' ' || coalesce(round(max(lag)::numeric, 3)::text, 'n/a') FROM l")"
        LAG_TPS[$a]="$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$WORK/pgbench-lag-$a.log" | head -n 1)"
        LAG_SRC_RES[$a]="$(q "$SRC_PORT" "$src" "$CHECK_SQL")"
        LAG_RES[$a]="$(q "$TGT_PORT" "$db" "$CHECK_SQL")"
        log "lag under load ($a): samples p50 p99 max = ${LAG_STATS[$a]}; pgbench ${LAG_TPS[$a]:-?} tps; applier CPU ${LAG_CPU[$a]} s, walsender CPU ${LAG_WS_CPU[$a]} s"
    }
    lag_run builtin
    lag_run pgapply

    LAG_VERDICT=MATCH
    LAG_CORRECT="Correctness ($CHECK_DESC):"
    LAG_TABLE="| applier  | load txn/s | samples | p50 lag s | p99 lag s | max lag s | applier CPU s/1k txn | walsender CPU s/1k txn |"$'\n'
    LAG_TABLE+="|----------|-----------:|--------:|----------:|----------:|----------:|---------------------:|-----------------------:|"$'\n'
    for a in builtin pgapply; do
        name=built-in
        [ "$a" = pgapply ] && name=pgapply
        read -r n p50 p99 mx <<<"${LAG_STATS[$a]}"
        txns="$(calc "${LAG_TPS[$a]:-0} * $LAG_SECONDS" 0)"
        per_k() { if [ "$txns" -gt 0 ]; then calc "$1 / ($txns / 1000)" 4; else echo n/a; fi; }
        LAG_TABLE+="$(printf '| %-8s | %10.0f | %7s | %9s | %9s | %9s | %20s | %22s |' "$name" "${LAG_TPS[$a]:-0}" "$n" "$p50" "$p99" "$mx" \
            "$(per_k "${LAG_CPU[$a]}")" "$(per_k "${LAG_WS_CPU[$a]}")")"$'\n'
        [ "${LAG_RES[$a]}" = "${LAG_SRC_RES[$a]}" ] || LAG_VERDICT=MISMATCH
        LAG_CORRECT+=" $name source [${LAG_SRC_RES[$a]}] target [${LAG_RES[$a]}];"
    done
    LAG_CORRECT="${LAG_CORRECT%;} -> $LAG_VERDICT"
    LAG_SETUP="pgbench -R $RATE ($RATE_NOTE) -T $LAG_SECONDS, $CLIENTS clients, SCALE=$SCALE, applier running; lag sampled every 200 ms on the source"
    {
        echo
        echo "## Lag under load"
        echo
        echo "- $LAG_SETUP; built-in first, then pgapply, each with its own source database, slot and prewarmed target copy"
        echo "- lag of a sample = its time minus the time the source WAL (pg_current_wal_lsn()) reached the slot's confirmed_flush_lsn (interpolated between samples; 0 once confirmed reaches the current WAL); percentiles over the samples taken while pgbench ran"
        echo "- load txn/s: what pgbench achieved (below RATE: the source could not keep the schedule)"
        echo "- CPU per 1k transactions of the load, from the load's start until the slot confirmed its end: applier = the built-in's apply worker, or pgapply's process and its target sessions; walsender = the source's process that feeds it"
        echo
        echo "$LAG_TABLE"
        echo "$LAG_CORRECT"
    } >>"$RESULTS"
    echo
    echo "lag under load: $LAG_SETUP"
    echo
    echo "$LAG_TABLE"
    echo "$LAG_CORRECT"
    echo "$LAG_VERDICT"
fi

# ---------------------------------------------------------------------------
# 11. one large transaction
#
# Source database bigsrc, table big (id int PRIMARY KEY, v int, pad text), published; one
# transaction inserts BIGTXN_ROWS rows and updates half of them, far beyond
# logical_decoding_work_mem, so the source streams it while it runs. Slots made before it feed:
# the built-in subscriber with streaming = on (and, on 16+, streaming = parallel), each into a
# target database of its own, then pgapply (streaming on: spooled to disk, applied at commit;
# and, on 16+, --streaming parallel: applied as it arrives on a second session).
# Time: from enabling the subscriber / starting pgapply until the slot confirms the commit.
# pgapply's peak RSS comes from GNU time (/usr/bin/time) when it is installed.

BIG_VERDICT=SKIPPED
if [ "$BIGTXN_BENCH" = 1 ]; then
    BIG_MODES="on"
    PGA_MODES="pgapply"
    if [ "$(q "$SRC_PORT" postgres "SHOW server_version_num")" -ge 160000 ]; then
        BIG_MODES="on parallel"
        PGA_MODES="pgapply pgapply_parallel"
    fi
    log "large transaction: $BIGTXN_ROWS rows inserted and $((BIGTXN_ROWS / 2)) updated in one transaction; built-in streaming = ${BIG_MODES// / and }, then pgapply"
    BIG_TABLE_SQL="CREATE TABLE big (id int PRIMARY KEY, v int NOT NULL, pad text NOT NULL)"
    BIG_CHECK="SELECT count(*) || ' ' || sum(v) || ' ' || sum(length(pad)) FROM big"
    q "$SRC_PORT" postgres "CREATE DATABASE bigsrc" >/dev/null
    q "$SRC_PORT" bigsrc "$BIG_TABLE_SQL" >/dev/null
    q "$SRC_PORT" bigsrc "CREATE PUBLICATION big_pub FOR TABLE big" >/dev/null
    big_conn="host=127.0.0.1 port=$SRC_PORT user=postgres dbname=bigsrc"
    for m in $BIG_MODES $PGA_MODES; do
        q "$TGT_PORT" postgres "CREATE DATABASE big_$m" >/dev/null
        q "$TGT_PORT" "big_$m" "$BIG_TABLE_SQL" >/dev/null
        create_slot bigsrc "big_$m"
        if [[ "$m" != pgapply* ]]; then
            q "$TGT_PORT" "big_$m" "CREATE SUBSCRIPTION big_sub_$m CONNECTION '$big_conn' PUBLICATION big_pub
                WITH (copy_data = false, create_slot = false, slot_name = 'big_$m', enabled = false,
                      synchronous_commit = off, streaming = $m)" >/dev/null
        fi
    done
    q "$SRC_PORT" bigsrc "BEGIN; INSERT INTO big SELECT g, 0, repeat('x', 40) FROM generate_series(1, $BIGTXN_ROWS) g;
        UPDATE big SET v = 1 WHERE id % 2 = 0; COMMIT;" >/dev/null
    big_end="$(q "$SRC_PORT" bigsrc "SELECT pg_current_wal_flush_lsn()")"
    BIG_SRC_RES="$(q "$SRC_PORT" bigsrc "$BIG_CHECK")"
    q "$SRC_PORT" bigsrc "CHECKPOINT" >/dev/null
    declare -A BIG_SECS=() BIG_RES=()
    for m in $BIG_MODES; do
        q "$TGT_PORT" postgres "CHECKPOINT" >/dev/null
        t0="$(now)"
        q "$TGT_PORT" "big_$m" "ALTER SUBSCRIPTION big_sub_$m ENABLE" >/dev/null
        wait_confirmed "big_$m" "$big_end"
        t1="$(now)"
        BIG_SECS[$m]="$(calc "$t1 - $t0" 2)"
        PGOPTIONS="-c client_min_messages=warning" q "$TGT_PORT" "big_$m" "DROP SUBSCRIPTION big_sub_$m" >/dev/null
        BIG_RES[$m]="$(q "$TGT_PORT" "big_$m" "$BIG_CHECK")"
        log "large transaction: built-in streaming = $m ${BIG_SECS[$m]} s"
    done
    declare -A BIG_RSS=()
    for m in $PGA_MODES; do
        q "$TGT_PORT" postgres "CHECKPOINT" >/dev/null
        streaming=on
        [ "$m" = pgapply_parallel ] && streaming=parallel
        big_cmd=("$BIN" run --source "$big_conn" --target "host=127.0.0.1 port=$TGT_PORT user=postgres dbname=big_$m"
            --publication big_pub --slot "big_$m" --endpos "$big_end" --status-interval 1s --spool-dir "$WORK/spool"
            --streaming "$streaming")
        rc=0
        BIG_RSS[$m]=n/a
        t0="$(now)"
        if [ -x /usr/bin/time ] && /usr/bin/time -f '%M' true >/dev/null 2>&1; then
            /usr/bin/time -o "$WORK/big-time" -f '%M' "${big_cmd[@]}" >"$WORK/pgapply-big.log" 2>&1 || rc=$?
            BIG_RSS[$m]="$(calc "$(tail -n 1 "$WORK/big-time") / 1024" 0) MB"
        else
            "${big_cmd[@]}" >"$WORK/pgapply-big.log" 2>&1 || rc=$?
        fi
        t1="$(now)"
        if [ "$rc" != 0 ]; then
            tail -n 30 "$WORK/pgapply-big.log" >&2
            die "large transaction: pgapply (--streaming $streaming) exited with status $rc (log above)"
        fi
        BIG_SECS[$m]="$(calc "$t1 - $t0" 2)"
        BIG_RES[$m]="$(q "$TGT_PORT" "big_$m" "$BIG_CHECK")"
        log "large transaction: pgapply --streaming $streaming ${BIG_SECS[$m]} s, peak RSS ${BIG_RSS[$m]}"
        drop_slot "big_$m"
    done

    BIG_VERDICT=MATCH
    BIG_TABLE="| applier                                     | seconds | ratio (built-in s / pgapply s) |"$'\n'
    BIG_TABLE+="|---------------------------------------------|--------:|-------------------------------:|"$'\n'
    for m in $BIG_MODES; do
        BIG_TABLE+="$(printf '| %-43s | %7.2f | %30s |' "built-in, streaming = $m" "${BIG_SECS[$m]}" "x$(calc "${BIG_SECS[$m]} / ${BIG_SECS[pgapply]}" 2)")"$'\n'
        [ "${BIG_RES[$m]}" = "$BIG_SRC_RES" ] || BIG_VERDICT=MISMATCH
    done
    for m in $PGA_MODES; do
        name="pgapply --streaming on (peak RSS ${BIG_RSS[$m]})"
        ratio=""
        if [ "$m" = pgapply_parallel ]; then
            name="pgapply --streaming parallel (peak RSS ${BIG_RSS[$m]})"
            ratio="vs built-in parallel: x$(calc "${BIG_SECS[parallel]} / ${BIG_SECS[$m]}" 2)"
        fi
        BIG_TABLE+="$(printf '| %-43s | %7.2f | %30s |' "$name" "${BIG_SECS[$m]}" "$ratio")"$'\n'
        [ "${BIG_RES[$m]}" = "$BIG_SRC_RES" ] || BIG_VERDICT=MISMATCH
    done
    BIG_NOTE=""
    [ "$BIG_MODES" = on ] && BIG_NOTE="streaming = parallel needs PostgreSQL 16+ (these servers: $PG_VERSION)"
    BIG_CORRECT="Correctness (count(*) sum(v) sum(length(pad)) of big): $BIG_VERDICT (source [$BIG_SRC_RES]$(for m in $BIG_MODES $PGA_MODES; do printf ' %s [%s]' "$m" "${BIG_RES[$m]}"; done))"
    {
        echo
        echo "## One large transaction"
        echo
        echo "- one source transaction: $BIGTXN_ROWS rows inserted, $((BIGTXN_ROWS / 2)) of them updated (logical_decoding_work_mem at its default, so the source streams it while it runs)"
        echo "- each applier starts after the commit, from a slot made before the transaction, into an empty target table; time until the slot confirms the commit"
        [ -z "$BIG_NOTE" ] || echo "- $BIG_NOTE"
        echo
        echo "$BIG_TABLE"
        echo "$BIG_CORRECT"
    } >>"$RESULTS"
    echo
    echo "large transaction: $BIGTXN_ROWS rows inserted, $((BIGTXN_ROWS / 2)) updated, in one transaction"
    [ -z "$BIG_NOTE" ] || echo "$BIG_NOTE"
    echo
    echo "$BIG_TABLE"
    echo "$BIG_CORRECT"
    echo "$BIG_VERDICT"
fi

echo "results written to $RESULTS"
[ "$VERDICT" = MATCH ] || exit 1
[ "$COPY_VERDICT" != MISMATCH ] || exit 1
[ "$LAT_VERDICT" != MISMATCH ] || exit 1
[ "$LAG_VERDICT" != MISMATCH ] || exit 1
[ "$BIG_VERDICT" != MISMATCH ] || exit 1
