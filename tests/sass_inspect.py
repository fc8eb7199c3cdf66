"""Reads the machine code (SASS) and resource usage of fusednorm's compiled CUDA kernels
with cuobjdump, without a GPU: the helpers of tests/test_sass.py.

cuobjdump comes from the CUDA toolkit (CUDA_HOME/bin) or, when the toolkit ships without it,
from the triton wheel that CUDA builds of torch install (triton/backends/nvidia/bin).
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import subprocess
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_tool(name: str) -> str | None:
    """Path of a CUDA binary tool (cuobjdump, nvdisasm), or None."""
    candidates = []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", name))
    found = shutil.which(name)
    if found:
        candidates.append(found)
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        candidates.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", name))
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def extension_path() -> str | None:
    """The compiled fusednorm._C library (the one `import fusednorm` loads), or None."""
    import fusednorm

    module = getattr(fusednorm, "_C", None)
    if module is not None and getattr(module, "__file__", None):
        return module.__file__
    found = sorted(glob.glob(os.path.join(os.path.dirname(fusednorm.__file__), "_C*.so")))
    return found[0] if found else None


@dataclasses.dataclass
class Kernel:
    arch: str  # "sm_90"
    name: str  # mangled
    regs: int = 0
    stack: int = 0
    local: int = 0
    shared: int = 0
    ops: Counter = dataclasses.field(default_factory=Counter)  # SASS opcodes with modifiers


_ARCH = re.compile(r"arch = (sm_\d+[af]?)")
_FUNCTION_SASS = re.compile(r"^\s*Function : (\S+)")
_FUNCTION_RES = re.compile(r"^\s*Function (\S+):\s*$")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# "/*0090*/   @!P0 STG.E.128 desc[UR4][R2.64], R4 ;" -> "STG.E.128"
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def read_kernels(library: str, cuobjdump: str) -> dict[tuple[str, str], Kernel]:
    """(arch, mangled name) -> Kernel, for every kernel in the library's cubins."""
    kernels: dict[tuple[str, str], Kernel] = {}

    def get(arch, name):
        return kernels.setdefault((arch, name), Kernel(arch, name))

    res = subprocess.run([cuobjdump, "-res-usage", library], capture_output=True, text=True, check=True).stdout
    arch, current = None, None
    for line in res.splitlines():
        if m := _ARCH.search(line):
            arch = m.group(1)
        elif m := _FUNCTION_RES.match(line):
            current = get(arch, m.group(1))
        elif (m := _RESOURCES.search(line)) and current is not None:
            current.regs, current.stack, current.shared, current.local = map(int, m.groups())
            current = None

    sass = subprocess.run([cuobjdump, "-sass", library], capture_output=True, text=True, check=True).stdout
    arch, current = None, None
    for line in sass.splitlines():
        if m := _ARCH.search(line):
            arch = m.group(1)
        elif m := _FUNCTION_SASS.match(line):
            current = get(arch, m.group(1))
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.ops[m.group(1)] += 1
    return kernels


# Template arguments of the norm-family row kernels in their mangled names:
# norm_{fwd,bwd}_kernel<T, P, VEC, TPR, ITEMS, CLUSTER, CENTERED, IO> (CENTERED: LayerNorm;
# not: RMSNorm; IO: the type of x, y and dy, T's or 16-bit beside a float T), and the forward
# with dropout / rowscale, norm_fwd_dropout_kernel, with the same arguments. The backward's
# last argument is a pack: empty (J E), or InputGradParams for the kernels that also write the
# add ops' input gradient.
_ELEMENT = {"N3c104HalfE": "float16", "N3c108BFloat16E": "bfloat16", "f": "float32", "d": "float64"}
# The parameter type P follows T: "f" (float beside a 16-bit T), or T again (a "d", an "f", or
# a substitution "S<n>_" of T's name).
_ROW_KERNEL = re.compile(
    r"\dnorm_(fwd|bwd)(_dropout)?_kernelI(N3c104HalfE|N3c108BFloat16E|f|d)(S[0-9A-Z]*_|f|d)?.*?"
    r"Li(\d+)ELi(\d+)ELi(\d+)E(?:Lb([01])E)?(?:Lb([01])E)?(N3c104HalfE|N3c108BFloat16E|S[0-9A-Z]*_|f|d)?"
    r"(JE|J\w*?InputGradParams)?[EI]"
)


