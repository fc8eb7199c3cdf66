"""Build fusednorm._C: the CPU kernels always, the CUDA kernels when torch and nvcc allow;
and fusednorm._fast, the ops' direct Python entries.

Knobs (environment variables):
  FUSEDNORM_CPU_ONLY=1            skip the CUDA sources even when they could be built
  FUSEDNORM_CPU_CAPABILITY=...    'avx512', 'avx2' or 'default': the SIMD level of the CPU
                                  kernels; by default the best one the building CPU has
  TORCH_CUDA_ARCH_LIST="9.0"      CUDA archs; defaults to the visible GPUs, or without one to the
                                  archs torch was built for (+PTX for the newest)
  CUDA_HOME=/usr/local/cuda       toolkit root; found from nvcc when unset
  MAX_JOBS=N                      parallel compile jobs (ninja)
  FUSEDNORM_DEBUG=1               -O0 -g, for debuggers and sanitizers
  FUSEDNORM_SANITIZE=address,undefined
                                  the C++ host code built with GCC's sanitizers (-O1 -g; every
                                  report fatal); loads only with libasan preloaded
                                  (tests/cpu_sanitize.sh builds and runs it)
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_stamp():
    """fusednorm/_build_stamp.py, loaded by path: importing the package would load _C."""
    import importlib.util

    path = os.path.join(ROOT, "fusednorm", "_build_stamp.py")
    spec = importlib.util.spec_from_file_location("_fusednorm_build_stamp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Taken before the code below fills in CUDA_HOME / TORCH_CUDA_ARCH_LIST defaults.
_BUILD_STAMP = _load_build_stamp().stamp(Path(ROOT))


def _nvcc_toolkit_root():
    """Where the CUDA toolkit really lives: /usr/local/bin/nvcc may be a wrapper script, so
    torch's guess (dirname of dirname of `which nvcc`) can name /usr/local instead."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for root in candidates:
        if os.path.exists(os.path.join(root, "bin", "nvcc")) and os.path.exists(
            os.path.join(root, "include", "cuda_runtime.h")
        ):
            return root
    return None


# torch.utils.cpp_extension reads CUDA_HOME when it is imported: set it first.
_toolkit = _nvcc_toolkit_root()
if _toolkit and not os.environ.get("CUDA_HOME"):
    os.environ["CUDA_HOME"] = _toolkit

try:
    import torch  # noqa: E402
except ModuleNotFoundError as _error:
    if _error.name != "torch":
        raise
    # pip's build isolation (a fresh environment without torch), or no torch at all.
    raise SystemExit("fusednorm's build needs torch installed first; pip install torch, then "
                     "pip install --no-build-isolation .") from None
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)


