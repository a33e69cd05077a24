#!/usr/bin/env bash
# Validates docker-compose.yml without a container engine: loads it with PyYAML and
# checks the demo's shape. Usage: scripts/check-compose.sh [path/to/docker-compose.yml]
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
file="${1:-$root/docker-compose.yml}"

python=python3
if ! "$python" -c 'import yaml' 2>/dev/null; then
    venv=/tmp/pgapply-check-compose-venv
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import yaml' 2>/dev/null; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet pyyaml
    fi
    python="$venv/bin/python"
fi

"$python" - "$file" <<'PY'
import sys
import yaml

path = sys.argv[1]
with open(path) as f:
    doc = yaml.safe_load(f)

def fail(msg):
    sys.exit(f"{path}: {msg}")

if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
    fail("no services mapping")
services = doc["services"]

for name in ("source", "target", "workload", "pgapply"):
    if not isinstance(services.get(name), dict):
        fail(f"service {name!r} missing")

command = services["source"].get("command", "")
if isinstance(command, list):
    command = " ".join(map(str, command))
if "wal_level=logical" not in command:
    fail("source does not run with wal_level=logical")

build = services["pgapply"].get("build")
context = build.get("context") if isinstance(build, dict) else build
if context not in (".", "./"):
    fail(f"pgapply does not build from '.' (build: {build!r})")

for name, svc in services.items():
    for dep, cond in (svc.get("depends_on") or {}).items() if isinstance(svc.get("depends_on"), dict) else []:
        if dep not in services:
            fail(f"{name} depends on unknown service {dep!r}")
        if cond.get("condition") == "service_healthy" and "healthcheck" not in services[dep]:
            fail(f"{name} waits for {dep} to be healthy but {dep} has no healthcheck")

print("compose file OK")
PY
