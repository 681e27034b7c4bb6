"""JSON trees in the development API server: the deep copy, the encoder's fallback, the merge
patches' copy-on-write, and request bodies the decoder refuses (400 Status, never 500)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.apiserver import jsontree
from services.apiserver.patch import merge_patch, strategic_merge_patch
from services.apiserver.server import ApiServer
from services.apiserver.store import SqlitePersistence

from .conftest import pod_body


def _tree() -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "labels": {"a": "1"}, "annotations": {"k": "v"}},
        "spec": {"containers": [{"name": "main", "env": [{"name": "E", "value": "1"}]}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastProbeTime": None}],
                   "ratio": 0.5, "count": 3, "ok": True},
    }


@pytest.mark.parametrize("big", [False, True], ids=["msgpack", "recursive-fallback"])
def test_deep_copy_is_deep(big: bool) -> None:
    orig = _tree()
    if big:  # beyond 64 bits: msgpack cannot hold it, the recursive copy takes over
        orig["status"]["count"] = 2**70
    before = copy.deepcopy(orig)
    dup = jsontree.deep_copy(orig)
    assert dup == orig and type(dup["status"]["count"]) is int and type(dup["status"]["ratio"]) is float
    dup["metadata"]["labels"]["b"] = "2"
    dup["spec"]["containers"][0]["env"].append({"name": "F"})
    dup["spec"]["containers"][0]["name"] = "other"
    dup["status"]["conditions"][0]["status"] = "False"
    dup["status"]["conditions"].clear()
    assert orig == before


def test_encode_matches_json_and_falls_back() -> None:
    tree = _tree()
    assert json.loads(jsontree.encode(tree)) == tree
    assert jsontree.encode({"n": 2**70}) == b'{"n":1180591620717411303424}'
    # a lone surrogate (msgspec refuses it) is escaped, as json.dumps does
    assert jsontree.encode({"m": "x\ud800"}) == b'{"m":"x\\ud800"}'


def test_merge_patches_leave_their_inputs_alone() -> None:
    for fn in (merge_patch, strategic_merge_patch):
        target, patch = _tree(), {
            "metadata": {"labels": {"a": None, "b": "2"}},
            "status": {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}]},
        }
        t0, p0 = copy.deepcopy(target), copy.deepcopy(patch)
        out = fn(target, patch)
        assert target == t0 and patch == p0
        assert out["metadata"]["labels"] == {"b": "2"} and out["status"]["phase"] == "Failed"
        assert out["status"]["conditions"][0]["status"] == "False"
        assert out["spec"] == target["spec"]


HOSTILE: list[tuple[str, str, bytes]] = [
    ("malformed", "application/json", b'{"metadata": {"name": "x"'),
    ("trailing garbage", "application/json", b'{"metadata": {"name": "x"}} x'),
    ("NaN", "application/json", b'{"metadata": {"name": "x"}, "spec": {"n": NaN}}'),
    ("Infinity", "application/json", b'{"metadata": {"name": "x"}, "spec": {"n": -Infinity}}'),
    ("float overflow", "application/json", b'{"metadata": {"name": "x"}, "spec": {"n": 1e400}}'),
    ("lone surrogate", "application/json", b'{"metadata": {"name": "x", "annotations": {"a": "\\ud800"}}}'),
    ("invalid utf-8", "application/json", b'{"metadata": {"name": "x\xff"}}'),
    ("byte order mark", "application/json", b'\xef\xbb\xbf{"metadata": {"name": "x"}}'),
    ("nested 100000 deep", "application/json", b'{"metadata": {"name": "x"}, "spec": ' + b"[" * 100_000),
    ("yaml null key", "application/yaml", b"metadata: {name: x}\nspec: {~: 1}\n"),
    ("yaml lone surrogate", "application/yaml", b'metadata: {name: x}\nspec: {a: "\\ud800"}\n'),
    ("yaml malformed", "application/yaml", b"metadata: {name: x\n"),
]


@pytest.mark.parametrize(("ctype", "raw"), [(c, r) for _, c, r in HOSTILE], ids=[n for n, _, _ in HOSTILE])
async def test_hostile_body_is_a_400_status(server: ApiServer, ctype: str, raw: bytes) -> None:
    pods = f"{server.url}/api/v1/namespaces/default/pods"
    async with aiohttp.ClientSession() as http:
        for method, url in (("POST", pods), ("PUT", f"{pods}/x")):
            async with http.request(method, url, data=raw, headers={"Content-Type": ctype}) as resp:
                body = await resp.json(content_type=None)
            assert resp.status == 400, body
            assert body["kind"] == "Status" and body["reason"] == "BadRequest" and body["code"] == 400
            assert body["message"].startswith("invalid request body: ")
        async with http.get(pods) as resp:  # nothing was stored, the server still answers
            assert resp.status == 200 and (await resp.json())["items"] == []


async def test_big_ints_stay_ints(server: ApiServer) -> None:
    pods = f"{server.url}/api/v1/namespaces/default/pods"
    big = 2**70
    async with aiohttp.ClientSession() as http:
        body = pod_body("big")
        body["metadata"]["annotations"] = {"a": "é"}
        raw = json.dumps(body)[:-1] + f', "x": {{"n": {big}, "f": 1.0}}}}'
        async with http.post(pods, data=raw, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 201
        patch = {"metadata": {"labels": {"l": "1"}}}
        async with http.patch(f"{pods}/big", json=patch,
                              headers={"Content-Type": "application/merge-patch+json"}) as resp:
            assert resp.status == 200
        async with http.get(f"{pods}/big") as resp:
            got = json.loads(await resp.read())
    assert got["x"] == {"n": big, "f": 1.0} and type(got["x"]["f"]) is float
    assert got["metadata"]["labels"] == {"l": "1"} and got["metadata"]["annotations"] == {"a": "é"}


def test_sqlite_rows_written_by_json_dumps_still_load(tmp_path: Path) -> None:
    """Rows from before the strict decoder (json.dumps wrote NaN and escaped lone surrogates)."""
    db = SqlitePersistence(str(tmp_path / "old.sqlite"))
    old = json.dumps({"metadata": {"name": "x"}, "spec": {"n": float("nan"), "s": "\ud800", "é": 2**70}})
    db.conn.execute("INSERT INTO objects VALUES ('pods', 'default', 'x', ?)", (old,))
    db.write("pods", ("default", "y"), {"metadata": {"name": "y"}, "spec": {"é": 2**70}}, 7)
    rv, objects = db.load()
    db.close()
    x, y = objects["pods"][("default", "x")], objects["pods"][("default", "y")]
    assert rv == 7 and x["spec"]["s"] == "\ud800" and x["spec"]["é"] == 2**70
    assert y == {"metadata": {"name": "y"}, "spec": {"é": 2**70}}
