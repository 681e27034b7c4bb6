"""shared.config, the one configuration path: bounds, one-line errors, flag over environment over
default, the effective configuration at debug level with secrets masked, and a help text for every
flag of every service."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from services.agent.config import AgentConfig
from services.cli.common import OperatorConfig
from services.reconciler.config import ReconcilerConfig
from services.watcher.service import WatcherConfig
from shared.bus.connect import NatsAuth, mask_url
from shared.config import (
    EXIT_CONFIG,
    ConfigError,
    HttpSettings,
    ServiceSettings,
    build_parser,
    entries,
    load,
    override,
    setting,
    start,
)

SERVICES = [AgentConfig, ReconcilerConfig, WatcherConfig, OperatorConfig]
SHARED_FLAGS = {"--nats-url", "--nats-user", "--nats-password", "--nats-creds", "--nats-nkey", "--nats-tls-ca",
                "--nats-tls-cert", "--nats-tls-key", "--prefix", "--partitions"}
SERVICE_FLAGS = {"--log-format", "--log-level", "--http-host", "--http-port"}


@dataclass(frozen=True)
class Demo(ServiceSettings):
    PROG: ClassVar[str] = "vmfence demo-service"

    http_port: int = override(HttpSettings, "http_port", 1234)
    workers: int = setting(4, "worker tasks", lo=1, hi=64)
    ttl_s: float = setting(2.5, "seconds a thing lives", flag="--ttl", lo=0.5)
    mode: str = setting("fast", "fast or safe", choices=("fast", "safe"))
    token: str | None = setting(None, "an API token", secret=True)
    tags: tuple[str, ...] = setting((), "a tag (repeatable)", flag="--tag", repeat=True, pattern=r"[a-z]+",
                                    want="lower-case letters")
    verbose: bool = setting(False, "say more")
    key_file: str | None = setting(None, "a key file", file=True)
    plain: int = 7  # not a setting: no flag, no variable


@pytest.fixture
def root_logging() -> Iterator[None]:
    """start() configures the root logger; give it back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_defaults_and_names() -> None:
    cfg = load(Demo, [], env={})
    assert (cfg.workers, cfg.ttl_s, cfg.mode, cfg.tags, cfg.verbose, cfg.http_port, cfg.plain) == (
        4, 2.5, "fast", (), False, 1234, 7)
    assert cfg.nats_url == ["nats://127.0.0.1:4222"] and cfg.log_format == "json" and cfg.log_level == "info"
    names = {e.name: (e.flag, e.env) for e in entries(Demo)}
    assert names["ttl_s"] == ("--ttl", "VMFENCE_TTL")
    assert names["nats_tls_ca"] == ("--nats-tls-ca", "VMFENCE_NATS_TLS_CA")
    assert names["http_port"] == ("--http-port", "VMFENCE_HTTP_PORT")
    assert "plain" not in names
    help_of = {e.name: e.help_text() for e in entries(Demo)}
    assert help_of["workers"] == "worker tasks [VMFENCE_WORKERS, default 4]"
    assert help_of["token"] == "an API token [VMFENCE_TOKEN]"
    assert "default 0" in {e.name: e.help_text() for e in entries(ReconcilerConfig)}["max_partitions"]


