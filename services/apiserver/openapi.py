"""A minimal OpenAPI v3 surface, just enough for kubectl.

kubectl 1.35 validates manifests on ``create -f`` by checking, in ``/openapi/v3``, whether the
server's PATCH operation for the kind accepts the ``fieldValidation`` query parameter; if it
does, validation is left to the server, otherwise kubectl downloads full schemas (which this
server does not have) and fails. So each group/version document lists, for every kind, the
item path with a PATCH operation carrying that parameter and the GVK extension. Nothing else.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .resources import Registry, ResourceType


def gv_path(group: str, version: str) -> str:
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def _hash(reg: Registry, group: str, version: str) -> str:
    text = ",".join(f"{rt.kind}:{rt.plural}" for rt in reg.in_group_version(group, version))
    return hashlib.sha256(f"{group}/{version}:{text}".encode()).hexdigest()[:32].upper()


def root(reg: Registry) -> dict[str, Any]:
    paths = {}
    for group, versions in reg.group_versions().items():
        for version in versions:
            p = gv_path(group, version)
            paths[p] = {"serverRelativeURL": f"/openapi/v3/{p}?hash={_hash(reg, group, version)}"}
    return {"paths": paths}


def _item_path(rt: ResourceType) -> str:
    base = "/" + gv_path(rt.group, rt.version)
    if rt.namespaced:
        return f"{base}/namespaces/{{namespace}}/{rt.plural}/{{name}}"
    return f"{base}/{rt.plural}/{{name}}"


def group_version(reg: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = reg.in_group_version(group, version)
    if version not in reg.group_versions().get(group, []):
        return None
    paths: dict[str, Any] = {}
    for rt in types:
        gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
        params = [
            {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
            {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
            {"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
        ]
        if rt.namespaced:
            params.append({"name": "namespace", "in": "path", "required": True, "schema": {"type": "string"}})
        op = {
            "operationId": f"patch{rt.kind}",
            "parameters": params,
            "responses": {"200": {"description": "OK"}},
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": gvk,
        }
        paths[_item_path(rt)] = {"patch": op}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (vmfence development server)", "version": "v1.35.0"},
        "paths": paths,
        "components": {"schemas": {}},
    }
