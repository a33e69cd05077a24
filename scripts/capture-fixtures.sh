#!/usr/bin/env bash
# Capture real pgoutput message bytes from throwaway PostgreSQL clusters and
# write them as text fixtures into tests/fixtures/pgoutput/.
#
# Usage: scripts/capture-fixtures.sh [SCENARIO...]
#   scenarios: v1 v1-binary v2-streaming v3-two-phase v4-parallel (default: all)
#
# Environment:
#   PG15_BIN             PostgreSQL 15 bin dir (default /usr/lib/postgresql/15/bin)
#   PGAPPLY_PG_CACHE     where scripts/pg-versions.sh installs PostgreSQL 18
#   PGAPPLY_CAPTURE_VENV Python venv with psycopg2 (default /tmp/pgapply-capture-venv;
#                        created and filled from PyPI when missing)
#   PGAPPLY_FIXTURE_DIR  output directory (default tests/fixtures/pgoutput)
#
# Each cluster: initdb --locale=C -A trust -U postgres in a temp dir under /tmp,
# random free port on 127.0.0.1, unix socket in the data dir, wal_level=logical,
# max_prepared_transactions=10, logical_decoding_work_mem=64kB. When run as
# root, the server programs run as the `postgres` OS user.
#
# Messages are read either through the SQL interface
# (pg_logical_slot_get_binary_changes) or, where that cannot show what a
# subscriber sees, live over the walsender protocol; see
# scripts/pgoutput-capture.py and tests/fixtures/pgoutput/README.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${PGAPPLY_FIXTURE_DIR:-$ROOT/tests/fixtures/pgoutput}"
PG15_BIN="${PG15_BIN:-/usr/lib/postgresql/15/bin}"
PSQL="${PSQL:-$PG15_BIN/psql}"
VENV="${PGAPPLY_CAPTURE_VENV:-/tmp/pgapply-capture-venv}"
CAPTURE_PY="$ROOT/scripts/pgoutput-capture.py"
SLOT=fixture_slot
HOW_SQL="SQL interface: pg_logical_slot_get_binary_changes() after each step"
HOW_WALSENDER="walsender: START_REPLICATION SLOT ... LOGICAL, decoded live while the workload runs (psycopg2)"

ALL_SCENARIOS=(v1 v1-binary v2-streaming v3-two-phase v4-parallel)
if [ "$#" -gt 0 ]; then
    SCENARIOS=("$@")
else
    SCENARIOS=("${ALL_SCENARIOS[@]}")
fi
for s in "${SCENARIOS[@]}"; do
    case " ${ALL_SCENARIOS[*]} " in
        *" $s "*) ;;
        *) echo "capture-fixtures: unknown scenario $s (known: ${ALL_SCENARIOS[*]})" >&2; exit 2 ;;
    esac
done

log() { echo "capture-fixtures: $*" >&2; }
die() { log "$*"; exit 1; }

IS_ROOT=0
if [ "$(id -u)" = 0 ]; then IS_ROOT=1; fi

