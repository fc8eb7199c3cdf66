"""What a results file is stamped with: the device, the versions, the commit and the date."""
from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# Published results, committed; written only with --save.
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# Where a run writes by default: untracked (.gitignore), so that trying the benchmarks never
# dirties the checkout or overwrites the published files.
LOCAL_DIR = REPO_ROOT / "bench-out"


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device) -> str:
    """Human name of the device the suite runs on: the GPU's name or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model_name()


def slug(name: str) -> str:
    """File-system friendly form of a device name: 'NVIDIA H100 80GB HBM3' ->
    'nvidia-h100-80gb-hbm3', 'Intel(R) Xeon(R) Processor' -> 'intel-xeon-processor' (the
    trademark marks of CPU model names dropped)."""
    name = re.sub(r"\((r|tm|c)\)", " ", name.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def git_commit() -> str:
    """HEAD's sha, with '-dirty' when tracked or untracked sources differ from it (results
    files, which the benchmarks themselves rewrite, do not count); 'unknown' outside git.
    FUSEDNORM_COMMIT overrides it, for a copy of the sources whose .git is not theirs (a
    tree sent to a GPU machine): whoever sets it vouches that the files are that commit's."""
    if os.environ.get("FUSEDNORM_COMMIT"):
        return os.environ["FUSEDNORM_COMMIT"]
    try:
        sha = _git("rev-parse", "HEAD")
        changes = _git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if changes else "")


def iso_now() -> str:
    """The current time, ISO 8601 in UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def fusednorm_build() -> str:
    """Which of fusednorm's kernels ran: 'cpu avx512', 'cuda sm_90', ... (the CPU kernels'
    SIMD level changes their speed as much as a code change)."""
    import fusednorm

    info = fusednorm.build_info()
    parts = [f"cpu {info['cpu_capability']}" if info["cpu_kernels"] else "cpu: reference"]
    if info["cuda_kernels"]:
        parts.append("cuda " + " ".join(info["cuda_archs"]))
    return ", ".join(parts)


def build_matches_sources() -> bool | None:
    """Whether the loaded fusednorm library was compiled from this checkout's current C++/CUDA
    sources and setup.py: its build record's SOURCE_HASH (fusednorm/_build_config.py, which
    setup.py writes) against fusednorm/_build_stamp.py's hash of REPO_ROOT now. False: a
    stale build, whose timings are not those of the commit the file is stamped with; None:
    no build record (never built, a failed build, an older setup.py)."""
    import importlib

    from fusednorm import _build_stamp

    try:
        config = importlib.import_module("fusednorm._build_config")
    except ImportError:
        return None
    built = getattr(config, "SOURCE_HASH", None)
    if not built:
        return None
    return built == _build_stamp.source_hash(REPO_ROOT)


def header(suite: str, device: torch.device) -> dict:
    """The fields that open a results file, in docs/DESIGN.md's order (copy_gbps and rows follow)."""
    return {
        "suite": suite,
        "device": device_name(device),
        "device_kind": device.type,
        "torch": torch.__version__,
        "fusednorm_build": fusednorm_build(),
        "build_matches_sources": build_matches_sources(),
        "commit": git_commit(),
        "date": iso_now(),
    }
