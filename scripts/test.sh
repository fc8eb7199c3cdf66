#!/usr/bin/env bash
# The README's test command: install fusednorm with its test extras, the model libraries
# of the drop-in tests (transformers, timm) and the ONNX exporter and runtime of the export
# test (compiling only what changed since the last run), then run the whole suite (CUDA
# cases skip without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,models,onnx
# pytest exits non-zero when a test fails and (code 5) when no test ran.
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider tests "$@"
