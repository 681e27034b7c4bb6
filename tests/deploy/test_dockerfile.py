"""deploy/Dockerfile, read rather than built (no container engine in CI)."""

from __future__ import annotations

import json
import re

from .conftest import DEPLOY, REPO

DOCKERFILE = DEPLOY / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def test_base_image_and_packages() -> None:
    ins = instructions()
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    froms = [a.split()[0] for op, a in ins if op == "FROM"]
    assert froms, "FROM"
    resolved = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], f) for f in froms]
    assert resolved[-1] == "python:3.11-slim", "the runtime stage is python:3.11-slim"
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert re.search(r"apt-get install[^&]*\bqemu-system-x86\b", runs)
    assert re.search(r"apt-get install[^&]*\bqemu-utils\b", runs)
    assert "rm -rf /var/lib/apt/lists" in runs
    assert re.search(r"pip (install|wheel)\b[^&]*\s\.(\s|$)", runs), "installs the project itself"


def test_non_root_and_entrypoint() -> None:
    ins = instructions()
    users = [a for op, a in ins if op == "USER"]
    assert users and not users[-1].startswith(("0", "root")), "runs as a non-root user"
    (entry,) = [json.loads(a) for op, a in ins if op == "ENTRYPOINT"]
    assert entry[-1] == "vmfence", "the console script is the entrypoint"


def test_copied_paths_exist() -> None:
    for op, a in instructions():
        if op != "COPY" or a.startswith("--from"):
            continue
        *sources, _dest = a.split()
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: not in the repository"