@dataclasses.dataclass(frozen=True)
class RowKernel:
    direction: str  # "fwd" or "bwd"
    dtype: str  # of x
    vec: int
    tpr: int
    items: int
    cluster: bool = False  # the thread-block-cluster instantiation (long rows, sm_90+)
    centered: bool = True  # LayerNorm; False: RMSNorm
    param: str = ""  # dtype of weight/bias: x's, or "float32" beside a 16-bit x
    io: str = ""  # dtype of x, y and dy: dtype's, or 16-bit beside a float32 sum
    dropout: bool = False  # norm_fwd_dropout_kernel (s = x * m + residual)
    input_grad: bool = False  # norm_bwd_kernel<..., InputGradParams> (the add ops' input gradient)

    @property
    def block(self) -> int:
        """Threads per block it is launched with (RowLayout<TPR>::kBlock)."""
        return max(self.tpr, 128)

    @property
    def vectorized(self) -> bool:
        return self.vec > 1


def row_kernel(name: str, dropout: bool = False) -> RowKernel | None:
    """The row kernel's template arguments; the dropout forwards and the input-gradient
    backwards only when `dropout` (the variants with the add ops' multipliers)."""
    m = _ROW_KERNEL.search(name)
    if m is None:
        return None
    direction, drop, element, param, vec, tpr, items, cluster, centered, io, pack = m.groups()
    input_grad = pack is not None and pack != "JE"
    if (drop is not None or input_grad) and not dropout:
        return None
    dtype = _ELEMENT[element]
    return RowKernel(direction, dtype, int(vec), int(tpr), int(items), cluster == "1",
                     centered != "0", _ELEMENT.get(param, dtype), _ELEMENT.get(io, dtype),
                     drop is not None, input_grad)


# Launch block sizes of the other kernels (csrc/cuda/norm_config.cuh, and the constants next to
# the other launches in csrc/cuda).
OTHER_BLOCKS = {
    "norm_merge_stats_kernel": 128,  # kMergeThreads (norm_config.cuh)
    "norm_merge_stats_dropout_kernel": 128,  # kMergeThreads
    "norm_merge_sums_kernel": 128,  # kMergeThreads
    "sum_partial_rows_kernel": 256,  # kSumThreads
    "layer_norm_apply_kernel": 256,  # kThreads
    "layer_norm_mean_rest_kernel": 256,  # kThreads (layer_norm_apply.cu)
    "dropout_scale_kernel": 256,  # kDropoutScaleThreads (dropout_scale.cuh)
    "gelu_kernel": 256,  # kElementwiseThreads
    "column_slab_kernel": 256,  # kSlabColThreads * kSlabRowThreads
    "sum_slabs_kernel": 256,  # kElementwiseThreads
}


def launch_block(name: str) -> int | None:
    rk = row_kernel(name, dropout=True)
    if rk is not None:
        return rk.block
    for family, block in OTHER_BLOCKS.items():
        if re.search(rf"\d{family}I", name) or re.search(rf"\d{family}E", name):
            return block
    return None


def registers_fit(regs: int, block: int) -> bool:
    """Whether a block of `block` threads using `regs` registers each can be resident on one
    multiprocessor (65536 registers, allocated per warp in units of 256; at most 255 per
    thread) -- true for every arch from sm_70 to sm_120."""
    if regs > 255:
        return False
    per_warp = -(-regs * 32 // 256) * 256
    warps = -(-block // 32)
    return warps * per_warp <= 65536
