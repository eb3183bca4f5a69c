#!/bin/bash
# import-linter reads a package from its files; the editable install maps vlm_kv.gates etc. to
# top-level folders it cannot see, so lint a wheel-layout copy of the tree.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
pip install -q --no-deps --no-build-isolation --no-compile --target "$TMP/site" "$ROOT" >/dev/null 2>&1
rm -rf "$ROOT/build"
cd "$TMP" && PYTHONPATH="$TMP/site" lint-imports "$ROOT/.importlinter" "$@"
