"""deploy/Dockerfile, read (tests/deploy/test_compose_run.py builds it with `make images` and runs it)."""

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


def test_builds_on_debians_python_too() -> None:
    """The debootstrap base of `make images` has Debian's python3 without pip: the build stage makes
    a venv (python3-venv installed only when missing), the runtime stage skips apt when the base
    already has the packages, and the console script comes from the venv on PATH."""
    ins = instructions()
    runs = [a for op, a in ins if op == "RUN"]
    assert any("python3 -m venv /opt/vmfence" in r and "python3-venv" in r for r in runs)
    assert any("dpkg -s qemu-system-x86" in r for r in runs), "apt only when the packages are missing"
    envs = " ".join(a for op, a in ins if op == "ENV")
    assert "PATH=/opt/vmfence/bin:$PATH" in envs
    assert any(op == "COPY" and a.startswith("--from=build /opt/vmfence") for op, a in ins)


def test_the_ca_bundle_is_a_build_secret_never_a_layer() -> None:
    """pip trusts the CA of a TLS-intercepting proxy through `--secret id=pip-ca`, mounted for the
    pip step only; nothing copies a certificate or sets PIP_CERT in the image."""
    ins = instructions()
    pip_runs = [a for op, a in ins if op == "RUN" and "pip install" in a and "--no-deps" not in a]
    assert pip_runs and all(a.startswith("--mount=type=secret,id=pip-ca") for a in pip_runs)
    assert not any(op == "ENV" and "PIP_CERT" in a for op, a in ins)
    assert not any(op in ("COPY", "ADD") and (".crt" in a or ".pem" in a) for op, a in ins)
    script = (REPO / "scripts" / "build-images.sh").read_text()
    assert "--secret id=pip-ca,src=" in script
