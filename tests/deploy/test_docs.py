"""The operator docs' internal links resolve, and they cover what an operator needs."""

from __future__ import annotations

import re

import pytest

from .conftest import DOCS
from .test_observability import anchors

PAGES = ["operations.md", "security.md"]


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page: str) -> None:
    text = (DOCS / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        doc = DOCS / path if path else DOCS / page
        assert doc.is_file(), f"{page}: link to missing {path}"
        if anchor:
            assert anchor in anchors(doc.read_text()), f"{page}: no #{anchor} in {doc.name}"


def test_operations_covers_the_procedures() -> None:
    text = (DOCS / "operations.md").read_text()
    for needle in (
        "helm install",
        "docker compose",
        "Several hosts",
        "Changing the partition count",
        "Upgrading",
        "nats stream backup",
        "nats stream restore",
        "vmfence export",
        "When the audit finds a violation",
    ):
        assert needle in text, needle
