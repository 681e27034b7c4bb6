"""The docs name code that exists: every file, symbol and test they point a reader to is there.

What counts as a reference (in ``docs/*.md`` and ``README.md``, outside fenced code blocks):

- a backticked repository path (``shared/...``, ``services/...``, ``tests/...``, ``deploy/...``,
  ``scripts/...``, ``docs/...``): the file or directory exists;
- a backticked ``file.py`` without a directory: exactly one file of that name exists in the
  repository, or one under a directory the same table row or paragraph names, or the same page
  named it with its full path before;
- backticked symbols right after a ``file.py`` reference, separated from it and from each other
  only by spaces, commas and parentheses (``file.py`` (``Class``, ``Class.method``), ``function``):
  each is defined in that file — a top-level ``def``/``class``/assignment (an ``__init__.py`` may
  re-export an import), ``Class.attr`` a method, class attribute, dataclass field or ``self.attr``
  of that class (or of a base class in the same file); a bare name after ``Class.method`` may also
  be another member of that class. ``name(args) -> type`` is read as ``name``. Anything else
  (a flag, a prose word, text between the spans) ends the run;
- ``file.py::test_name`` (``::Class::test``), and ``::test_name`` for the last ``file.py`` named in
  the same table cell or paragraph: the test is defined in that file;
- a backticked dotted module path (``shared.fence.schema.entry_msg_id``): the module exists and
  defines the rest.

Spans outside a run are checked more loosely, where they can only be code: ``Class.member`` whose
class is defined somewhere in the repository (the member exists in one such class),
``module._private`` whose module's file name is ``module.py`` (one such file defines it), and a bare
``_private`` name (something of that name is defined somewhere: a def, class, member or
assignment). ``module.public`` is left alone: ``status.hostIP``, ``config.merge`` or ``vm.yaml``
name values and files as often as code.

Imports do not count as definitions (outside ``__init__.py``): a doc that says a function lives in
a file that only imports it sends the reader to the wrong room.

Files a make target writes (``GENERATED``) count as present while the Makefile still writes them.
And the policy tables docs/architecture.md shows must be the tables of the decide package's docstring, as
they are: the docstring is their source.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .conftest import DOCS, REPO

PAGES = [*sorted(p.relative_to(REPO).as_posix() for p in DOCS.glob("*.md")), "README.md"]
ROOTS = ("shared", "services", "tests", "deploy", "scripts", "docs")

SPAN = re.compile(r"`([^`\n]+)`")
PY_REF = re.compile(r"^(?P<path>[\w./-]*\w\.py)(?P<tests>(?:::[\w\[\]-]+)+)?$")
CONT_REF = re.compile(r"^(?P<tests>(?:::[\w\[\]-]+)+)$")
SYMBOL = re.compile(r"^(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?(?:\s*->.*)?$")
REPO_PATH = re.compile(rf"^(?:{'|'.join(ROOTS)})(?:/[\w.-]+)*/?$")
MODULE_REF = re.compile(r"^(?:shared|services|tests)(?:\.[A-Za-z_]\w*)+$")
# Files the docs name that a make target writes instead of the repository holding them; each must be
# named in the Makefile (checked below), so an entry cannot outlive its target.
GENERATED = {"docs/mutants.json": "make mutants"}

JOINER = re.compile(r"^[\s,()]*$")
DOTTED = re.compile(r"^(?P<head>[A-Za-z]\w*)(?P<rest>(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
PRIVATE = re.compile(r"^(?P<name>_[a-z]\w*)(?:\(.*\))?$")


# ------------------------------------------------------------------------------ the repository


@functools.cache
def _by_basename() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for root in ROOTS:
        for p in (REPO / root).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            out.setdefault(p.name, []).append(p.relative_to(REPO).as_posix())
    return {k: tuple(sorted(v)) for k, v in out.items()}


@dataclass
class Module:
    """What a Python file defines: top-level names, and per class its members and bases."""

    names: set[str] = field(default_factory=set)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n for t in node.targets for n in _names(t)]
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return _names(node.target)
    if type(node).__name__ == "TypeAlias":  # ``type X = ...`` (Python 3.12)
        return _names(node.name)  # type: ignore[attr-defined]
    return []


def _names(t: ast.AST) -> list[str]:
    if isinstance(t, ast.Name):
        return [t.id]
    if isinstance(t, ast.Tuple | ast.List):
        return [n for e in t.elts for n in _names(e)]
    return []


@functools.cache
def _module(path: str) -> Module:
    tree = ast.parse((REPO / path).read_text(), filename=path)
    mod = Module()
    reexports = path.endswith("__init__.py")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mod.names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            mod.names.add(node.name)
            mod.classes[node.name] = node
        elif reexports and isinstance(node, ast.ImportFrom | ast.Import):
            mod.names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            mod.names.update(_targets(node))
    return mod


def _members(cls: ast.ClassDef) -> tuple[set[str], dict[str, ast.ClassDef]]:
    """A class's own members: defs, class-level assignments and fields, ``self.x`` assignments."""
    names: set[str] = set()
    nested: dict[str, ast.ClassDef] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
            for sub in ast.walk(node):
                for t in (sub.targets if isinstance(sub, ast.Assign) else
                          [sub.target] if isinstance(sub, ast.AnnAssign | ast.AugAssign) else []):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            nested[node.name] = node
        else:
            names.update(_targets(node))
    return names, nested


