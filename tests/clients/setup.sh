#!/usr/bin/env bash
# The generators, pinned, each in a place of its own (what docs/clients.md tells a user to
# install): openapi-python-client in .venv-clients, openapi-typescript + openapi-fetch +
# TypeScript from tests/clients/ts/ (and ts/generator/) package-lock.json files. Idempotent:
# a second run finds them installed and does nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
VENV=.venv-clients
# openapi-python-client, and what the client it generates imports (httpx, attrs, dateutil).
PACKAGES=(openapi-python-client==0.29.1 httpx==0.28.1 attrs==26.1.0 python-dateutil==2.9.0.post0)
STAMP="$VENV/.installed-$(echo "${PACKAGES[*]}" | cksum | cut -d' ' -f1)"
if [ ! -e "$STAMP" ]; then
    test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PACKAGES[@]}"
    rm -f "$VENV"/.installed-* && touch "$STAMP"
fi
for dir in tests/clients/ts tests/clients/ts/generator; do
    if [ ! -e "$dir/node_modules/.package-lock.json" ] || [ "$dir/package-lock.json" -nt "$dir/node_modules/.package-lock.json" ]; then
        (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
    fi
done