def test_flag_beats_environment_beats_default() -> None:
    env = {"VMFENCE_WORKERS": "8", "VMFENCE_TTL": "3", "VMFENCE_MODE": "safe", "VMFENCE_TAG": "a,b",
           "VMFENCE_VERBOSE": "yes", "VMFENCE_NATS_URL": "nats://a:1, nats://b:2", "VMFENCE_LOG_LEVEL": "DEBUG"}
    cfg = load(Demo, [], env=env)
    assert (cfg.workers, cfg.ttl_s, cfg.mode, cfg.tags, cfg.verbose) == (8, 3.0, "safe", ("a", "b"), True)
    assert cfg.nats_url == ["nats://a:1", "nats://b:2"] and cfg.log_level == "debug"
    cfg = load(Demo, ["--workers", "2", "--ttl", "1", "--tag", "x", "--tag", "y", "--nats", "nats://c:3"], env=env)
    assert (cfg.workers, cfg.ttl_s, cfg.tags, cfg.nats_url) == (2, 1.0, ("x", "y"), ["nats://c:3"])
    assert cfg.mode == "safe"  # not given as a flag: the environment's
    assert load(Demo, [], env={"VMFENCE_WORKERS": "  "}).workers == 4  # empty counts as unset


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (["--workers", "many"], {}, "--workers/VMFENCE_WORKERS='many' is not an integer"),
        ([], {"VMFENCE_WORKERS": "0"}, "--workers/VMFENCE_WORKERS=0 is out of range 1..64"),
        (["--workers", "65"], {}, "--workers/VMFENCE_WORKERS=65 is out of range 1..64"),
        (["--ttl", "0.1"], {}, "--ttl/VMFENCE_TTL=0.1 must be at least 0.5"),
        (["--ttl", "soon"], {}, "--ttl/VMFENCE_TTL='soon' is not a number"),
        (["--mode", "slow"], {}, "--mode/VMFENCE_MODE='slow' must be fast or safe"),
        (["--tag", "OK"], {}, "--tag/VMFENCE_TAG='OK' must be lower-case letters"),
        ([], {"VMFENCE_VERBOSE": "maybe"}, "--verbose/VMFENCE_VERBOSE='maybe' is not a boolean"),
        (["--key-file", "/nonexistent/k"], {}, "--key-file/VMFENCE_KEY_FILE='/nonexistent/k' is not a readable "
                                              "file: it does not exist"),
        (["--http-port", "65536"], {}, "--http-port/VMFENCE_HTTP_PORT=65536 is out of range 0..65535"),
        (["--prefix", "a.b"], {}, "--prefix/VMFENCE_PREFIX='a.b' must be [a-z][a-z0-9_-]*"),
        (["--partitions", "0"], {}, "--partitions/VMFENCE_PARTITIONS=0 is out of range 1..4096"),
        ([], {"VMFENCE_NATS_URL": "localhost:4222"}, "--nats-url/VMFENCE_NATS_URL='localhost:4222' must be nats://"),
        (["--log-format", "xml"], {}, "--log-format/VMFENCE_LOG_FORMAT='xml' must be json or text"),
        (["--log-level", "loud"], {}, "--log-level/VMFENCE_LOG_LEVEL='loud' must be debug, info, warning or error"),
        ([], {"VMFENCE_NATS_USER": "u"}, "--nats-user/VMFENCE_NATS_USER and --nats-password/VMFENCE_NATS_PASSWORD "
                                         "go together"),
        ([], {"VMFENCE_NATS_TLS_CERT": __file__}, "--nats-tls-cert/VMFENCE_NATS_TLS_CERT and --nats-tls-key"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (["--nats-url", "nats://u:pw-secret@h:1/x"], {}, "--nats-url/VMFENCE_NATS_URL='nats://u:***@h:1/x' must be"),
    ],
)
def test_a_bad_value_is_one_line(argv: list[str], env: dict[str, str], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(Demo, argv, env=env)
    text = str(err.value)
    assert "\n" not in text and text.startswith(line), text
    assert "secret" not in text


def test_start_prints_the_one_line_and_asks_for_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert start(Demo, ["--workers", "0"], env={}) is None
    out, err = capsys.readouterr()
    assert out == "" and err == "vmfence demo-service: error: --workers/VMFENCE_WORKERS=0 is out of range 1..64\n"
    assert EXIT_CONFIG == 2


def test_effective_config_at_debug_masks_secrets(capsys: pytest.CaptureFixture[str], root_logging: None) -> None:
    env = {"VMFENCE_NATS_URL": "nats://svc:url-secret@a:4222,nats://b:4222", "VMFENCE_NATS_USER": "svc",
           "VMFENCE_NATS_PASSWORD": "pw-secret", "VMFENCE_TOKEN": "tok-secret"}
    cfg = start(Demo, ["--log-level", "debug", "--log-format", "text"], env=env)
    assert cfg is not None and cfg.nats_password == "pw-secret"
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "effective configuration" in line]
    assert len(lines) == 1, err
    assert "nats_url=nats://svc:***@a:4222,nats://b:4222" in lines[0]
    assert "nats_user=svc" in lines[0] and "nats_password=***" in lines[0] and "token=***" in lines[0]
    assert "secret" not in err
    cfg = start(Demo, ["--log-format", "text"], env=env)  # at info: not printed at all
    assert "effective configuration" not in capsys.readouterr().err


