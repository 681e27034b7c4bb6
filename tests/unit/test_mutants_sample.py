"""The mutation tier in CI: the catalogue still fits the code, and a sample of it is killed.

The whole catalogue runs with ``make mutants`` (docs/mutants.json); here, every snippet must still
occur exactly once in its file — a refactoring that moves or rewrites a fence check fails this test
and names the entry to rewrite — and a few fast mutants are applied in a temporary copy of the
repository and must be killed by their tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.testbed.mutant_catalogue import MUTANTS, SAMPLE
from services.testbed.mutants import REPO, check_catalogue, mutate, run_mutants, select


def test_every_catalogue_snippet_occurs_exactly_once_in_its_file() -> None:
    problems = check_catalogue(REPO)
    assert problems == [], "the mutants catalogue drifted from the code:\n" + "\n".join(problems)


def test_the_catalogue_covers_every_fence_module() -> None:
    covered = {m.file for m in MUTANTS}
    assert {
        *(f"shared/fence/decide/{m}.py" for m in (
            "bringup", "confirmation", "deletes", "lifecycle", "observations", "results", "tables", "timers", "writes",
        )),
        "shared/fence/state.py", "shared/fence/agentfence.py", "shared/bus/append.py",
        "services/reconciler/kube.py", "services/agent/ledger.py", "services/agent/executor.py",
    } <= covered
    assert all(m.rule for m in MUTANTS)
    assert all(len(m.equivalent) > 40 for m in MUTANTS if m.equivalent), "an equivalent mutant argues why"


def test_a_mutant_never_applies_to_a_snippet_that_is_not_unique() -> None:
    m = MUTANTS[0]
    text = (REPO / m.file).read_text()
    assert mutate(text, m) != text
    with pytest.raises(ValueError):
        mutate(text + m.original, m)


@pytest.mark.timeout(240)
def test_a_sample_of_mutants_is_killed_in_a_copy_of_the_repository() -> None:
    sample = select([], sample=True)
    assert 2 <= len(sample) <= 4 and [m.id for m in sample] == list(SAMPLE)
    before = {m.file: (REPO / m.file).read_text() for m in sample}
    result = run_mutants(sample, baseline=False, log=False)
    assert result.get("catalogue_problems") is None
    assert result["mutants"] == len(sample)
    assert result["killed"] == len(sample), result
    assert result["survived"] == [] and result["equivalent"] == []
    for r in result["results"]:  # type: ignore[attr-defined]
        assert r["status"] == "killed" and r["killed_by"].startswith("tests/"), r
    # the repository itself was never touched
    assert {f: (REPO / f).read_text() for f in before} == before
    assert not any(Path(p).name.startswith("vmfence-mutants-") for p in REPO.iterdir())
