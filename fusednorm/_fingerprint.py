"""The fingerprint of a norm class's computation: a SHA-1 of the normalized source of its
base classes and computing methods. scripts/norm_survey.py judges classes by it and records
it for each class fusednorm swaps; fusednorm.patch compares the live class's with it before
swapping, so that another library version's class of the same name is not swapped blind."""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap
from typing import Optional

# Methods that do not compute the output.
SKIPPED_METHODS = {"__init__", "extra_repr", "_load_from_state_dict"}


class _Strip(ast.NodeTransformer):
    """Removes what does not compute: annotations and docstrings."""

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = None
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        self.generic_visit(node)
        return node


def computation_text(node: ast.ClassDef) -> str:
    """Base classes and the computing methods of a class, as normalized source."""
    methods = [_Strip().visit(m) for m in node.body
               if isinstance(m, ast.FunctionDef) and m.name not in SKIPPED_METHODS]
    source = ast.unparse(ast.Module(body=methods, type_ignores=[]))
    bases = ", ".join(ast.unparse(b) for b in node.bases)
    return f"({bases})\n" + source.replace(node.name, "CLS")


def digest(text: str) -> str:
    """The fingerprint of a computation_text: 12 hex digits of its SHA-1."""
    return hashlib.sha1(text.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def fingerprint(cls: type) -> Optional[str]:
    """The fingerprint of a live class's source (inspect.getsource, which reads its file),
    or None where that is unavailable. Cached per class: computed at replace time only."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return digest(computation_text(node)) if isinstance(node, ast.ClassDef) else None


def methods_from_source(cls: type) -> bool:
    """Whether every function in the class's namespace was defined in its class body: the
    source misses a method assigned to the class afterwards (not cached, so that it sees one)."""
    prefix = cls.__qualname__ + "."
    for value in vars(cls).values():
        func = getattr(value, "__func__", value)  # staticmethod, classmethod
        if inspect.isfunction(func) and (func.__module__ != cls.__module__
                                         or not func.__qualname__.startswith(prefix)):
            return False
    return True
