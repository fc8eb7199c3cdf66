"""Training text that needs no download: the docstrings of Python's standard library.

The source files are parsed (never imported, so no module runs) in sorted path order, and
their module, class and function docstrings are concatenated until a size budget is met,
so the same Python version always yields the same bytes.
"""
from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

import torch

# Directories of the standard library that hold tests or tools rather than library code.
_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


def _docstrings(source: str):
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def stdlib_docstrings(max_bytes: int = 1_000_000) -> bytes:
    """UTF-8 bytes of standard-library docstrings, separated by blank lines, in sorted file
    order, stopping after the file that brings the total to `max_bytes` (then cut there)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path for path in root.rglob("*.py")
        if not _SKIPPED_DIRS.intersection(path.relative_to(root).parts)
    )
    chunks: list[bytes] = []
    size = 0
    for path in files:
        try:
            docs = list(_docstrings(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file this interpreter cannot parse: not part of the corpus
        for doc in docs:
            chunk = doc.encode("utf-8") + b"\n\n"
            chunks.append(chunk)
            size += len(chunk)
        if size >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"found no docstrings under the standard library at {root}")
    return b"".join(chunks)[:max_bytes]


class ByteCorpus:
    """Bytes as token ids (vocabulary 256), split into a training part and a held-out tail,
    with seeded random batches of (input, next-token target) windows."""

    def __init__(self, data: bytes, val_fraction: float = 0.1):
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.num_bytes = len(data)

    def batch(self, split: str, batch_size: int, block_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both [batch_size, block_size] int64 on the CPU; y is x shifted by one."""
        tokens = self.train if split == "train" else self.val
        if len(tokens) <= block_size:
            raise ValueError(
                f"the {split} split has {len(tokens)} tokens, too few for block_size={block_size}"
            )
        starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)
        offsets = torch.arange(block_size + 1)
        windows = tokens[starts[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]