# Run a server program (initdb, pg_ctl) as a non-root user.
as_pg() {
    if [ "$IS_ROOT" = 1 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

# The postgres user must be able to read the current directory.
cd /tmp

[ -x "$PSQL" ] || die "psql not found at $PSQL"
[ -x "$PG15_BIN/postgres" ] || die "PostgreSQL 15 not found in $PG15_BIN"
if [ "$IS_ROOT" = 1 ]; then
    id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' OS user"
fi

WORK="$(mktemp -d /tmp/pgapply-capture.XXXXXX)"
if [ "$IS_ROOT" = 1 ]; then chown postgres: "$WORK"; fi
chmod 755 "$WORK"

RUNNING=()   # "bindir|datadir" of clusters to stop on exit
cleanup() {
    local entry
    for entry in "${RUNNING[@]+"${RUNNING[@]}"}"; do
        as_pg "${entry%%|*}/pg_ctl" -D "${entry#*|}" -m immediate -w stop >/dev/null 2>&1 || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------
# tools

ensure_venv() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import psycopg2' 2>/dev/null; then
        return
    fi
    log "creating Python venv with psycopg2-binary in $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check psycopg2-binary
}

PG18_BIN=""
ensure_pg18() {
    [ -n "$PG18_BIN" ] && return
    local bin
    bin="$("$ROOT/scripts/pg-versions.sh" 18 | awk '$1 == "18" { print $2 }' | tail -n 1)"
    [ -x "$bin/postgres" ] || die "scripts/pg-versions.sh did not install PostgreSQL 18"
    if [ "$IS_ROOT" = 1 ] && ! runuser -u postgres -- test -x "$bin/postgres"; then
        # e.g. the cache lives under /root, which the postgres user cannot enter
        log "copying PostgreSQL 18 to $WORK/pg18 (not reachable by the postgres user)"
        cp -a "$(dirname "$bin")" "$WORK/pg18"
        chmod -R a+rX "$WORK/pg18"
        bin="$WORK/pg18/bin"
    fi
    PG18_BIN="$bin"
}

free_port() {
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
        return
    fi
    local p
    while :; do
        p=$(( 20000 + RANDOM % 40000 ))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            echo "$p"
            return
        fi
    done
}

# ---------------------------------------------------------------------------
# clusters

PORT=""
DATADIR=""
BINDIR=""
start_cluster() {  # name bindir
    local name="$1" bin="$2"
    local dir="$WORK/$name"
    mkdir -p "$dir"
    if [ "$IS_ROOT" = 1 ]; then chown postgres: "$dir"; fi
    as_pg "$bin/initdb" -D "$dir/data" --locale=C -E UTF8 -A trust -U postgres >"$dir/initdb.log" 2>&1 ||
        { cat "$dir/initdb.log" >&2; die "initdb failed for $name"; }
    PORT="$(free_port)"
    cat >>"$dir/data/postgresql.conf" <<EOF

# added by scripts/capture-fixtures.sh
port = $PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir/data'
wal_level = logical
max_prepared_transactions = 10
logical_decoding_work_mem = 64kB
max_replication_slots = 10
max_wal_senders = 10
wal_writer_delay = 20ms
fsync = off
EOF
    RUNNING+=("$bin|$dir/data")
    as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null ||
        { cat "$dir/server.log" >&2 || true; die "server start failed for $name"; }
    DATADIR="$dir/data"
    BINDIR="$bin"
}

stop_cluster() {
    as_pg "$BINDIR/pg_ctl" -D "$DATADIR" -m fast -w stop >/dev/null
    local keep=() entry
    for entry in "${RUNNING[@]}"; do
        [ "$entry" = "$BINDIR|$DATADIR" ] || keep+=("$entry")
    done
    RUNNING=("${keep[@]+"${keep[@]}"}")
}

psql_run() {  # SQL on stdin, one statement at a time (autocommit)
    "$PSQL" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -f - >/dev/null
}

psql_value() {  # single value of a query
    "$PSQL" -X -q -At -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c "$1"
}

# ---------------------------------------------------------------------------
# fixture files

FIXTURE_TMP=""
FIXTURE_OPTS=()
begin_fixture() {  # name how-captured pgoutput-option...
    local name="$1" how="$2" version joined
    shift 2
    FIXTURE_OPTS=("$@")
    version="$(psql_value 'SHOW server_version')"
    joined="$(printf '%s, ' "$@")"
    FIXTURE_TMP="$WORK/$name.txt"
    {
        echo "# pgoutput fixture: $name"
        echo "# server: PostgreSQL $version; options: ${joined%, }"
        echo "# made by scripts/capture-fixtures.sh on $(date -u +%Y-%m-%d)"
        echo "# capture: $how"
    } >"$FIXTURE_TMP"
}

capture() {  # sql|walsender ; workload on stdin; options from begin_fixture
    local mode="$1" args=() o
    for o in "${FIXTURE_OPTS[@]}"; do args+=(--option "$o"); done
    "$VENV/bin/python" "$CAPTURE_PY" --dsn "host=127.0.0.1 port=$PORT user=postgres dbname=postgres" \
        --slot "$SLOT" --mode "$mode" --out "$FIXTURE_TMP" "${args[@]}"
}

tag_counts() {  # file -> "B=3 C=3 ..."
    grep -v '^#' "$1" | sed '/^[[:space:]]*$/d' | cut -c1-2 | LC_ALL=C sort | uniq -c |
        while read -r n hx; do printf '%b=%s ' "\\x$hx" "$n"; done | sed 's/ $//'
}

finish_fixture() {  # name required-tags required-features
    local name="$1" tags="$2" features="$3" counts c i missing=""
    counts="$(tag_counts "$FIXTURE_TMP")"
    for ((i = 0; i < ${#tags}; i++)); do
        c="${tags:i:1}"
        case " $counts" in
            *" $c="*) ;;
            *) missing+="$c" ;;
        esac
    done
    [ -z "$missing" ] || die "$name: missing message tags '$missing' (have: $counts)"
    "$VENV/bin/python" "$CAPTURE_PY" check "$FIXTURE_TMP" --require "$features" >&2 ||
        die "$name: fixture check failed"
    echo "# counts: $counts" >>"$FIXTURE_TMP"
    mkdir -p "$OUT_DIR"
    mv "$FIXTURE_TMP" "$OUT_DIR/$name.txt"
    log "wrote $OUT_DIR/$name.txt ($(wc -c <"$OUT_DIR/$name.txt") bytes): $counts"
}

# ---------------------------------------------------------------------------
# scenarios

scenario_v1() {
    start_cluster v1 "$PG15_BIN"
    psql_run <<'SQL'
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TYPE point3 AS (x int, y int, z int);
-- primary key (REPLICA IDENTITY DEFAULT), user-defined enum and composite columns
CREATE TABLE items (id int PRIMARY KEY, name text, qty int, note text, feeling mood, pos point3);
-- REPLICA IDENTITY FULL, no primary key
CREATE TABLE audit_full (a int, b text, c timestamptz);
ALTER TABLE audit_full REPLICA IDENTITY FULL;
-- REPLICA IDENTITY USING INDEX
CREATE TABLE by_index (code text NOT NULL, k int, val text);
CREATE UNIQUE INDEX by_index_code ON by_index (code);
ALTER TABLE by_index REPLICA IDENTITY USING INDEX by_index_code;
-- a toastable column stored out of line without compression
CREATE TABLE docs (id int PRIMARY KEY, title text, body text);
ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
-- for TRUNCATE ... CASCADE and TRUNCATE ... RESTART IDENTITY
CREATE TABLE parent (id int PRIMARY KEY);
CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent (id));
CREATE TABLE counters (id serial PRIMARY KEY, n int);
CREATE PUBLICATION pub FOR ALL TABLES;
SELECT pg_replication_origin_create('fixture_origin');
SELECT pg_create_logical_replication_slot('fixture_slot', 'pgoutput');
SQL
    begin_fixture v1 "$HOW_SQL" proto_version=1 publication_names=pub messages=true
    capture sql <<'SQL'
\step INSERT two rows into items (pk table with enum + composite columns -> Type messages), one with NULLs
INSERT INTO items VALUES (1, 'apple', 5, 'fresh', 'happy', ROW(1, 2, 3));
INSERT INTO items VALUES (2, 'pear', NULL, NULL, NULL, NULL);
\drain
\step one transaction inserting into audit_full (REPLICA IDENTITY FULL), by_index (USING INDEX) and parent/child/counters
BEGIN;
INSERT INTO audit_full VALUES (1, 'one', '2024-01-02 03:04:05+00'), (2, 'two', NULL);
INSERT INTO by_index VALUES ('alpha', 1, 'a'), ('beta', 2, 'b');
INSERT INTO parent VALUES (1), (2);
INSERT INTO child VALUES (10, 1), (20, 2);
INSERT INTO counters (n) VALUES (100), (200);
COMMIT;
\drain
\step UPDATE items without touching the key (new tuple only)
UPDATE items SET qty = 6, feeling = 'ok' WHERE id = 1;
\drain
\step UPDATE items changing the primary key (old key 'K')
UPDATE items SET id = 20 WHERE id = 2;
\drain
\step UPDATE audit_full (REPLICA IDENTITY FULL: old tuple 'O')
UPDATE audit_full SET b = 'uno' WHERE a = 1;
\drain
\step UPDATE by_index changing the replica identity index column (old key 'K')
UPDATE by_index SET code = 'gamma' WHERE code = 'beta';
\drain
\step INSERT into docs with a ~100 kB out-of-line body
INSERT INTO docs SELECT 1, 'first', string_agg(md5(g::text), '') FROM generate_series(1, 3200) g;
\drain
\step UPDATE docs.title only: the unchanged toasted body is sent as 'u'
UPDATE docs SET title = 'renamed' WHERE id = 1;
\drain
\step DELETE from items by key ('K') and from audit_full (old tuple 'O')
DELETE FROM items WHERE id = 20;
DELETE FROM audit_full WHERE a = 2;
\drain
\step TRUNCATE two tables in one statement
TRUNCATE items, audit_full;
\drain
\step TRUNCATE parent CASCADE (option bit 1; child is truncated too)
TRUNCATE parent CASCADE;
\drain
\step TRUNCATE counters RESTART IDENTITY (option bit 2)
TRUNCATE counters RESTART IDENTITY;
\drain
\step transactional logical decoding message
SELECT pg_logical_emit_message(true, 'pgapply-test', 'hello');
\drain
\step non-transactional logical decoding message
SELECT pg_logical_emit_message(false, 'pgapply-test', 'hello');
\drain
\step transaction replayed from replication origin fixture_origin (Origin message)
SELECT pg_replication_origin_session_setup('fixture_origin');
BEGIN;
SELECT pg_replication_origin_xact_setup('0/ABCDEF0', '2024-01-02 03:04:05+00');
INSERT INTO items VALUES (3, 'from origin', 1, NULL, 'sad', ROW(0, 0, 0));
COMMIT;
SELECT pg_replication_origin_session_reset();
\drain
SQL
    finish_fixture v1 BCRYIUDTMO \
        relation-ident-d,relation-ident-f,relation-ident-i,update-new-only,update-key,update-old,delete-key,delete-old,tuple-null,tuple-unchanged-toast,tuple-text,truncate-multi,truncate-cascade,truncate-restart-identity,message-transactional,message-nontransactional,origin,type
    stop_cluster
}

scenario_v1_binary() {
    start_cluster v1-binary "$PG15_BIN"
    psql_run <<'SQL'
CREATE TABLE bin_types (id int PRIMARY KEY, t text, b bytea, n numeric, ts timestamptz, missing text);
CREATE PUBLICATION pub FOR ALL TABLES;
SELECT pg_create_logical_replication_slot('fixture_slot', 'pgoutput');
SQL
    local proto=1
    if ! psql_value "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('$SLOT', NULL, NULL, 'proto_version', '1', 'publication_names', 'pub', 'binary', 'true')" >/dev/null 2>&1; then
        log "v1-binary: proto_version=1 refuses binary=true, using proto_version=2"
        proto=2
    fi
    begin_fixture v1-binary "$HOW_SQL" "proto_version=$proto" publication_names=pub binary=true
    capture sql <<'SQL'
\step INSERT rows with int, text, bytea, numeric, timestamptz and a NULL (binary tuple values 'b')
INSERT INTO bin_types VALUES (1, 'hello', '\x00010203feff', 12345.678, '2024-01-02 03:04:05.123456+00', NULL);
INSERT INTO bin_types VALUES (2, '', '\x', -0.5, '1999-12-31 23:59:59+00', NULL);
INSERT INTO bin_types VALUES (3, 'grüße', NULL, 'NaN', 'infinity', NULL);
\drain
\step UPDATE one row (binary new tuple)
UPDATE bin_types SET n = n * 2, t = 'changed' WHERE id = 1;
\drain
SQL
    finish_fixture v1-binary BCRIU relation-ident-d,tuple-binary,tuple-null,update-new-only
    stop_cluster
}

# Workload shared by the two streaming scenarios (read live over the walsender).
streaming_workload() {
    cat <<'SQL'
\step small ordinary transaction
INSERT INTO small VALUES (1, 'before');
\drain expect=C
\step large transaction T1 starts: TRUNCATE, transactional message, 1500 rows -> streamed blocks (Stream Start/Stop)
BEGIN;
TRUNCATE trunc_me;
SELECT pg_logical_emit_message(true, 'pgapply-test', 'inside a streamed transaction');
INSERT INTO big SELECT g, 'row-' || g, g * 10 FROM generate_series(1, 1500) g;
\drain expect=E
\step small transaction on a second connection, committed while T1 is still open
\conn other
INSERT INTO small VALUES (2, 'interleaved');
\drain expect=C
\step T1: savepoint with 1500 rows rolled back (Stream Abort of the subtransaction), 300 more rows, COMMIT (Stream Commit)
\conn main
SAVEPOINT sp1;
INSERT INTO big SELECT g, 'sub-' || g, g FROM generate_series(100001, 101500) g;
ROLLBACK TO SAVEPOINT sp1;
INSERT INTO big SELECT g, 'row-' || g, g * 10 FROM generate_series(1501, 1800) g;
COMMIT;
\drain expect=Ac
\step small ordinary transaction between the two large ones
INSERT INTO small VALUES (3, 'between');
\drain expect=C
\step large transaction T2: 1500 rows; a committed small transaction on the second connection flushes WAL so T2 gets streamed
BEGIN;
INSERT INTO big SELECT g, 'row-' || g, g * 10 FROM generate_series(2001, 3500) g;
\conn other
INSERT INTO small VALUES (4, 'during T2');
\drain expect=EC
\step T2 is rolled back entirely (Stream Abort of the top-level transaction)
\conn main
ROLLBACK;
\drain expect=A
SQL
}

streaming_schema() {
    psql_run <<'SQL'
CREATE TABLE small (id int PRIMARY KEY, note text);
CREATE TABLE big (id int PRIMARY KEY, label text, amount bigint);
CREATE TABLE trunc_me (id int PRIMARY KEY);
INSERT INTO trunc_me VALUES (1), (2);
CREATE PUBLICATION pub FOR ALL TABLES;
SELECT pg_create_logical_replication_slot('fixture_slot', 'pgoutput');
SQL
}

scenario_v2_streaming() {
    start_cluster v2-streaming "$PG15_BIN"
    streaming_schema
    begin_fixture v2-streaming "$HOW_WALSENDER" proto_version=2 publication_names=pub streaming=on messages=true
    streaming_workload | capture walsender
    finish_fixture v2-streaming BCRISEcATM \
        stream-first-segment,streamed-R,streamed-I,streamed-T,streamed-M,stream-abort-subxact,stream-abort-top,tuple-text
    stop_cluster
}

scenario_v3_two_phase() {
    start_cluster v3-two-phase "$PG15_BIN"
    psql_run <<'SQL'
CREATE TABLE orders (id int PRIMARY KEY, item text, qty int);
CREATE PUBLICATION pub FOR ALL TABLES;
SELECT pg_create_logical_replication_slot('fixture_slot', 'pgoutput', false, true);
SQL
    begin_fixture v3-two-phase "$HOW_SQL; slot created with two_phase=true" \
        proto_version=3 publication_names=pub two_phase=on streaming=on
    capture sql <<'SQL'
\step small ordinary transaction
INSERT INTO orders VALUES (1, 'plain', 1);
\drain
\step PREPARE TRANSACTION 'fx_commit' (Begin Prepare, Prepare)
BEGIN;
INSERT INTO orders VALUES (2, 'prepared then committed', 2);
UPDATE orders SET qty = 10 WHERE id = 1;
PREPARE TRANSACTION 'fx_commit';
\drain
\step COMMIT PREPARED 'fx_commit' (Commit Prepared)
COMMIT PREPARED 'fx_commit';
\drain
\step PREPARE TRANSACTION 'fx_rollback'
BEGIN;
INSERT INTO orders VALUES (3, 'prepared then rolled back', 3);
DELETE FROM orders WHERE id = 2;
PREPARE TRANSACTION 'fx_rollback';
\drain
\step ROLLBACK PREPARED 'fx_rollback' (Rollback Prepared)
ROLLBACK PREPARED 'fx_rollback';
\drain
\step large transaction (1500 rows) prepared as 'fx_stream': streamed, then Stream Prepare
BEGIN;
INSERT INTO orders SELECT g, 'bulk-' || g, g FROM generate_series(1000, 2499) g;
PREPARE TRANSACTION 'fx_stream';
\drain
\step COMMIT PREPARED 'fx_stream'
COMMIT PREPARED 'fx_stream';
\drain
SQL
    finish_fixture v3-two-phase BCRIUDbPKrSEp \
        stream-first-segment,streamed-R,streamed-I,tuple-text
    stop_cluster
}

scenario_v4_parallel() {
    ensure_pg18
    start_cluster v4-parallel "$PG18_BIN"
    streaming_schema
    begin_fixture v4-parallel "$HOW_WALSENDER" proto_version=4 publication_names=pub streaming=parallel binary=true messages=true
    streaming_workload | capture walsender
    finish_fixture v4-parallel BCRISEcATM \
        stream-first-segment,streamed-R,streamed-I,streamed-T,streamed-M,stream-abort-subxact,stream-abort-top,stream-abort-with-lsn,tuple-binary
    stop_cluster
}

# ---------------------------------------------------------------------------

ensure_venv
for s in "${SCENARIOS[@]}"; do
    log "scenario $s"
    "scenario_${s//-/_}"
done
log "done"
