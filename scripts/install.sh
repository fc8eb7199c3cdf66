#!/usr/bin/env bash
# Installs fusednorm from this checkout into the current Python environment, with the extras
# named in $1 (e.g. "test" or "bench"). torch must be present before the build (the
# extension compiles against it, --no-build-isolation), so it is installed first: any
# torch >= 2.11 already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${1:-}
"$PYTHON" -m pip install --quiet "torch>=2.11" ninja "setuptools>=64" wheel
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PYTHON" -m pip install --quiet --no-build-isolation \
  --editable ".${extras:+[$extras]}"
"$PYTHON" -c "import fusednorm, json; print(json.dumps(fusednorm.build_info()))"
