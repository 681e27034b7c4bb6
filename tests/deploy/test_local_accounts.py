"""The local stacks' NATS config is deploy/nats/accounts.conf itself, rendered (issue 10, finding 3):
the same users and permission lists, generated passwords, and a host with no user of its own gets
the host-a block with its name — and the reconciler's user can watch the hosts and leases buckets,
as its hosts view and lease rounds do (nats-py's watch asks its consumer's info)."""

from __future__ import annotations

import re
from pathlib import Path

import nats
import nats.errors

from services.testbed.natsserver import (
    ACCOUNTS_CONF,
    local_accounts,
    render_accounts,
    start_nats,
    users_of,
)
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.subjects import Subjects

WATCH_TIMEOUT_S = 10.0


def _strip_passwords(text: str) -> str:
    return re.sub(r'password: ("[^"]*"|\$\w+)', "password: X", text)


def test_the_rendered_config_is_accounts_conf_with_passwords_and_rendered_hosts() -> None:
    source = ACCOUNTS_CONF.read_text()
    text, users = local_accounts(("host-a", "host-b"))
    assert _strip_passwords(text) == _strip_passwords(source), "hosts it already has change nothing"
    assert "$VMFENCE_NATS_" not in text and users.passwords["audit"] in text

    extra = render_accounts(("edge-7",))
    block = extra[extra.index("AGENT_EDGE_7_PERMISSIONS:"):]
    block = block[: block.index("\n}\n")]
    template = source[source.index("AGENT_HOST_A_PERMISSIONS:"):]
    template = template[: template.index("\n}\n")]
    assert block == template.replace("host-a", "edge-7").replace("HOST_A", "EDGE_7")
    assert users_of(extra) == [*users_of(source)[:3], "agent-edge-7", *users_of(source)[3:]]


async def test_the_reconciler_watches_its_buckets_under_the_rendered_permissions(tmp_path: Path) -> None:
    """The hosts bucket (its hosts view) and the leases bucket (its lease rounds wake on a release)."""
    text, users = local_accounts(("host-a",))
    server = await start_nats(store_dir=str(tmp_path / "nats"), config_text=text)
    subjects = Subjects()
    try:
        bus = await Bus.open(server.url, name="rec", subjects=subjects, auth=users.auth("reconciler"))
        try:
            await provision(bus.js, subjects, StreamsConfig())
            for bucket in (subjects.kv_hosts, subjects.kv_leases):
                kv = await bus.js.key_value(bucket)
                watcher = await kv.watchall(meta_only=bucket == subjects.kv_leases)
                first = await watcher.updates(timeout=WATCH_TIMEOUT_S)
                assert first is None, bucket  # the end of the (empty) initial values: the watch is up
                await watcher.stop()
        finally:
            await bus.close()
        try:
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        except (nats.errors.Error, OSError) as exc:
            assert "authorization" in str(exc).lower() or isinstance(exc, nats.errors.NoServersError)
        else:
            raise AssertionError("anonymous login accepted")
    finally:
        await server.stop()
