"""tests/mutants.toml stays applicable: every mutant's old text occurs exactly once in its
file, so that a change to the code that moves a mutant's target is seen in CI (the harness,
`python -m tests.mutate`, is a dev tool that CI does not run; a stale mutant tests
nothing). Re-target a stale one to the code as it now is, and rerun it."""
from __future__ import annotations

import os

from tests.mutate import REPO, load_mutants


def test_every_mutant_applies_to_the_code_as_it_is():
    stale = []
    for mutant in load_mutants():
        with open(os.path.join(REPO, mutant.file), encoding="utf-8") as f:
            count = f.read().count(mutant.old)
        if count != 1:
            stale.append(f"{mutant.name} ({mutant.file}: old text found {count} times)")
    assert not stale, "stale mutants in tests/mutants.toml: " + "; ".join(stale)