def test_the_nats_identity_and_tls_reach_the_connection(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read until a connection is made")
    cfg = load(Demo, ["--nats-user", "agent-host-a", "--nats-tls-ca", str(ca)], env={"VMFENCE_NATS_PASSWORD": "pw"})
    auth = cfg.nats_auth
    assert auth == NatsAuth(user="agent-host-a", password="pw", tls_ca=str(ca))
    assert "pw" not in repr(auth) and "password=***" in repr(auth)
    assert NatsAuth(user="u", password="p").options() == {"user": "u", "password": "p"}
    with pytest.raises(ConfigError, match="give one NATS identity, not user/password and creds"):
        load(Demo, ["--nats-user", "u", "--nats-password", "p", "--nats-creds", str(ca)], env={})


def test_mask_url() -> None:
    assert mask_url("nats://u:p%40ss@h:4222") == "nats://u:***@h:4222"
    assert mask_url("nats://h:4222") == "nats://h:4222"
    assert mask_url("nats://u:a:b@h:4222") == "nats://u:***@h:4222"
    assert mask_url("nats://h:1,nats://u:p@k:2") == "nats://h:1,nats://u:***@k:2"
    assert mask_url("tls://u:a@h:1,nats://v:b@k:2") == "tls://u:***@h:1,nats://v:***@k:2"
    assert mask_url("nats://s3cret-token@h:4222") == "nats://***@h:4222"  # nats-py takes a bare user as a token


def test_a_setting_without_help_is_refused() -> None:
    with pytest.raises(TypeError, match="help"):
        setting(1)


@pytest.mark.parametrize("cls", SERVICES, ids=lambda c: c.__name__)
def test_every_flag_has_help_and_a_vmfence_variable(cls: type) -> None:
    parser = build_parser(cls)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings} has no help"
    envs = [e.env for e in entries(cls)]
    assert all(e.startswith("VMFENCE_") for e in envs) and len(envs) == len(set(envs))
    shown = {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
    assert SHARED_FLAGS <= shown
    hidden = {s for a in parser._actions if a.help == argparse.SUPPRESS for s in a.option_strings}
    # old names still work, and are not advertised: --nats everywhere, the agent's --vnc-range
    old_names = {"--nats", "--vnc-range"} if cls is AgentConfig else {"--nats"}
    assert hidden == old_names


@pytest.mark.parametrize("cls", [AgentConfig, ReconcilerConfig, WatcherConfig], ids=lambda c: c.__name__)
def test_every_service_reads_the_same_shared_settings(cls: type) -> None:
    names = {e.flag for e in entries(cls)}
    assert SHARED_FLAGS | SERVICE_FLAGS <= names


def test_services_keep_their_own_defaults() -> None:
    assert load(AgentConfig, ["--data-dir", "/tmp/vmfence-test-config"], env={}).http_port == 9102
    assert load(ReconcilerConfig, [], env={}).http_port == 9180
    assert load(WatcherConfig, [], env={}).http_host == "127.0.0.1"


@pytest.mark.skipif(importlib.util.find_spec("nkeys") is not None, reason="nkeys is installed")
def test_creds_without_the_nkeys_package_is_one_line(tmp_path: Path) -> None:
    creds = tmp_path / "agent.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    with pytest.raises(ConfigError, match=r"need the nkeys package \(pip install nkeys\)"):
        load(Demo, ["--nats-creds", str(creds)], env={})