def _want_cuda():
    if os.environ.get("FUSEDNORM_CPU_ONLY", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _cpu_capability():
    """SIMD level for at::vec: FUSEDNORM_CPU_CAPABILITY when set, else the level torch's own
    CPU kernels run at on the building machine (torch.backends.cpu.get_cpu_capability(),
    which ATEN_CPU_CAPABILITY lowers), so that fusednorm's kernels use the same instructions
    as the ones they replace. Built for the building machine (like -march=native); fusednorm
    refuses to load on a CPU that lacks it instead of crashing."""
    wanted = os.environ.get("FUSEDNORM_CPU_CAPABILITY")
    if wanted:
        return wanted.lower()
    have = torch.backends.cpu.get_cpu_capability().lower()
    # AVX-512 on the Zen 4 EPYC of benchmarks/results: bfloat16/float16 faster than the
    # AVX2 build of the previous results (docs/perf-notes.md, "SIMD level and bfloat16 rounding").
    if have.startswith("avx512"):
        return "avx512"
    if have == "avx2":
        return "avx2"
    return "default"


def _cpu_flags(capability):
    flags = {
        "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
        "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
        "avx512": [
            "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
            "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
            # GCC 12 flags its own _mm512_undefined_* idiom (`__m512i __Y = __Y;`) inlined
            # from ATen's AVX-512 conversions and lane reductions (vec_reduce_all): pages of
            # false warnings per file. The same sources built for AVX2 keep both warnings.
            "-Wno-maybe-uninitialized", "-Wno-uninitialized",
        ],
    }
    if capability not in flags:
        sys.exit(f"FUSEDNORM_CPU_CAPABILITY must be one of {sorted(flags)}, got {capability!r}")
    return flags[capability] + [f"-DFUSEDNORM_CPU_CAPABILITY_NAME={capability}"]


def _sanitize_flags():
    """FUSEDNORM_SANITIZE: GCC sanitizers for the C++ code (not nvcc's device code), every
    report fatal so that a test run cannot pass over one."""
    wanted = [name for name in os.environ.get("FUSEDNORM_SANITIZE", "").split(",") if name]
    if not wanted:
        return []
    unknown = sorted(set(wanted) - {"address", "undefined"})
    if unknown:
        sys.exit(f"FUSEDNORM_SANITIZE takes address and/or undefined, got {unknown}")
    return [f"-fsanitize={','.join(wanted)}", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-g"]


def _openmp_flags():
    """at::parallel_for runs its loop on the calling thread unless the extension itself is
    compiled with OpenMP (it is a header template keyed on _OPENMP). Use it when torch
    does, so the extension shares torch's thread pool and torch.set_num_threads()."""
    if "OpenMP" not in torch.__config__.parallel_info() or sys.platform == "darwin":
        return [], []
    return ["-fopenmp"], ["-fopenmp"]


def _nvidia_wheel_dirs(sub):
    """Header/library folders of the nvidia-* wheels (cuBLAS, cuSPARSE headers for ATen)."""
    found = []
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        found += glob.glob(os.path.join(site, "nvidia", "*", sub))
    return sorted(d for d in found if os.path.isdir(d))


def _cublaslt_link_args(lib_dirs):
    """Link cuBLASLt by its versioned name where the wheels ship no unversioned .so."""
    for d in lib_dirs + [os.path.join(CUDA_HOME or "", "lib64")]:
        for name in sorted(glob.glob(os.path.join(d, "libcublasLt.so*"))):
            return [f"-L{d}", f"-l:{os.path.basename(name)}", f"-Wl,-rpath,{d}"]
    return ["-lcublasLt"]


def _torch_build_archs():
    """The archs torch itself was compiled for, as TORCH_CUDA_ARCH_LIST entries ("sm_90a" ->
    "9.0a"), oldest first. Read from torch._C directly: some torch versions return [] from
    torch.cuda.get_arch_list() when no GPU is visible."""
    flags = getattr(torch._C, "_cuda_getArchFlags", lambda: None)()
    names = flags.split() if flags else torch.cuda.get_arch_list()
    archs = []
    for name in names:
        if not name.startswith("sm_"):
            continue  # compute_XY: PTX only; the newest gets PTX below anyway
        digits, suffix = name[3:].rstrip("af"), name[3:][len(name[3:].rstrip("af")):]
        if digits.isdigit() and len(digits) >= 2:
            archs.append((int(digits[:-1]), int(digits[-1]), suffix))
    return [f"{major}.{minor}{suffix}" for major, minor, suffix in sorted(set(archs))]


def _nvcc_archs():
    """The sm_XY numbers (as "X.Y") this nvcc can compile for, or None if it cannot say."""
    nvcc = os.path.join(CUDA_HOME or "", "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {f"{n[3:-1]}.{n[-1]}" for n in out.split() if n.startswith("sm_") and n[3:].isdigit()}


def _default_arch_list():
    """TORCH_CUDA_ARCH_LIST as given; else the visible GPUs' archs; else (no GPU, e.g. a
    build machine) the archs torch was built for, with PTX for the newest so that a newer GPU
    can still JIT it. CI sets TORCH_CUDA_ARCH_LIST=9.0 to compile one arch only."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        archs = sorted({
            "{}.{}".format(*torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())
        })
    else:
        archs = _torch_build_archs()
        supported = _nvcc_archs()
        if supported is not None:
            archs = [a for a in archs if a.rstrip("af") in supported]
        if not archs:
            archs = ["9.0"]
        archs[-1] += "+PTX"
    print(f"fusednorm: TORCH_CUDA_ARCH_LIST={' '.join(archs)!r} (set it to choose)", file=sys.stderr)
    os.environ["TORCH_CUDA_ARCH_LIST"] = " ".join(archs)


# The CUDA norm family's compiled units: one per kind, pass and input dtype, so that nvcc
# compiles them in parallel (and a change to one rebuilds only those). Each is a generated
# file in build/ that includes csrc/cuda/norm_instances.cuh; the input dtypes are the tags of
# FUSEDNORM_CUDA_NORM_DTYPES in csrc/cuda/norm_launch.h, the one list of dtype pairs.
NORM_KINDS = {"layer_norm": "true", "rms_norm": "false"}  # name: FUSEDNORM_NORM_CENTERED
# fwd_dropout: norm_fwd_dropout_cuda; bwd_input_grad: norm_bwd_input_grad_cuda
NORM_PASSES = ("fwd", "bwd", "fwd_dropout", "bwd_input_grad")
NORM_INSTANCES_DIR = os.path.join("build", "generated", "cuda")


def norm_input_tags():
    """The input tags of FUSEDNORM_CUDA_NORM_DTYPES, in list order."""
    import re

    with open(os.path.join(ROOT, "csrc", "cuda", "norm_launch.h")) as f:
        text = f.read()
    body = text.split("#define FUSEDNORM_CUDA_NORM_DTYPES(X)", 1)[1].split("\n\n", 1)[0]
    return list(dict.fromkeys(re.findall(r"\bX\((\w+),", body)))


def norm_instance_sources():
    """Writes the norm family's generated .cu files (only where their text changed, so that
    ninja's rebuilds stay incremental); returns their paths."""
    tags = norm_input_tags()
    os.makedirs(os.path.join(ROOT, NORM_INSTANCES_DIR), exist_ok=True)
    paths = []
    for kind, centered in NORM_KINDS.items():
        for pass_ in NORM_PASSES:
            for tag in tags:
                lines = [
                    f"// Generated by setup.py: {kind} {pass_} for {tag} inputs.",
                    f"#define FUSEDNORM_NORM_CENTERED {centered}",
                    f"#define FUSEDNORM_NORM_PASS {pass_}",
                ]
                lines += [f"#define FUSEDNORM_NORM_ONLY_{other}(...)"
                          + (" __VA_ARGS__" if other == tag else "") for other in tags]
                lines.append('#include "cuda/norm_instances.cuh"')
                text = "\n".join(lines) + "\n"
                path = os.path.join(NORM_INSTANCES_DIR, f"{kind}_{pass_}_{tag}.cu")
                full = os.path.join(ROOT, path)
                if not os.path.exists(full) or open(full).read() != text:
                    with open(full, "w") as f:
                        f.write(text)
                paths.append(path)
    return paths


def make_extension():
    debug = os.environ.get("FUSEDNORM_DEBUG", "0") == "1"
    sanitize = _sanitize_flags()
    # A sanitized build at -O1: the checks do not depend on the optimization, the build time does.
    opt = ["-O0", "-g"] if debug else ["-O1"] if sanitize else ["-O3"]
    capability = _cpu_capability()
    # No implicit FMA contraction: the kernels place their fused multiply-adds explicitly,
    # and contraction elsewhere breaks exact cancellations (dx of a one-element row is 0).
    omp_compile, omp_link = _openmp_flags()
    cxx = (
        # -g0 undoes the -g of Python's own CFLAGS: debug info made the CPU kernels' files
        # compile a third slower, the longest step of a GPU machine's build (perf-notes).
        opt + ([] if debug else ["-g0"])
        + ["-fvisibility=hidden", "-ffp-contract=off", "-Wno-unknown-pragmas"]
        + omp_compile + _cpu_flags(capability) + sanitize
    )
    link = omp_link + sanitize
    sources = (
        ["csrc/fusednorm.cpp"] + sorted(glob.glob("csrc/ops/*.cpp"))
        + sorted(glob.glob("csrc/cpu/*.cpp"))
    )
    include_dirs = [os.path.join(ROOT, "csrc")]
    macros = [("Py_LIMITED_API", "0x030A0000")]
    if not _want_cuda():
        return CppExtension(
            "fusednorm._C", sources, include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx}, extra_link_args=link,
            define_macros=macros, py_limited_api=True,
        )
    _default_arch_list()
    include_dirs += _nvidia_wheel_dirs("include")
    # Spaces cannot travel through ninja's command line: "9.0 10.0" becomes 9.0_10.0.
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ").split()
    with_cuda = ["-DFUSEDNORM_WITH_CUDA", f"-DFUSEDNORM_CUDA_ARCHS={'_'.join(archs)}"]
    nvcc = opt + ["--expt-relaxed-constexpr", "-lineinfo"]
    # csrc/cuda: kernels in .cu files (nvcc), their ATen-side host code in .cpp files (the
    # C++ compiler, much faster on ATen's headers than nvcc).
    return CUDAExtension(
        "fusednorm._C",
        sources + sorted(glob.glob("csrc/cuda/*.cu")) + norm_instance_sources()
        + sorted(glob.glob("csrc/cuda/*.cpp")),
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args={"cxx": cxx + with_cuda, "nvcc": nvcc + with_cuda},
        extra_link_args=link + _cublaslt_link_args(_nvidia_wheel_dirs("lib")),
        py_limited_api=True,
    )


def make_fast_calls_extension():
    """fusednorm._fast (csrc/python): direct Python entries into the public ops, built
    against the full Python API and libtorch_python, so not abi3 like _C; optional at import
    (without it, calls go through torch.ops)."""
    debug = os.environ.get("FUSEDNORM_DEBUG", "0") == "1"
    sanitize = _sanitize_flags()
    return CppExtension(
        "fusednorm._fast", ["csrc/python/fast_calls.cpp"],
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": (["-O0", "-g"] if debug else ["-O2"]) + ["-fvisibility=hidden"]
                            + sanitize},
        extra_link_args=sanitize,
    )


def write_build_config(extension):
    """fusednorm/_build_config.py: what was compiled, read before loading _C."""
    capability = _cpu_capability()
    with open(os.path.join(ROOT, "fusednorm", "_build_config.py"), "w") as f:
        f.write("# Written by setup.py at build time.\n")
        f.write(f"CPU_CAPABILITY = {capability!r}\n")
        # benchmarks.kernel_ab compiles its two sides with these, as the op was.
        f.write(f"CPU_SIMD_FLAGS = {_cpu_flags(capability)!r}\n")
        f.write(f"CUDA = {'nvcc' in extension.extra_compile_args!r}\n")
        f.write(f"TORCH_CUDA_ARCH_LIST = {os.environ.get('TORCH_CUDA_ARCH_LIST', '')!r}\n")
        f.write(f"BUILT_WITH_TORCH = {torch.__version__!r}\n")
    print(f"fusednorm: compiling {_what_is_compiled(extension)}", file=sys.stderr, flush=True)
    return extension


def _what_is_compiled(extension):
    if "nvcc" in extension.extra_compile_args:
        return f"the CPU and CUDA kernels (archs {os.environ['TORCH_CUDA_ARCH_LIST']}; " \
               "FUSEDNORM_CPU_ONLY=1 skips CUDA)"
    if os.environ.get("FUSEDNORM_CPU_ONLY", "0") == "1":
        why = "FUSEDNORM_CPU_ONLY=1"
    elif torch.version.cuda is None:
        why = "torch is a CPU build"
    else:
        why = "no CUDA toolkit found: set CUDA_HOME or put nvcc on PATH"
    return f"the CPU kernels only ({why})"


# scripts/install.sh compiles with `setup.py build_ext --inplace` (ninja's objects kept in
# build/, so a rebuild compiles only what changed), then registers the checkout with
# `pip install -e` under FUSEDNORM_SKIP_BUILD_EXT=1, which must not compile it again.
_SKIP_EXT = os.environ.get("FUSEDNORM_SKIP_BUILD_EXT", "0") == "1"


class _BuildExt(BuildExtension.with_options(use_ninja=True)):
    def run(self):
        super().run()
        # Only after a successful build: scripts/install.sh skips compiling when this stamp
        # matches the current sources, torch and knobs.
        if self.extensions:
            with open(os.path.join(ROOT, "fusednorm", "_build_config.py"), "a") as f:
                for key, value in _BUILD_STAMP.items():
                    f.write(f"{key} = {value!r}\n")


setup(
    ext_modules=[] if _SKIP_EXT else [
        write_build_config(make_extension()), make_fast_calls_extension()],
    # No abi3 wheel tag: fusednorm._fast is built for this Python (and _C for this torch).
    cmdclass={"build_ext": _BuildExt},
)
