"""``python -m services.testbed.mutants``: the fence code's mutation tier (``make mutants``).

Each mutant of :mod:`services.testbed.mutant_catalogue` takes one fence check out of the code — an
exact snippet that occurs exactly once in its file is replaced — and the fast tests named for it
must then fail. The runner never touches the repository it was started from: it copies the
repository once into a temporary directory (the working tree's tracked and untracked, not ignored,
files; or ``--rev REV``'s tree), checks that the copy's modules are the ones imported there, runs
the named tests unmutated (a mutant "killed" by tests that fail anyway proves nothing), then for
each mutant writes the mutated file into the copy, runs its tests with ``-x`` (one at a time: the
parallelism is 1), and puts the original back. It prints (and with ``--out`` writes) JSON::

    {"mutants": N, "killed": K, "survived": [...], "equivalent": [...], "seconds": S, "results": [...]}

``survived`` names each survivor's ``file:line`` and what changed; ``equivalent`` lists mutants the
catalogue argues change no behaviour, each with its reason (they are run too: one that is killed is
reported killed). Exit status 0 iff no mutant survived and the catalogue is sound (every snippet
occurs exactly once, see :func:`check_catalogue`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from services.testbed.mutant_catalogue import MUTANTS, SAMPLE, Mutant

REPO = Path(__file__).resolve().parents[2]
MUTANT_TIMEOUT_S = 600.0  # one mutant's test run; a hang counts as killed (and is reported so)
BASELINE_TIMEOUT_S = 900.0
NOT_SOURCE = (".git", ".venv", "build", ".vmfence", "__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache",
              ".mypy_cache", ".ruff_cache")
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    status: str  # "killed" | "survived" | "equivalent" | "timeout"
    line: int
    seconds: float
    killed_by: str = ""

    def as_json(self) -> dict[str, object]:
        m = self.mutant
        out: dict[str, object] = {
            "id": m.id, "status": self.status, "where": f"{m.file}:{self.line}", "rule": m.rule,
            "change": change_text(m), "tests": list(m.tests), "seconds": round(self.seconds, 1),
        }
        if self.killed_by:
            out["killed_by"] = self.killed_by
        if m.equivalent:
            out["reason"] = m.equivalent
        return out


def change_text(m: Mutant) -> str:
    def squash(s: str) -> str:
        return " ".join(s.split()) or "(nothing)"

    return f"{squash(m.original)}  ->  {squash(m.replacement)}"


# ------------------------------------------------------------------------------ the catalogue


def check_catalogue(root: Path = REPO, mutants: Iterable[Mutant] = MUTANTS) -> list[str]:
    """What is wrong with the catalogue against the code under ``root`` (empty: nothing): every
    original snippet must occur exactly once in its file (code that moved or changed shows up here
    rather than as a mutant that silently mutates nothing), ids are unique, every mutant names test
    files that exist, and a mutant changes something."""
    problems: list[str] = []
    seen: set[str] = set()
    for m in mutants:
        if m.id in seen:
            problems.append(f"{m.id}: duplicate id")
        seen.add(m.id)
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.id}: {m.file} does not exist")
            continue
        n = path.read_text().count(m.original)
        if n != 1:
            problems.append(f"{m.id}: its snippet occurs {n} times in {m.file} (must be exactly once)")
        if m.original == m.replacement:
            problems.append(f"{m.id}: the replacement equals the original")
        if not m.tests:
            problems.append(f"{m.id}: names no tests")
        for t in m.tests:
            if not (root / t.split("::", 1)[0]).exists():
                problems.append(f"{m.id}: test {t} does not exist")
            if "test_mutants_sample" in t:
                problems.append(f"{m.id}: the sample test would run the runner recursively")
    return problems


def line_of(text: str, snippet: str) -> int:
    return text[: text.index(snippet)].count("\n") + 1


def mutate(text: str, m: Mutant) -> str:
    if text.count(m.original) != 1:
        raise ValueError(f"{m.id}: snippet must occur exactly once in {m.file}")
    return text.replace(m.original, m.replacement, 1)


# ------------------------------------------------------------------------------ the copy


def _git(root: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True).stdout


def copy_repository(root: Path, dest: Path, rev: str | None = None) -> None:
    """``rev``'s tree, or the working tree's tracked and untracked files that git does not ignore."""
    if rev is not None:
        with tarfile.open(fileobj=BytesIO(_git(root, "archive", "--format=tar", rev))) as tar:
            tar.extractall(dest, filter="data")
        return
    try:
        listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        # not a git checkout (an unpacked source tree): everything but what .gitignore names
        shutil.copytree(root, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
        return
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = root / rel
        if not src.is_file():
            continue  # deleted in the working tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    # the copy's packages first: the editable install's finder comes after sys.path
    env["PYTHONPATH"] = str(copy)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def check_imports_from(copy: Path, files: Iterable[str]) -> None:
    """Refuse to run when the modules to mutate would be imported from anywhere but the copy."""
    modules = sorted({f[:-3].replace("/", ".") for f in files if f.endswith(".py")})
    code = "import importlib, sys\nfor m in sys.argv[1:]: print(importlib.import_module(m).__file__)"
    out = subprocess.run([sys.executable, "-c", code, *modules], cwd=copy, env=_env(copy),
                         check=True, capture_output=True, text=True).stdout.split()
    outside = [p for p in out if not Path(p).resolve().is_relative_to(copy.resolve())]
    if outside:
        raise RuntimeError(f"modules would be imported from outside the copy: {outside}")


def run_tests(copy: Path, tests: Sequence[str], timeout: float) -> tuple[int | None, str]:
    """pytest in the copy (``-x``, no cache, the ci hypothesis profile); (returncode, output) —
    returncode None on a timeout."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider",
           "--hypothesis-profile=ci", "-m", "not qemu and not slow", *tests]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return None, str(e.stdout or "")
    return proc.returncode, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ the run


