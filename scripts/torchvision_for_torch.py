"""The pip arguments that install the torchvision built for the installed torch, one a line
on stdout (scripts/install.sh, step 4); where none can be installed, the reason on stdout
and exit status 1.

torchvision 0.N pairs with torch 2.(N-15). A torch with a local variant (2.13.0+cpu,
2.9.1+cu126) comes from download.pytorch.org/whl/<variant>, and only that index has a
torchvision of the same variant: PyPI's is built for PyPI's torch and does not import beside
another build ("operator torchvision::nms does not exist"). $FUSEDNORM_TORCH_INDEX replaces
https://download.pytorch.org/whl (a mirror).
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
import urllib.error
import urllib.request

INDEX = os.environ.get("FUSEDNORM_TORCH_INDEX", "https://download.pytorch.org/whl").rstrip("/")
PROBE_TIMEOUT_S = 10


def torchvision_requirement(torch_version: str) -> str:
    """The torchvision release series built for `torch_version` ("2.13.0+cpu" -> "0.28.*")."""
    major, minor = (int(p) for p in torch_version.split("+")[0].split(".")[:2])
    if major != 2:
        raise ValueError(f"no known torchvision series for torch {torch_version}")
    return f"torchvision==0.{minor + 15}.*"


def reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when `url` answers within `timeout`, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except (urllib.error.URLError, OSError) as error:
        return str(getattr(error, "reason", error))


def pip_arguments(torch_version: str, probe=reachable) -> tuple[list[str], str | None]:
    """(arguments, None), or ([], the reason none can be installed)."""
    requirement = torchvision_requirement(torch_version)
    variant = torch_version.partition("+")[2]
    if not variant:  # PyPI's torch: PyPI's torchvision matches it
        return [requirement], None
    index = f"{INDEX}/{variant}"
    why = probe(f"{index}/torchvision/")
    if why is not None:
        return [], (
            f"torch {torch_version} is the '{variant}' build; the torchvision built for it "
            f"({requirement}) comes only from {index}, which could not be reached ({why}); "
            "PyPI's torchvision is built for PyPI's torch and does not import beside it. "
            f"Where that index is reachable: pip install '{requirement}' --extra-index-url {index}"
        )
    # The local version (0.28.0+cpu) sorts above PyPI's 0.28.0, so pip takes the variant's.
    return [requirement, "--extra-index-url", index], None


def main() -> int:
    version = importlib.metadata.version("torch")
    arguments, why = pip_arguments(version)
    print(why if why else "\n".join(arguments))
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
