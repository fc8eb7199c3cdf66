"""setup.py's FUSEDNORM_SANITIZE knob, without building: its function is taken from the file
(setup.py runs setup() when imported). tests/cpu_sanitize.sh builds and runs with it."""
from __future__ import annotations

import ast
import os
import sys

import pytest

SETUP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")


def sanitize_flags():
    tree = ast.parse(open(SETUP).read())
    defs = [node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name == "_sanitize_flags"]
    assert defs, "setup.py's _sanitize_flags was renamed"
    namespace = {"os": os, "sys": sys}
    exec(compile(ast.Module(body=defs, type_ignores=[]), SETUP, "exec"), namespace)
    return namespace["_sanitize_flags"]


def test_unset_adds_nothing(monkeypatch):
    monkeypatch.delenv("FUSEDNORM_SANITIZE", raising=False)
    assert sanitize_flags()() == []
    monkeypatch.setenv("FUSEDNORM_SANITIZE", "")
    assert sanitize_flags()() == []


@pytest.mark.parametrize("names", ["address", "undefined", "address,undefined"])
def test_named_sanitizers_with_every_report_fatal(monkeypatch, names):
    monkeypatch.setenv("FUSEDNORM_SANITIZE", names)
    flags = sanitize_flags()()
    assert f"-fsanitize={names}" in flags
    # A report that did not stop the run could pass a test run over it.
    assert "-fno-sanitize-recover=all" in flags
    assert "-g" in flags and "-fno-omit-frame-pointer" in flags


def test_an_unknown_sanitizer_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("FUSEDNORM_SANITIZE", "address,thread")
    with pytest.raises(SystemExit, match="FUSEDNORM_SANITIZE.*'thread'"):
        sanitize_flags()()
