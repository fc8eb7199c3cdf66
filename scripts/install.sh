#!/usr/bin/env bash
# Installs fusednorm from this checkout into the current Python environment ($PYTHON,
# default python3) with the extras named in $1 (e.g. "test" or "bench"), compiling only
# what changed since the last run:
#   1. torch: any torch >= 2.11 already installed is kept. Otherwise torch is installed,
#      the CPU-only wheel when this Linux machine has no NVIDIA driver or
#      FUSEDNORM_CPU_ONLY=1 (the CUDA wheels weigh gigabytes).
#   2. compile: the build tools and numpy first (torch warns "Failed to initialize NumPy"
#      at import without it; their folder, and $PYTHON's, put first on PATH, where torch
#      looks for the ninja program), then `setup.py build_ext --inplace` when fusednorm/_build_stamp.py finds the
#      library missing or stale (sources, torch or build knobs changed), with the compiler's
#      progress shown; ninja keeps its objects in build/, so a rebuild compiles only the
#      files that changed. The CUDA kernels are built when torch is a CUDA build and nvcc
#      is found (FUSEDNORM_CPU_ONLY=1: never).
#   3. register: `pip install -e ".[extras]"` without compiling again, when this checkout
#      is not yet what `import fusednorm` finds or an extra's requirement is missing.
#   4. with "models" among the extras: transformers and timm, with the torchvision built for
#      the installed torch (scripts/torchvision_for_torch.py), torch pinned; where that
#      cannot be done the model tests skip, with a warning here that says why. With "onnx":
#      onnxscript and onnxruntime for the ONNX export test, the same way (on their own, so
#      that a Python without their wheels leaves the model libraries be).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${1:-}
say() { echo "fusednorm install: $*" >&2; }
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check "$@"; }

# 1. torch
have_torch() {  # says which torch is here; fails without torch >= 2.11
  "$PYTHON" -c 'import sys, torch
v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"fusednorm install: torch {torch.__version__}, {build}")
sys.exit(v < (2, 11))' 1>&2 2>/dev/null
}
if ! have_torch; then
  if [[ $(uname -s) == Linux ]] && { [[ ${FUSEDNORM_CPU_ONLY:-0} == 1 ]] ||
      ! { command -v nvidia-smi >/dev/null || [[ -e /proc/driver/nvidia/version ]]; }; }; then
    say "installing the CPU-only torch (no NVIDIA driver here, or FUSEDNORM_CPU_ONLY=1)"
    pip_install "torch>=2.11" --index-url https://download.pytorch.org/whl/cpu
  else
    say "installing torch"
    pip_install "torch>=2.11"
  fi
  have_torch || { say "torch >= 2.11 does not import after its installation"; exit 1; }
fi
torch_version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("torch"))')

# 2. compile
# setuptools >= 77 reads pyproject's SPDX license string (its [build-system] requirement).
if ! "$PYTHON" -c 'import ninja, numpy, setuptools, wheel, sys
sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
  pip_install ninja numpy "setuptools>=77" wheel
fi
# torch's build runs the `ninja` program found on PATH: with PYTHON=/some/venv/bin/python and
# that environment not activated, its bin folder (where pip put ninja) is not on PATH. Put
# the ninja package's program folder and $PYTHON's own folder first.
python_bin=$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))')
ninja_bin=$("$PYTHON" -c 'import ninja; print(getattr(ninja, "BIN_DIR", ""))' 2>/dev/null || true)
export PATH="${ninja_bin:+$ninja_bin:}$python_bin:$PATH"
if stale=$("$PYTHON" fusednorm/_build_stamp.py build); then
  say "compiled library up to date (sources, torch and build knobs unchanged): not rebuilding"
else
  jobs=${MAX_JOBS:-$(nproc)}
  say "compiling ($stale) with MAX_JOBS=$jobs; a full CUDA build takes minutes"
  start=$(date +%s)
  MAX_JOBS=$jobs "$PYTHON" setup.py build_ext --inplace
  say "compiled in $(( $(date +%s) - start )) s"