def run_mutants(
    mutants: Sequence[Mutant], *, root: Path = REPO, rev: str | None = None, baseline: bool = True,
    log: bool = True,
) -> dict[str, object]:
    started = time.monotonic()
    results: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="vmfence-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        copy.mkdir()
        copy_repository(root, copy, rev)
        if copy.resolve() == root.resolve():
            raise RuntimeError("refusing to mutate the repository itself")
        problems = check_catalogue(copy, mutants)  # the copy is what is mutated (the working tree or rev)
        if problems:
            return {"mutants": len(mutants), "killed": 0, "survived": [], "equivalent": [],
                    "seconds": round(time.monotonic() - started, 1), "catalogue_problems": problems,
                    "results": []}
        check_imports_from(copy, {m.file for m in mutants})
        if baseline:
            tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
            rc, out = run_tests(copy, tests, BASELINE_TIMEOUT_S)
            if rc != 0:
                raise RuntimeError(f"the unmutated tests do not pass (rc={rc}):\n{out[-4000:]}")
            if log:
                print(f"baseline: {len(tests)} test files pass unmutated", file=sys.stderr)
        for m in mutants:
            path = copy / m.file
            original = path.read_text()
            line = line_of(original, m.original)
            t0 = time.monotonic()
            try:
                path.write_text(mutate(original, m))
                rc, out = run_tests(copy, m.tests, MUTANT_TIMEOUT_S)
            finally:
                path.write_text(original)
            seconds = time.monotonic() - t0
            failed = _FAILED.findall(out)
            if rc is None:
                status, by = "timeout", "(timed out: counted as killed)"
            elif rc == 0:
                status, by = ("equivalent" if m.equivalent else "survived"), ""
            elif rc == 1:
                status, by = "killed", failed[0] if failed else "(a test failed)"
            else:
                # 2: interrupted (collection error), 3: internal error, 4: usage — a broken mutant
                raise RuntimeError(f"{m.id}: pytest exited {rc} — the mutant breaks more than a rule:\n{out[-3000:]}")
            results.append(Outcome(m, status, line, seconds, by))
            if log:
                print(f"{m.id:44s} {status:10s} {seconds:6.1f}s {by}", file=sys.stderr)
    out = summary(results, time.monotonic() - started)
    out["source"] = source_of(root, rev)
    return out


def source_of(root: Path, rev: str | None) -> str:
    """Which code was mutated: a commit, or the working tree on top of one."""
    try:
        sha = _git(root, "rev-parse", rev or "HEAD").decode().strip()
        dirty = rev is None and bool(_git(root, "status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.CalledProcessError):
        return rev or "working tree"
    return f"{sha} (working tree, with uncommitted changes)" if dirty else sha


def summary(results: Sequence[Outcome], seconds: float) -> dict[str, object]:
    def brief(o: Outcome) -> dict[str, object]:
        return {k: v for k, v in o.as_json().items() if k in ("id", "where", "rule", "change", "reason")}

    return {
        "mutants": len(results),
        "killed": sum(1 for o in results if o.status in ("killed", "timeout")),
        "survived": [brief(o) for o in results if o.status == "survived"],
        "equivalent": [brief(o) for o in results if o.status == "equivalent"],
        "seconds": round(seconds, 1),
        "results": [o.as_json() for o in results],
    }


def select(ids: Sequence[str], *, sample: bool) -> list[Mutant]:
    by_id = {m.id: m for m in MUTANTS}
    wanted = list(SAMPLE) if sample else list(ids)
    unknown = [i for i in wanted if i not in by_id]
    if unknown:
        raise SystemExit(f"unknown mutant ids: {unknown}")
    return [by_id[i] for i in wanted] if wanted else list(MUTANTS)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.testbed.mutants", description=__doc__.split("\n\n")[0])
    p.add_argument("ids", nargs="*", help="mutant ids to run (default: all)")
    p.add_argument("--sample", action="store_true", help="only the small CI sample")
    p.add_argument("--rev", help="mutate this revision's tree instead of the working tree")
    p.add_argument("--tests", help="comma-separated test files to use instead of each mutant's own")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--check", action="store_true", help="only check the catalogue against the code")
    p.add_argument("--list", action="store_true", help="list the catalogue")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.id:44s} {m.file:34s} {m.rule}")
        return 0
    if args.check:
        problems = check_catalogue()
        print("\n".join(problems) or f"catalogue sound: {len(MUTANTS)} mutants, every snippet occurs once")
        return 1 if problems else 0
    mutants = select(args.ids, sample=args.sample)
    if args.tests:
        override = tuple(t for t in args.tests.split(",") if t)
        mutants = [Mutant(m.id, m.file, m.original, m.replacement, m.rule, override, m.equivalent) for m in mutants]
    result = run_mutants(mutants, rev=args.rev, baseline=not args.no_baseline)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if not result["survived"] and not result.get("catalogue_problems") else 1


if __name__ == "__main__":
    sys.exit(main())