def _has_member(mod: Module, cls: ast.ClassDef, name: str, seen: frozenset[str] = frozenset()) -> ast.ClassDef | bool:
    """True (or the nested class) if ``cls`` or a base class defined in the same file has ``name``."""
    names, nested = _members(cls)
    if name in nested:
        return nested[name]
    if name in names:
        return True
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in mod.classes and base.id not in seen:
            found = _has_member(mod, mod.classes[base.id], name, seen | {cls.name})
            if found:
                return found
    return False


@functools.cache
def _everywhere() -> tuple[dict[str, tuple[str, ...]], frozenset[str]]:
    """Top-level classes by name (the files defining them), and every name anything defines."""
    classes: dict[str, list[str]] = {}
    defined: set[str] = set()
    for paths in _by_basename().values():
        for path in paths:
            mod = _module(path)
            for name in mod.classes:
                classes.setdefault(name, []).append(path)
            tree = ast.parse((REPO / path).read_text(), filename=path)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    defined.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                else:
                    defined.update(_targets(node))
    return {k: tuple(v) for k, v in classes.items()}, frozenset(defined)


def _resolve_chain(path: str, chain: list[str]) -> str | None:
    """None if ``a.b.c`` names something ``path`` defines, else what is missing."""
    mod = _module(path)
    head, rest = chain[0], chain[1:]
    if head not in mod.names:
        return f"no top-level {head!r}"
    if not rest:
        return None
    cls = mod.classes.get(head)
    for i, name in enumerate(rest):
        if cls is None:
            return f"{'.'.join(chain[: i + 1])!r} is not a class defined there"
        found = _has_member(mod, cls, name)
        if not found:
            return f"class {cls.name!r} has no member {name!r}"
        cls = found if isinstance(found, ast.ClassDef) else None
    return None


# ------------------------------------------------------------------------------ the pages


def _segments(text: str) -> list[tuple[str, str]]:
    """Table cells and paragraphs (list items apart), each with its context (a cell's whole row),
    fenced code blocks left out."""
    segments: list[tuple[str, str]] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            joined = " ".join(para)
            segments.append((joined, joined))
            para.clear()

    fenced = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        if not stripped:
            flush()
        elif stripped.startswith("|"):
            flush()
            segments.extend((cell, stripped) for cell in re.split(r"(?<!\\)\|", stripped))
        elif re.match(r"^([-*+]|\d+\.)\s", stripped) or stripped.startswith("#"):
            flush()
            para.append(stripped)
        else:
            para.append(stripped)
    flush()
    return segments


