"""scripts/install.sh's up-to-date check (fusednorm/_build_stamp.py): a second install of an
unchanged checkout must not compile again, and any change that alters the library must.
And the packaging: a wheel or an sdist must carry everything that `pip install` of it needs."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest

from fusednorm import _build_stamp

REPO = Path(__file__).resolve().parent.parent


def _write_build(root: Path, environ: dict, torch_version: str | None = None) -> None:
    """What setup.py leaves behind: the library and _build_config.py with its stamp."""
    (root / "fusednorm" / "_C.abi3.so").write_bytes(b"\x7fELF")
    values = _build_stamp.stamp(root, environ)
    if torch_version is not None:
        values["TORCH_DIST_VERSION"] = torch_version
    (root / "fusednorm" / "_build_config.py").write_text(
        "".join(f"{k} = {v!r}\n" for k, v in values.items()))


@pytest.fixture
def checkout(tmp_path):
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    (tmp_path / "fusednorm").mkdir()
    (tmp_path / "csrc" / "fusednorm.cpp").write_text("int f() { return 1; }\n")
    (tmp_path / "csrc" / "cuda" / "k.cuh").write_text("// header\n")
    (tmp_path / "setup.py").write_text("setup()\n")
    return tmp_path


def test_fresh_build_is_up_to_date(checkout):
    assert _build_stamp.stale_reason(checkout, {}) == "not compiled yet"
    _write_build(checkout, {})
    assert _build_stamp.stale_reason(checkout, {}) is None


@pytest.mark.parametrize("change", ["cpp", "header", "setup.py", "new file", "rename"])
def test_source_changes_make_it_stale(checkout, change):
    _write_build(checkout, {})
    csrc = checkout / "csrc"
    if change == "cpp":
        (csrc / "fusednorm.cpp").write_text("int f() { return 2; }\n")
    elif change == "header":
        (csrc / "cuda" / "k.cuh").write_text("// header, changed\n")
    elif change == "setup.py":
        (checkout / "setup.py").write_text("setup(name='x')\n")
    elif change == "new file":
        (csrc / "cpu.cpp").write_text("\n")
    else:
        (csrc / "cuda" / "k.cuh").rename(csrc / "cuda" / "k2.cuh")
    assert _build_stamp.stale_reason(checkout, {}) == "sources changed since the last build"


def test_touching_a_file_is_not_a_change(checkout):
    """Only contents count: a checkout or `touch` that leaves them alone does not rebuild."""
    _write_build(checkout, {})
    os.utime(checkout / "csrc" / "fusednorm.cpp", (1e9, 1e9))
    assert _build_stamp.stale_reason(checkout, {}) is None


def test_knobs_and_torch_make_it_stale(checkout):
    _write_build(checkout, {"FUSEDNORM_CPU_ONLY": "1"})
    assert _build_stamp.stale_reason(checkout, {"FUSEDNORM_CPU_ONLY": "1", "MAX_JOBS": "3"}) is None
    reason = _build_stamp.stale_reason(checkout, {})
    assert reason.startswith("build settings changed: FUSEDNORM_CPU_ONLY=''")
    _write_build(checkout, {}, torch_version="2.0.0")
    assert "built with torch 2.0.0" in _build_stamp.stale_reason(checkout, {})


def test_missing_library_or_record(checkout):
    _write_build(checkout, {})
    (checkout / "fusednorm" / "_C.abi3.so").unlink()
    assert _build_stamp.stale_reason(checkout, {}) == "not compiled yet"
    _write_build(checkout, {})
    (checkout / "fusednorm" / "_build_config.py").write_text("CUDA = False\n")
    assert _build_stamp.stale_reason(checkout, {}).startswith("no successful build recorded")


def test_this_checkout_is_up_to_date_after_its_build():
    """The tests run on a library built from these sources against this torch (by
    install.sh or by hand), so a second install.sh must find nothing to compile. Checked as
    install.sh runs it, with the build knobs the library was built with."""
    config = REPO / "fusednorm" / "_build_config.py"
    if not config.exists():
        pytest.skip("fusednorm was not built in this checkout")
    knobs = runpy.run_path(str(config)).get("BUILD_KNOBS", {})
    env = {**{k: v for k, v in os.environ.items() if k not in _build_stamp.KNOBS},
           **{k: v for k, v in knobs.items() if v}}
    done = subprocess.run([sys.executable, str(REPO / "fusednorm" / "_build_stamp.py"), "build"],
                          capture_output=True, text=True, env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "up to date"), done.stdout + done.stderr


# ---- what a wheel and an sdist carry ------------------------------------------------------

def _tracked_files() -> list[str]:
    if not (REPO / ".git").exists():
        pytest.skip("needs a git checkout: the files git tracks are what must be packaged")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                         capture_output=True).stdout.decode()
    return [name for name in out.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture
def clean_copy(tmp_path):
    """The tracked files in a fresh folder: a checkout's leftover *.egg-info (the file list of
    an earlier build) or build outputs must not stand in for what the configuration says."""
    root = tmp_path / "src"
    for name in _tracked_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes((REPO / name).read_bytes())
    return root


def _package(kind: str, source: Path, into: Path) -> Path:
    """A wheel or an sdist of source, without compiling (FUSEDNORM_SKIP_BUILD_EXT=1): what
    these tests check is which files go in."""
    env = {**os.environ, "FUSEDNORM_SKIP_BUILD_EXT": "1"}
    command = ([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                "-w", str(into), str(source)] if kind == "wheel" else
               [sys.executable, "setup.py", "-q", "sdist", "-d", str(into)])
    subprocess.run(command, cwd=source, env=env, check=True, capture_output=True)
    [built] = into.glob("fusednorm-*.whl" if kind == "wheel" else "fusednorm-*.tar.gz")
    return built


def test_a_wheel_carries_every_module(clean_copy, tmp_path):
    """A wheel (`pip install .`, not the scripts' editable install) must hold every module of
    fusednorm/, subpackages included (a package list of "fusednorm" alone left out
    fusednorm.ops, and the installed library failed at import)."""
    with zipfile.ZipFile(_package("wheel", clean_copy, tmp_path / "dist")) as archive:
        in_wheel = set(archive.namelist())
    modules = {n for n in _tracked_files() if n.startswith("fusednorm/") and n.endswith(".py")}
    assert "fusednorm/ops/__init__.py" in modules
    assert sorted(modules - in_wheel) == []


def test_an_sdist_carries_every_source_file(clean_copy, tmp_path):
    """A source distribution must hold what compiling it needs: every file under csrc/ (the
    headers too, which setuptools does not add by itself: MANIFEST.in), the modules, setup.py,
    pyproject.toml and the license."""
    with tarfile.open(_package("sdist", clean_copy, tmp_path / "dist")) as archive:
        in_sdist = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    needed = {n for n in _tracked_files() if n.startswith(("csrc/", "fusednorm/"))}
    needed |= {"setup.py", "pyproject.toml", "LICENSE", "README.md"}
    assert "csrc/cpu/norm_kernels.h" in needed
    assert sorted(needed - in_sdist) == []


def test_pyproject_reads_without_deprecation_warnings(monkeypatch):
    """setuptools reads pyproject.toml without a deprecation warning (it printed one for a
    license table: "your builds will no longer be supported"), and the build requires a
    setuptools that reads the SPDX license string."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(REPO)  # license-files and readme are relative to the project
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metadata = apply_configuration(Distribution(), "pyproject.toml").metadata
    assert metadata.license_expression == "BSD-3-Clause"
    assert '"setuptools>=77"' in (REPO / "pyproject.toml").read_text()


# ---- the model libraries' torchvision (scripts/torchvision_for_torch.py) --------------------

def _torchvision_for_torch():
    return runpy.run_path(str(REPO / "scripts" / "torchvision_for_torch.py"))


@pytest.mark.parametrize("torch_version, expected", [
    ("2.14.1", ["torchvision==0.29.*"]),  # PyPI's torch: PyPI's torchvision
    ("2.13.0+cpu", ["torchvision==0.28.*", "--extra-index-url", "https://download.pytorch.org/whl/cpu"]),
    ("2.9.1+cu126", ["torchvision==0.24.*", "--extra-index-url", "https://download.pytorch.org/whl/cu126"]),
])
def test_torchvision_built_for_the_installed_torch(torch_version, expected, monkeypatch):
    monkeypatch.delenv("FUSEDNORM_TORCH_INDEX", raising=False)
    probed = []
    arguments, why = _torchvision_for_torch()["pip_arguments"](
        torch_version, probe=lambda url: probed.append(url))
    assert (arguments, why) == (expected, None)
    assert probed == ([f"{expected[-1]}/torchvision/"] if "+" in torch_version else [])


def test_torchvision_unreachable_index_says_why():
    """The reason names the build, the index and the failure: install.sh prints it."""
    arguments, why = _torchvision_for_torch()["pip_arguments"](
        "2.13.0+cpu", probe=lambda url: "Name or service not known")
    assert arguments == []
    assert "'cpu' build" in why and "https://download.pytorch.org/whl/cpu" in why
    assert "Name or service not known" in why and "PyPI's torchvision" in why


@pytest.fixture
def loader(monkeypatch):
    """fusednorm._loader, whose _load() the test calls again; LOAD_ERROR restored after."""
    from fusednorm import _loader

    monkeypatch.setattr(_loader, "LOAD_ERROR", _loader.LOAD_ERROR)
    return _loader


def _ends_with_rebuild(message: str) -> bool:
    return message.endswith("`pip install --no-build-isolation .` (docs/install.md)") and \
        "bash scripts/install.sh" in message


def test_loader_refuses_a_library_built_against_another_torch(loader, monkeypatch):
    """A library built against another torch is not imported (an undefined symbol at best);
    the message names both versions and how to rebuild."""
    import torch

    from fusednorm import _build_config

    monkeypatch.setattr(_build_config, "BUILT_WITH_TORCH", str(torch.__version__), raising=False)
    assert loader._load() is loader.AVAILABLE  # the same torch: as at the import
    monkeypatch.setattr(_build_config, "BUILT_WITH_TORCH", "2.11.0+cu130")
    monkeypatch.setattr(torch, "__version__", "2.14.1+cpu")
    assert loader._load() is False
    assert "built against torch 2.11.0+cu130, but torch 2.14.1+cpu is installed" in loader.LOAD_ERROR
    assert _ends_with_rebuild(loader.LOAD_ERROR)


def test_loader_says_how_to_build_when_the_library_is_missing(loader, monkeypatch):
    import fusednorm

    monkeypatch.setattr(loader, "_library_present", lambda: False)
    assert loader._load() is False
    assert "fusednorm/_C.* is missing" in loader.LOAD_ERROR and _ends_with_rebuild(loader.LOAD_ERROR)
    # Never built: no build record at all.
    monkeypatch.delattr(fusednorm, "_build_config", raising=False)
    monkeypatch.setitem(sys.modules, "fusednorm._build_config", None)
    assert loader._load() is False
    assert loader.LOAD_ERROR.startswith("fusednorm was not compiled")
    assert _ends_with_rebuild(loader.LOAD_ERROR)


def test_setup_without_torch_says_to_install_it_first():
    """pip's build isolation (or no torch at all): a clear message, not a traceback."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
            "runpy.run_path('setup.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == ("fusednorm's build needs torch installed first; pip install "
                                   "torch, then pip install --no-build-isolation .")


def test_an_sdist_leaves_out_the_packagers_build_record(clean_copy, tmp_path):
    """fusednorm/_build_config.py (gitignored) describes the build of whoever packs the sdist:
    it must not ship in it (a wheel, built where the library is, carries it)."""
    (clean_copy / "fusednorm" / "_build_config.py").write_text("SOURCE_HASH = 'packager'\n")
    with tarfile.open(_package("sdist", clean_copy, tmp_path / "dist")) as archive:
        in_sdist = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert "fusednorm/__init__.py" in in_sdist
    assert "fusednorm/_build_config.py" not in in_sdist
    with zipfile.ZipFile(_package("wheel", clean_copy, tmp_path / "wheel")) as archive:
        assert "fusednorm/_build_config.py" in archive.namelist()


def test_availability_hint_builds_without_build_isolation(monkeypatch):
    """The benchmarks' hint for a source tree without its library names a command that
    works: pip install needs --no-build-isolation (the build compiles against the installed
    torch), as README's scripts/install.sh does."""
    import fusednorm
    import torch

    from benchmarks import availability

    monkeypatch.setattr(availability, "_registered_ops", lambda device: [])
    monkeypatch.setattr(fusednorm, "build_info",
                        lambda: {"load_error": "fusednorm was not compiled (no build record)"})
    reason = availability.fusednorm_skip_reason(torch.device("cpu"), "norm_fwd", "layer_norm")
    assert "bash scripts/install.sh" in reason
    assert all("--no-build-isolation" in part for part in reason.split("pip install")[1:])


def test_install_script_finds_ninja_of_an_unactivated_environment(tmp_path):
    """PYTHON=/venv/bin/python without activating the venv: torch's build looks for the
    `ninja` program on PATH, which then lacks the venv's bin folder. install.sh puts it
    (and the ninja package's) first. A stand-in python records what setup.py would see."""
    import shutil

    tools = tmp_path / "tools"  # PATH without any ninja: the few programs install.sh runs
    tools.mkdir()
    for name in ("bash", "env", "dirname", "uname", "date", "nproc", "tr", "sed", "cat", "grep"):
        found = shutil.which(name)
        if found is None:
            pytest.skip(f"needs {name}")
        (tools / name).symlink_to(found)
    seen = tmp_path / "ninja_seen"
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"""#!{shutil.which('bash')}
case "$1" in
  fusednorm/_build_stamp.py) [[ $2 == build ]] && {{ echo "stale (test)"; exit 1; }}; exit 0;;
  setup.py) command -v ninja > {seen} || echo none > {seen}; exit 0;;
  scripts/check_error_path.py) exit 0;;
esac
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    done = subprocess.run([str(tools / "bash"), str(REPO / "scripts" / "install.sh")],
                          env={"PATH": str(tools), "PYTHON": str(python), "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = Path(seen.read_text().strip())
    assert found.name == "ninja" and found.is_file(), (found, done.stderr)