fi
# A library whose C++ error path crashes fails here, not in the first program that passes
# a bad argument (seen with a compiler that linked its own libstdc++ into it).
if ! "$PYTHON" scripts/check_error_path.py >&2; then
  say "the compiled library crashed or misbehaved when an op rejected an argument (see above);"
  say "rebuild with the compilers torch's C++ runtime comes from, e.g. CC=/usr/bin/gcc CXX=/usr/bin/g++"
  exit 1
fi

# 3. register (and the extras' requirements)
base_extras=${extras//models/}
base_extras=${base_extras//onnx/}
base_extras=$(echo "$base_extras" | tr -s ',' | sed 's/^,//; s/,$//')
if why=$("$PYTHON" fusednorm/_build_stamp.py install "$base_extras"); then
  say "fusednorm${base_extras:+[$base_extras]} already installed from this checkout"
else
  say "pip install -e .${base_extras:+[$base_extras]} ($why)"
  FUSEDNORM_SKIP_BUILD_EXT=1 pip_install --no-build-isolation --editable ".${base_extras:+[$base_extras]}"
fi

# 4. model libraries, without letting them replace torch
importable() { "$PYTHON" -c "import $1" 2>/dev/null; }
installed() { "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)' "$1"; }
if [[ ,$extras, == *,models,* ]]; then
  # A torchvision built for another torch build fails at import ("operator torchvision::nms
  # does not exist") and takes transformers' model classes down with it.
  if installed torchvision && ! importable torchvision; then
    say "torchvision does not import beside torch $torch_version (built for another torch): uninstalling it"
    "$PYTHON" -m pip uninstall --yes --disable-pip-version-check torchvision
  fi
  read -r -a missing <<< "$("$PYTHON" fusednorm/_build_stamp.py missing models | tr '\n' ' ')"
  vision=()
  if ! installed torchvision && { [[ " ${missing[*]} " == *" timm"* ]] || installed timm; }; then
    # timm imports torchvision: install the one built for this torch, or leave timm out.
    if spec=$("$PYTHON" scripts/torchvision_for_torch.py); then
      mapfile -t vision <<< "$spec"
    else
      say "WARNING: not installing timm (it imports torchvision), so the timm tests will skip: $spec"
      read -r -a missing <<< "$(printf '%s\n' "${missing[@]}" | grep -v '^timm' | tr '\n' ' ')"
    fi
  fi
  if [[ ${#missing[@]} -gt 0 || ${#vision[@]} -gt 0 ]]; then
    say "installing ${vision[0]:+${vision[0]} }${missing[*]} for the model-library tests (torch pinned to $torch_version)"
    if ! pip_install "torch==$torch_version" "${vision[@]}" "${missing[@]}"; then
      say "WARNING: could not install ${missing[*]} (see above): the transformers/timm tests will skip." \
          "Install them by hand with: $PYTHON -m pip install torch==$torch_version ${vision[*]} ${missing[*]}"
    fi
  fi
  if installed torchvision && ! importable torchvision; then
    say "WARNING: the torchvision installed does not import beside torch $torch_version; uninstalling it" \
        "(transformers works without it; the timm tests will skip)"
    "$PYTHON" -m pip uninstall --yes --disable-pip-version-check torchvision
  fi
fi
if [[ ,$extras, == *,onnx,* ]]; then
  read -r -a missing <<< "$("$PYTHON" fusednorm/_build_stamp.py missing onnx | tr '\n' ' ')"
  if [[ ${#missing[@]} -gt 0 ]]; then
    say "installing ${missing[*]} for the ONNX export test (torch pinned to $torch_version)"
    if ! pip_install "torch==$torch_version" "${missing[@]}"; then
      say "WARNING: could not install ${missing[*]} (see above): the ONNX export test will skip." \
          "Install them by hand with: $PYTHON -m pip install torch==$torch_version ${missing[*]}"
    fi
  fi
fi
"$PYTHON" -c "import fusednorm, json; print(json.dumps(fusednorm.build_info()))"