@dataclass
class Checker:
    page: str
    problems: list[str] = field(default_factory=list)
    full_paths: dict[str, str] = field(default_factory=dict)  # basename -> last full path named
    count: int = 0

    def fail(self, span: str, why: str) -> None:
        self.problems.append(f"{self.page}: `{span}`: {why}")

    def py_file(self, span: str, ref: str, context: str = "") -> str | None:
        """The repository path of a ``.py`` reference, or None (a problem recorded). A bare file
        name is the one file of that name, or the one under a directory its row or paragraph names,
        or the one this page last named with its full path."""
        self.count += 1
        if "/" in ref:
            if not (REPO / ref).is_file():
                self.fail(span, "no such file")
                return None
            self.full_paths[Path(ref).name] = ref
            return ref
        found = _by_basename().get(ref, ())
        if len(found) == 1:
            return found[0]
        dirs = [d.rstrip("/") + "/" for d in SPAN.findall(context) if REPO_PATH.match(d) and (REPO / d).is_dir()]
        under = [f for f in found if any(f.startswith(d) for d in dirs)]
        if len(under) == 1:
            return under[0]
        if ref in self.full_paths:
            return self.full_paths[ref]
        self.fail(span, "no such file anywhere" if not found else f"ambiguous, could be {', '.join(found)}")
        return None

    def symbol(self, span: str, path: str, name: str, cls: str | None) -> None:
        self.count += 1
        chain = name.split(".")
        problem = _resolve_chain(path, chain)
        if problem is not None and cls is not None and len(chain) == 1:
            # "Class.method, other": a bare name after a member may be another member
            if _resolve_chain(path, [cls, name]) is None:
                return
        if problem is not None:
            self.fail(span, f"not in {path}: {problem}")

    def tests(self, span: str, path: str, tests: str) -> None:
        self.count += 1
        chain = [re.sub(r"\[.*$", "", t) for t in tests.split("::") if t]
        problem = _resolve_chain(path, chain)
        if problem is not None:
            self.fail(span, f"not in {path}: {problem}")

    def module(self, span: str) -> None:
        self.count += 1
        parts = span.split(".")
        for i in range(len(parts), 0, -1):
            base = "/".join(parts[:i])
            for candidate in (f"{base}.py", f"{base}/__init__.py"):
                if (REPO / candidate).is_file():
                    if i < len(parts):
                        problem = _resolve_chain(candidate, parts[i:])
                        if problem is not None:
                            self.fail(span, f"not in {candidate}: {problem}")
                    return
        self.fail(span, "no such module")

    def segment(self, seg: str, context: str = "") -> None:
        run_file: str | None = None  # the file a run of symbols belongs to
        run_class: str | None = None  # the class the run last named
        test_file: str | None = None  # the last file.py of this segment, for ``::name``
        end = 0
        for m in SPAN.finditer(seg):
            span, between, end = m.group(1).strip(), seg[end : m.start()], m.end()
            if not JOINER.match(between):
                run_file = run_class = None
            if (py := PY_REF.match(span)) is not None:
                path = self.py_file(span, py.group("path"), context)
                run_file, run_class = (path, None) if py.group("tests") is None else (None, None)
                test_file = path
                if path is not None and py.group("tests"):
                    self.tests(span, path, py.group("tests"))
                continue
            if (cont := CONT_REF.match(span)) is not None:
                if test_file is None:
                    self.fail(span, "`::name` with no `file.py` before it in the same cell or paragraph")
                else:
                    self.tests(span, test_file, cont.group("tests"))
                run_file = None
                continue
            if run_file is not None and (sym := SYMBOL.match(span)) is not None:
                name = sym.group("name")
                self.symbol(span, run_file, name, run_class)
                if "." in name:
                    run_class = name.split(".")[0]
                continue
            run_file = run_class = None
            if REPO_PATH.match(span):
                self.count += 1
                if not (REPO / span.rstrip("/")).exists() and span not in GENERATED:
                    self.fail(span, "no such file or directory")
            elif MODULE_REF.match(span):
                self.module(span)
            else:
                self.loose(span)

    def loose(self, span: str) -> None:
        """``Class.member``, ``module.name`` and ``_private`` named without their file."""
        classes, defined = _everywhere()
        if (dotted := DOTTED.match(span)) is not None:
            head, rest = dotted.group("head"), dotted.group("rest").lstrip(".").split(".")
            if head in classes:  # Class.member
                paths, chain = classes[head], [head, *rest]
            elif any(r.startswith("_") for r in rest):  # module._private, when head.py is a file here
                paths, chain = _by_basename().get(f"{head}.py", ()), rest
            else:  # obj.attr, a values path, a file name: not necessarily code
                return
            if not paths:
                return  # not a name of this repository (asyncio.wait_for, a field path)
            self.count += 1
            problems = [p for p in paths if _resolve_chain(p, chain) is not None]
            if len(problems) == len(paths):
                self.fail(span, f"not in {', '.join(paths)}: {_resolve_chain(paths[0], chain)}")
        elif (private := PRIVATE.match(span)) is not None:
            self.count += 1
            if private.group("name") not in defined:
                self.fail(span, "nothing of that name is defined anywhere")


