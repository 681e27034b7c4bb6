"""A local stack runs NATS with the deployment's users and permissions (issue 10, finding 3).

Everything here goes through the real nats-server the stack started from deploy/nats/accounts.conf:
a `create` or `remove` forged with a live pod's fence and published to `vmfence.cmd.<host>` as any
identity but the reconcilers' is refused by the server (a permissions violation), never reaches
the command stream and changes no VM; the same message from the reconcilers' identity is obeyed,
so the refusal is the permissions' doing. The stack's password file, server config, kubeconfig and
stack.json are 0600 in 0700 directories, and an operator command reads stack.json and logs in as
`audit` with no flag.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
from nats.aio.client import Client

from services.testbed.natsserver import CONFIG_FILE
from services.testbed.stack import USERS_FILE
from shared.fence.schema import Command, Fence, Spec, encode
from tests.e2e.conftest import NS, Env

REFUSAL_WAIT_S = 10.0  # the server's -ERR follows the refused PUB on the same connection
CLI_TIMEOUT_S = 120.0
FORGERS = ("agent-host-a", "agent-host-b", "watcher", "audit")


async def _connect_as(env: Env, user: str, refused: list[str], seen: asyncio.Event) -> Client:
    url, password = env.stack.identity(user)

    async def on_error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            refused.append(str(exc))
            seen.set()

    return await nats.connect(url, user=user, password=password, error_cb=on_error,
                              allow_reconnect=False, name=f"forger-{user}")


async def _cmd_last_seq(env: Env) -> int:
    assert env.stack.bus is not None
    return int((await env.stack.bus.js.stream_info(env.stack.subjects.stream_cmd)).state.last_seq)


async def test_forged_commands_are_refused_by_nats_for_every_identity_but_the_reconcilers(env: Env) -> None:
    uid = await env.create("victim")
    pod = await env.wait_running("victim", uid)
    ann = pod.metadata.annotations
    host, vm_id = ann["vmfence.io/host"], ann["vmfence.io/vm-id"]
    fence = Fence(f"{NS}/victim", uid, int(ann["vmfence.io/epoch"]))
    await env.settle()
    subjects = env.stack.subjects
    remove = Command("forged-remove", "remove", fence, host, vm_id)
    create = Command("forged-create", "create", Fence(f"{NS}/intruder", "0000-intruder", 1), host,
                     "intruder-00000000-1", Spec())
    before = await _cmd_last_seq(env)

    for user in FORGERS:
        refused: list[str] = []
        seen = asyncio.Event()
        nc = await _connect_as(env, user, refused, seen)
        try:
            for cmd in (remove, create):
                seen.clear()
                await nc.publish(subjects.command(host), encode(cmd), headers={"Nats-Msg-Id": f"{user}-{cmd.id}"})
                await nc.flush()
                await asyncio.wait_for(seen.wait(), REFUSAL_WAIT_S)
        finally:
            await nc.close()
        assert len(refused) == 2 and all(f"vmfence.cmd.{host}" in r for r in refused), (user, refused)

    assert await _cmd_last_seq(env) == before, "a forged command reached VMFENCE_CMD"
    live = {vm.vm_id for vm in await env.vms()}
    assert vm_id in live and "intruder-00000000-1" not in live
    assert env.is_running_ready(await env.get("victim"), uid)

    # the control: the reconcilers' identity may command the agent, and the agent obeys
    url, password = env.stack.identity("reconciler")
    rec = await nats.connect(url, user="reconciler", password=password, allow_reconnect=False)
    try:
        ack = await rec.jetstream().publish(subjects.command(host), encode(remove), timeout=5)
    finally:
        await rec.close()
    assert ack.seq > before

    async def removed() -> bool:
        return vm_id not in {vm.vm_id for vm in await env.vms()}

    await env.wait_for("the reconciler identity's remove executed", removed)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_the_stacks_secrets_are_private_and_stack_json_logs_operators_in_as_audit(env: Env,
                                                                                       tmp_path: Path) -> None:
    root = env.stack.root
    workdir = tmp_path / "operator"
    record = workdir / ".vmfence" / "stack.json"
    env.stack.record(str(record))
    for directory in (root, root / "nats", root / "logs", record.parent):
        assert _mode(directory) == 0o700, directory
    for secret in (root / USERS_FILE, root / "nats" / CONFIG_FILE, root / "kubeconfig", record,
                   *(root / "logs").iterdir()):
        assert _mode(secret) == 0o600, secret
    # every file the nats-server wrote (store, log) is its user's only
    for path in (root / "nats").rglob("*"):
        assert _mode(path) & 0o077 == 0, path

    users = json.loads((root / USERS_FILE).read_text())
    assert {"watcher", "reconciler", "audit", "admin", "agent-host-a", "agent-host-b"} <= users.keys()
    assert len(set(users.values())) == len(users), "every identity has its own password"
    raw = json.loads(record.read_text())
    assert raw["nats_url"].startswith("nats://audit:") and users["audit"] in raw["nats_url"]

    # operator commands in the stack's directory, no flag, no variable: they log in as audit
    bare = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")}
    for command in (["decisions", "--json"], ["replay", "--json", "--not-final"], ["status"]):
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "services.cli", *command],
            capture_output=True, text=True, cwd=workdir, timeout=CLI_TIMEOUT_S, env=bare,
        )
        assert out.returncode == 0, (command, out.stderr)
        assert users["audit"] not in out.stdout + out.stderr, command
    # and nobody gets in without a password
    try:
        anonymous = await nats.connect(env.stack.identity("audit")[0], allow_reconnect=False,
                                       max_reconnect_attempts=0, connect_timeout=2)
    except Exception as exc:
        assert "authorization" in str(exc).lower() or isinstance(exc, nats.errors.NoServersError), exc
    else:
        await anonymous.close()
        raise AssertionError("an anonymous client logged in to the stack's NATS")
