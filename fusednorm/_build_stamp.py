"""Whether the compiled library in this checkout is up to date, so that scripts/install.sh
compiles only when something changed.

setup.py records after each successful build, in fusednorm/_build_config.py: a hash of
the C++/CUDA sources and setup.py, the installed torch's version, and the build knobs as
they were requested. The library is up to date when all three still match and _C is there
(a failed build leaves no record, so the next run compiles again).

Standard library only, and runnable as a script without importing fusednorm (which would
load the very library in question):

    python fusednorm/_build_stamp.py build          # 'up to date' (exit 0) or why not (1)
    python fusednorm/_build_stamp.py install test   # is this checkout pip-installed, with
                                                    # the test extra's requirements?
    python fusednorm/_build_stamp.py missing models # requirements of [models] not installed
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import runpy
import sys
from pathlib import Path
from typing import Mapping, Optional

ROOT = Path(__file__).resolve().parent.parent

# Environment variables that change what setup.py compiles. Recorded as given (unset: ""),
# before setup.py fills in defaults. MAX_JOBS and CUDA_HOME change how, not what;
# ATEN_CPU_CAPABILITY lowers torch's CPU level, which is fusednorm's default one; CC and CXX
# pick the compilers (and with them the C++ runtime the library links).
KNOBS = ("FUSEDNORM_CPU_ONLY", "FUSEDNORM_CPU_CAPABILITY", "FUSEDNORM_DEBUG",
         "FUSEDNORM_SANITIZE", "TORCH_CUDA_ARCH_LIST", "ATEN_CPU_CAPABILITY", "CC", "CXX")


def source_files(root: Path) -> list[Path]:
    """What the compiled library is made of: everything under csrc/, and setup.py."""
    files = [p for p in (root / "csrc").rglob("*") if p.is_file()]
    return sorted(files) + [root / "setup.py"]


def source_hash(root: Path) -> str:
    """sha256 over the sources' relative paths and contents (mtimes change on checkout)."""
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def requested_knobs(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    return {name: environ.get(name, "") for name in KNOBS}


def torch_version() -> Optional[str]:
    """The installed torch distribution's version (e.g. 2.14.1+cu130), without importing it."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def stamp(root: Path, environ: Mapping[str, str] = os.environ) -> dict:
    """The values setup.py writes into _build_config.py."""
    return {"SOURCE_HASH": source_hash(root), "TORCH_DIST_VERSION": torch_version(),
            "BUILD_KNOBS": requested_knobs(environ)}


def stale_reason(root: Path, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """None when root's compiled library was built from its current sources, against the
    installed torch, with the knobs now requested; else what differs."""
    package = root / "fusednorm"
    if not any(package.glob("_C.*")):
        return "not compiled yet"
    config_file = package / "_build_config.py"
    if not config_file.exists():
        return "no build record (fusednorm/_build_config.py)"
    built = runpy.run_path(str(config_file))
    if "SOURCE_HASH" not in built:
        return "no successful build recorded (the last one failed, or an older setup.py)"
    if built["SOURCE_HASH"] != source_hash(root):
        return "sources changed since the last build"
    if built["TORCH_DIST_VERSION"] != torch_version():
        return f"built with torch {built['TORCH_DIST_VERSION']}, torch {torch_version()} is installed"
    knobs = requested_knobs(environ)
    changed = [f"{k}={knobs[k]!r} (built with {built['BUILD_KNOBS'].get(k, '')!r})"
               for k in KNOBS if built["BUILD_KNOBS"].get(k, "") != knobs[k]]
    if changed:
        return "build settings changed: " + ", ".join(changed)
    return None


def installed_from(root: Path) -> Optional[str]:
    """None when `import fusednorm` in this Python finds root's package (an editable
    install of this checkout); else what it finds instead."""
    spec = importlib.util.find_spec("fusednorm")
    if spec is None or spec.origin is None:
        return "fusednorm is not installed"
    where = Path(spec.origin).resolve().parent
    if where != (root / "fusednorm").resolve():
        return f"fusednorm is installed from {where}"
    return None


def _extra_requirements(extras: set[str]) -> list[str]:
    """The requirements of fusednorm's `extras`, from the installed metadata."""
    try:
        declared = importlib.metadata.requires("fusednorm") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    wanted = []
    for line in declared:
        spec, _, marker = line.partition(";")
        extra = re.search(r"extra\s*==\s*[\"']([^\"']+)", marker)
        if extra and extra.group(1) in extras:
            wanted.append(spec.strip())
    return wanted


def missing_requirements(extras: set[str]) -> list[str]:
    """Requirements of `extras` whose distribution is not installed (versions unchecked)."""
    missing = []
    for spec in _extra_requirements(extras):
        name = re.match(r"[A-Za-z0-9_.\-]+", spec).group(0)
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(spec)
    return missing


def register_reason(root: Path, extras: set[str]) -> Optional[str]:
    """None when this Python imports root's fusednorm, installed from the current
    pyproject.toml, with the requirements of `extras`; else why `pip install -e` is due."""
    reason = installed_from(root)
    if reason:
        return reason
    dist = importlib.metadata.distribution("fusednorm")
    metadata = Path(getattr(dist, "_path", "")) / "METADATA"
    if metadata.exists() and (root / "pyproject.toml").stat().st_mtime > metadata.stat().st_mtime:
        return "pyproject.toml changed since fusednorm was installed"
    missing = missing_requirements(extras)
    if missing:
        return "missing " + ", ".join(missing)
    return None


def main() -> int:
    # Run as a file, sys.path[0] is this folder: drop it so that find_spec sees what
    # `import fusednorm` sees elsewhere.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    what = sys.argv[1] if len(sys.argv) > 1 else "build"
    extras = set(filter(None, (sys.argv[2] if len(sys.argv) > 2 else "").split(",")))
    if what == "missing":  # the specs, one a line, for pip install
        print("\n".join(missing_requirements(extras)))
        return 0
    reason = register_reason(ROOT, extras) if what == "install" else stale_reason(ROOT)
    print(reason or "up to date")
    return 1 if reason else 0


if __name__ == "__main__":
    sys.exit(main())