def check_page(page: str, text: str | None = None) -> Checker:
    checker = Checker(page)
    for seg, context in _segments((REPO / page).read_text() if text is None else text):
        checker.segment(seg, context)
    return checker


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("page", PAGES)
def test_code_references_exist(page: str) -> None:
    problems = check_page(page).problems
    assert not problems, "\n".join(problems)


def _indented_blocks(doc: str) -> list[str]:
    """The indented tables of a docstring, dedented, as a page shows them in fenced blocks."""
    blocks: list[list[str]] = []
    current: list[str] = []
    for line in doc.splitlines():
        if line.startswith("    ") or (current and not line.strip()):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    return [textwrap.dedent("\n".join(b)).strip("\n") for b in blocks]


def _fenced_blocks(text: str) -> list[str]:
    return [m.strip("\n") for m in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)]


def test_the_policy_tables_on_the_architecture_page_are_decides_docstring() -> None:
    """The docstring of shared/fence/decide/__init__.py is the source of the reading guide, the result grid and
    the timer table (tests/unit/test_policy_table.py checks it against the tables); the page shows
    each of them as it is, in a fenced block of its own."""
    doc = ast.get_docstring(ast.parse((REPO / "shared/fence/decide/__init__.py").read_text()), clean=False) or ""
    tables = _indented_blocks(doc)
    assert len(tables) >= 3, "the decide package's docstring lost its tables"
    shown = _fenced_blocks((DOCS / "architecture.md").read_text())
    missing = [t.splitlines()[0] for t in tables if t not in shown]
    assert not missing, f"docs/architecture.md does not show these tables of the decide package's docstring: {missing}"


def test_generated_files_are_written_by_the_makefile() -> None:
    makefile = (REPO / "Makefile").read_text()
    for path, target in GENERATED.items():
        assert f"{target.split()[-1]}:" in makefile and path in makefile, f"{path}: {target} no longer writes it"


def test_the_architecture_page_is_checked() -> None:
    """The checker finds the references it is meant to (a parser that matched nothing would pass)."""
    assert check_page("docs/architecture.md").count > 150


def test_the_checker_catches_what_it_should_and_only_that() -> None:
    text = "\n".join([
        "| a | `shared/fence/decide/tables.py` `decide`, `_on_timer`; `shared/fence/nope.py` |",
        "| b | `shared/fence/decide/tables.py` `no_such_rule`, `CannotHappen.nope` |",
        "| c | `services/agent/executor.py` `fence_verdict` (imported there, defined elsewhere) |",
        "| d | `services/agent/executor.py` `Executor.execute`, `record`, `_check_mark` |",
        "| e | `tests/unit/test_policy_table.py::test_missing_test`, `::also_missing` |",
        "| f | `shared/fence/decide/tables.py`: rule 12 lives in `timer_purpose_of_nothing` (prose, not a run) |",
        "| g | `shared.fence.schema.Nothing`, `shared.nothing`, `services/agent/ops/` `shared/gone/` |",
        "| h | `::orphan` `run.py` `within_bounds(inp) -> Input` |",
        "```",
        "`shared/fenced/off.py` `nothing` — a code block is not checked",
        "```",
    ])
    problems = check_page("README.md", text).problems
    flagged = sorted(p.split("`")[1] for p in problems)
    assert flagged == sorted([
        "shared/fence/nope.py",
        "no_such_rule",
        "CannotHappen.nope",
        "fence_verdict",
        "tests/unit/test_policy_table.py::test_missing_test",
        "::also_missing",
        "shared.fence.schema.Nothing",
        "shared.nothing",
        "shared/gone/",
        "::orphan",
    ]), "\n".join(problems)
