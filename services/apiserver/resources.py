"""The resource types the development server serves, and their discovery documents.

Built-in types are fixed; custom resources are registered from stored
``CustomResourceDefinition`` objects, so creating a CRD (e.g. with ``kubectl create -f``)
makes its resource servable, as on a real server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .jsontree import deep_copy

CRD_PATH = Path(__file__).resolve().parents[2] / "deploy" / "crds" / "virtualmachines.vmfence.io.yaml"
ALL_VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class ResourceType:
    """One REST resource (plural) in one group/version."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    printer_columns: tuple[dict[str, Any], ...] = ()
    custom: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_version(self) -> str:
        return self.api_version

    @property
    def key(self) -> str:
        """Storage key: one bucket per group+plural (versions share storage)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def status_subresource(self) -> bool:
        return "status" in self.subresources

    def discovery(self) -> list[dict[str, Any]]:
        """APIResource entries for the resource and its subresources."""
        main: dict[str, Any] = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": ALL_VERBS,
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        out = [main]
        for sub in sorted(self.subresources):
            if sub == "binding":
                out.append(
                    {
                        "name": f"{self.plural}/binding",
                        "singularName": "",
                        "namespaced": self.namespaced,
                        "kind": "Binding",
                        "verbs": ["create"],
                    }
                )
            elif sub == "eviction":
                out.append(
                    {
                        "name": f"{self.plural}/eviction",
                        "singularName": "",
                        "namespaced": self.namespaced,
                        "group": "policy",
                        "version": "v1",
                        "kind": "Eviction",
                        "verbs": ["create"],
                    }
                )
            else:
                out.append(
                    {
                        "name": f"{self.plural}/{sub}",
                        "singularName": "",
                        "namespaced": self.namespaced,
                        "kind": self.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return out


def _rt(
    group: str,
    version: str,
    plural: str,
    kind: str,
    namespaced: bool,
    short: tuple[str, ...] = (),
    subs: tuple[str, ...] = (),
    categories: tuple[str, ...] = (),
) -> ResourceType:
    return ResourceType(
        group=group,
        version=version,
        plural=plural,
        singular=kind.lower(),
        kind=kind,
        namespaced=namespaced,
        short_names=short,
        categories=categories,
        subresources=frozenset(subs),
    )


BUILTIN: tuple[ResourceType, ...] = (
    _rt("", "v1", "namespaces", "Namespace", False, ("ns",), ("status",)),
    _rt("", "v1", "pods", "Pod", True, ("po",), ("status", "eviction", "binding"), ("all",)),
    _rt("", "v1", "nodes", "Node", False, ("no",), ("status",)),
    _rt("", "v1", "events", "Event", True, ("ev",)),
    _rt("", "v1", "configmaps", "ConfigMap", True, ("cm",)),
    _rt("coordination.k8s.io", "v1", "leases", "Lease", True),
    _rt("events.k8s.io", "v1", "events", "Event", True, ("ev",)),
    _rt("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("pdb",), ("status",)),
    _rt(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("crd", "crds"),
        ("status",),
    ),
)

# Groups that are always announced, even when a group has no custom resources registered yet.
STATIC_GROUPS: tuple[tuple[str, str], ...] = (
    ("", "v1"),
    ("apiextensions.k8s.io", "v1"),
    ("coordination.k8s.io", "v1"),
    ("events.k8s.io", "v1"),
    ("policy", "v1"),
    ("vmfence.io", "v1alpha1"),
)

_EMBEDDED_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "virtualmachines.vmfence.io"},
    "spec": {
        "group": "vmfence.io",
        "scope": "Namespaced",
        "names": {
            "plural": "virtualmachines",
            "singular": "virtualmachine",
            "kind": "VirtualMachine",
            "listKind": "VirtualMachineList",
            "shortNames": ["vm"],
        },
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def load_vm_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    """The VirtualMachine CRD object from the repo manifest, or an embedded minimal copy."""
    try:
        with path.open() as fh:
            doc = yaml.safe_load(fh)
        if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
            return doc
    except OSError:
        pass
    return deep_copy(_EMBEDDED_CRD)


def crd_resource_types(crd: dict[str, Any]) -> list[ResourceType]:
    """The served versions of a CRD as resource types."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    out: list[ResourceType] = []
    for ver in spec.get("versions") or []:
        if not ver.get("served", True):
            continue
        out.append(
            ResourceType(
                group=spec.get("group", ""),
                version=ver["name"],
                plural=names["plural"],
                singular=names.get("singular") or names["kind"].lower(),
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=frozenset(k for k in (ver.get("subresources") or {}) if k == "status"),
                printer_columns=tuple(ver.get("additionalPrinterColumns") or ()),
                custom=True,
            )
        )
    return out


@dataclass
class Registry:
    """Mutable set of served resource types, indexed the ways the router needs."""

    types: dict[tuple[str, str, str], ResourceType] = field(default_factory=dict)

    @classmethod
    def builtin(cls) -> Registry:
        reg = cls()
        for rt in BUILTIN:
            reg.add(rt)
        return reg

    def add(self, rt: ResourceType) -> None:
        self.types[(rt.group, rt.version, rt.plural)] = rt

    def remove_group_plural(self, group: str, plural: str) -> None:
        for key in [k for k in self.types if k[0] == group and k[2] == plural]:
            del self.types[key]

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, version, plural))

    def group_versions(self) -> dict[str, list[str]]:
        """group -> versions, always including the statically announced groups."""
        out: dict[str, list[str]] = {}
        for group, version in STATIC_GROUPS:
            out.setdefault(group, [])
            if version not in out[group]:
                out[group].append(version)
        for group, version, _plural in self.types:
            out.setdefault(group, [])
            if version not in out[group]:
                out[group].append(version)
        return out

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        return sorted(
            (rt for (g, v, _p), rt in self.types.items() if g == group and v == version),
            key=lambda r: r.plural,
        )
