"""Registers fusednorm.distributed's DTensor rules as soon as DTensor is imported, so that
fusednorm's modules and ops work under tensor parallelism as torch's own norms do, while
`import fusednorm` does not pay for importing torch.distributed.tensor (about 1 s)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

_DTENSOR = "torch.distributed.tensor"


class _AfterDTensorImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: DTensor's module as usual, then fusednorm.distributed."""

    def find_spec(self, name, path, target=None):
        if name != _DTENSOR:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                register()
            except Exception as error:  # never break the user's import of DTensor
                warnings.warn(f"fusednorm's DTensor sharding rules were not registered: "
                              f"{error!r}; import fusednorm.distributed to see why",
                              RuntimeWarning, stacklevel=2)

        spec.loader.exec_module = exec_then_register
        return spec


def register() -> None:
    import torch.distributed as dist

    if dist.is_available():
        from . import distributed  # noqa: F401  (registers on import)


def register_when_dtensor_loads() -> None:
    if _DTENSOR in sys.modules:
        register()
    elif not any(isinstance(f, _AfterDTensorImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDTensorImport())
