"""One configuration path for every service: each setting is declared once, as a field of the
service's frozen config dataclass, with its flag, ``VMFENCE_*`` variable, type, bound, default and
help text.

A field declared with :func:`setting` is a setting; its flag is ``--<field-name>`` (or the ``flag``
given) and its variable ``VMFENCE_<FLAG>``. A flag beats the variable, the variable beats the
default; an empty variable counts as unset. The value is converted by the field's type (``int``,
``float``, ``bool``, ``str``, optional of those, ``list[str]``/``tuple[str, ...]`` comma separated)
or by the setting's own ``parse``, then checked against its bounds (``lo``/``hi``, ``choices``,
``pattern``, ``file``, ``check``) and the class's cross-field :meth:`Config.check`. Any problem is
a :class:`ConfigError` whose text is the one line the operator sees; :func:`start` prints it as
``vmfence <service>: error: <line>`` and the service exits 2 (:data:`EXIT_CONFIG`).

Groups every service shares are mixins declared here once: :class:`NatsSettings` (URL, user and
password, creds, nkey seed, TLS CA/cert/key), :class:`BusSettings` (prefix, partitions),
:class:`LogSettings` (``--log-format``, ``--log-level``), :class:`HttpSettings` (the /metrics,
/livez, /readyz address) and :class:`KubeSettings` (the kubeconfig). A service may change a shared
setting's default with :func:`override`.

:func:`start` also sets up logging and logs the effective configuration at debug level, secrets
(``secret=True`` settings, a password inside a URL) masked.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn, Self, TypeVar, get_args, get_origin

from shared.bus.connect import NatsAuth, mask_url
from shared.fence.keys import DEFAULT_PARTITIONS
from shared.logs import setup_logging
from shared.subjects import DEFAULT_PREFIX, Subjects

log = logging.getLogger(__name__)

EXIT_CONFIG = 2
ENV_PREFIX = "VMFENCE_"
MASK = "***"
MAX_PARTITIONS = 4096
NATS_URL_RE = re.compile(r"^(nats|tls|ws|wss)://[^\s/]+/?$")
PREFIX_RE = r"[a-z][a-z0-9_-]{0,31}"  # one subject token, and (upper-cased) a stream name
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(Exception):
    """A configuration value is invalid; the message is the one line the operator sees."""


@dataclass(frozen=True)
class Spec:
    """How one config field is set and checked (see the module docstring)."""

    help: str
    flag: str = ""  # default: --<field name with dashes>
    env: str = ""  # default: VMFENCE_<flag without dashes, upper case>
    parse: Callable[[str], Any] | None = None  # text -> value, ValueError(problem) if it cannot
    lo: float | None = None
    hi: float | None = None
    choices: tuple[Any, ...] = ()
    pattern: str = ""  # a str value must match all of it
    want: str = ""  # what the pattern wants, in the error
    file: bool = False  # a path that must be a readable file
    check: Callable[[Any], str | None] | None = None  # value -> problem, or None when fine
    secret: bool = False  # masked wherever the config is shown
    aliases: tuple[str, ...] = ()  # further flags for the same setting, not shown in --help
    repeat: bool = False  # the flag may repeat (list/tuple), the variable is comma separated
    metavar: str | None = None
    shown_default: str = ""  # the default as --help says it, when it is computed at start


def setting(default: Any = dataclasses.MISSING, help: str = "", *,
            factory: Callable[[], Any] | None = None, **spec: Any) -> Any:
    """A config field that is a setting: ``port: int = setting(9102, "what it is", lo=0, hi=65535)``."""
    if not help:
        raise TypeError("every setting needs a help text")
    meta = {"setting": Spec(help=help, **spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def override(base: type, name: str, default: Any = dataclasses.MISSING, *,
             factory: Callable[[], Any] | None = None) -> Any:
    """The shared setting ``name`` of ``base`` with this service's own default."""
    meta = next(f.metadata for f in dataclasses.fields(base) if f.name == name)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ------------------------------------------------------------------------------ conversions


def to_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("is not an integer") from None


def to_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError("is not a number") from None


def to_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"is not a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")


def to_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _converter(tp: Any) -> Callable[[str], Any]:
    base = _strip_optional(tp)
    simple: dict[Any, Callable[[str], Any]] = {int: to_int, float: to_float, bool: to_bool, str: str}
    if base in simple:
        return simple[base]
    if get_origin(base) is list:
        return to_list
    if get_origin(base) is tuple:
        return lambda text: tuple(to_list(text))
    raise TypeError(f"no conversion for {tp!r}: give the setting a parse function")


def show(value: Any) -> str:
    """A value as the operator wrote it: lists comma joined, ranges FIRST-LAST."""
    if isinstance(value, list | tuple):
        return repr(",".join(str(v) for v in value))
    if isinstance(value, range):
        return repr(f"{value.start}-{value.stop - 1}") if len(value) else "'none'"
    return repr(value)


def _choices(choices: tuple[Any, ...]) -> str:
    words = [str(c) for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


# ------------------------------------------------------------------------------ the settings


@dataclass(frozen=True)
class Entry:
    """One setting of a config class: its field, spec, type and names."""

    name: str
    spec: Spec
    type: Any
    default: Any  # dataclasses.MISSING when computed by a factory

    @property
    def flag(self) -> str:
        return self.spec.flag or "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return self.spec.env or ENV_PREFIX + self.flag.lstrip("-").replace("-", "_").upper()

    @property
    def label(self) -> str:
        """How an error names the setting: both ways of giving it."""
        return f"{self.flag}/{self.env}"

    @property
    def is_switch(self) -> bool:
        return _strip_optional(self.type) is bool

    def convert(self, text: str) -> Any:
        return (self.spec.parse or _converter(self.type))(text)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of bounds, or None."""
        s = self.spec
        if value is None:
            return None
        items = value if isinstance(value, list | tuple) else [value]
        for v in items:
            if isinstance(v, int | float) and not isinstance(v, bool):
                if (s.lo is not None and v < s.lo) or (s.hi is not None and v > s.hi):
                    if s.hi is None:
                        return f"must be at least {s.lo:g}"
                    return f"is out of range {s.lo:g}..{s.hi:g}" if s.lo is not None else f"must be at most {s.hi:g}"
            if s.choices and v not in s.choices:
                return f"must be {_choices(s.choices)}"
            if s.pattern and isinstance(v, str) and not re.fullmatch(s.pattern, v):
                return f"must be {s.want or 'of the form ' + s.pattern}"
            if s.file and isinstance(v, str):
                if not os.path.exists(v):
                    return "is not a readable file: it does not exist"
                if not os.path.isfile(v) or not os.access(v, os.R_OK):
                    return "is not a readable file"
        return s.check(value) if s.check is not None else None

    def error(self, value: Any, problem: str) -> ConfigError:
        """The one line; a secret, or a password inside a URL, is not repeated in it."""
        shown = repr(MASK) if self.spec.secret else mask_url(show(value))
        return ConfigError(f"{self.label}={shown} {problem}")

    def help_text(self) -> str:
        if self.spec.shown_default:
            default = self.spec.shown_default
        elif self.default is dataclasses.MISSING or self.default is None or self.default is False \
                or self.default in ("", ()):
            default = ""
        else:
            default = show(self.default).strip("'")
        tail = f"{self.env}, default {default}" if default else self.env
        return f"{self.spec.help} [{tail}]".replace("%", "%%")


def entries(cls: type) -> list[Entry]:
    """The settings of a config class, in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("setting")
        if isinstance(spec, Spec):
            out.append(Entry(f.name, spec, hints[f.name], f.default))
    return out


C = TypeVar("C", bound="Config")


@dataclass(frozen=True)
class Config:
    """Base of every service's config: bounds of each setting, then the class's own checks."""

    PROG: ClassVar[str] = "vmfence"
    DESCRIPTION: ClassVar[str] = ""

    def validate(self) -> Self:
        """Raise ConfigError (one line) for the first invalid value; return self when fine."""
        for e in entries(type(self)):
            value = getattr(self, e.name)
            problem = e.problem(value)
            if problem is not None:
                raise e.error(value, problem)
        self.check()
        return self

    def check(self) -> None:
        """Checks across settings; a mixin that adds some calls ``super().check()``."""

    def describe(self) -> str:
        """Every field as ``name=value``, secrets masked: the effective configuration."""
        secret = {e.name for e in entries(type(self)) if e.spec.secret}
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in secret and value:
                text = MASK
            elif isinstance(value, str) and "://" in value:
                text = mask_url(value)
            elif isinstance(value, list | tuple) and any(isinstance(v, str) and "://" in v for v in value):
                text = ",".join(mask_url(str(v)) for v in value)
            else:
                text = show(value).strip("'")
            parts.append(f"{f.name}={text}")
        return " ".join(parts)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (ConfigError) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser(cls: type[Config]) -> argparse.ArgumentParser:
    p = _Parser(prog=cls.PROG, description=cls.DESCRIPTION)
    for e in entries(cls):
        common: dict[str, Any] = {"dest": e.name, "default": None}
        if e.is_switch:
            p.add_argument(e.flag, action="store_true", help=e.help_text(), **common)
            continue
        action = "append" if e.spec.repeat else "store"
        p.add_argument(e.flag, action=action, metavar=e.spec.metavar, help=e.help_text(), **common)
        for alias in e.spec.aliases:
            p.add_argument(alias, action=action, help=argparse.SUPPRESS, **common)
    return p


def load(cls: type[C], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> C:
    """Flags beat ``VMFENCE_*`` variables beat defaults; raises ConfigError with one line."""
    env = os.environ if env is None else env
    ns = vars(build_parser(cls).parse_args(list(argv) if argv is not None else sys.argv[1:]))
    values: dict[str, Any] = {}
    for e in entries(cls):
        given = ns.get(e.name)
        if given is not None and e.is_switch:
            values[e.name] = bool(given)
            continue
        if given is not None and e.spec.repeat:
            raw = ",".join(given)
        elif given is not None:
            raw = str(given)
        elif env.get(e.env, "").strip():
            raw = env[e.env]
        else:
            continue
        try:
            values[e.name] = e.convert(raw)
        except ValueError as exc:
            raise e.error(raw, str(exc)) from None
    return cls(**values).validate()


def start(cls: type[C], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> C | None:
    """What a service's ``main`` does first: load and validate (on an error print its one line and
    return None: exit :data:`EXIT_CONFIG`), set up logging, log the effective config at debug."""
    try:
        cfg = load(cls, argv, env)
    except ConfigError as exc:
        config_error(cls.PROG, exc)
        return None
    if isinstance(cfg, LogSettings):
        setup_logging(cfg.log_format, cfg.log_level)
    log.debug("effective configuration: %s", cfg.describe())
    return cfg


def config_error(prog: str, exc: BaseException) -> int:
    """Print the one line of a configuration error; the exit code to return."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return EXIT_CONFIG


# ------------------------------------------------------------------------------ shared groups


def _nats_urls(text: str) -> list[str]:
    urls = to_list(text)
    if not urls:
        raise ValueError("must be nats:// URL(s), comma-separated")
    return urls


def _check_urls(urls: list[str]) -> str | None:
    if not urls or not all(NATS_URL_RE.match(u) for u in urls):
        return "must be nats:// URL(s), comma-separated (nats://host:port)"
    return None


@dataclass(frozen=True)
class NatsSettings(Config):
    """Where NATS is and who this process is there (docs/security.md)."""

    nats_url: list[str] = setting(  # noqa: RUF009 - setting() is dataclasses.field() with a Spec
        help="NATS server URL(s), comma separated", factory=lambda: ["nats://127.0.0.1:4222"],
        parse=_nats_urls, check=_check_urls, aliases=("--nats",), metavar="URL[,URL...]",
    )
    nats_user: str | None = setting(None, "NATS user (with --nats-password)")
    nats_password: str | None = setting(None, "NATS password of --nats-user", secret=True)
    nats_creds: str | None = setting(None, "NATS credentials file (JWT and nkey seed)", file=True)
    nats_nkey: str | None = setting(None, "NATS nkey seed file", file=True)
    nats_tls_ca: str | None = setting(None, "CA file to verify the NATS servers' certificates", file=True)
    nats_tls_cert: str | None = setting(None, "client certificate file for NATS TLS (with --nats-tls-key)", file=True)
    nats_tls_key: str | None = setting(None, "client key file for NATS TLS (with --nats-tls-cert)", file=True)

    def __post_init__(self) -> None:
        if isinstance(self.nats_url, str):  # one string of comma-separated URLs, as the flag takes it
            object.__setattr__(self, "nats_url", to_list(self.nats_url))

    def check(self) -> None:
        super().check()
        if (self.nats_user is None) != (self.nats_password is None):
            raise ConfigError("--nats-user/VMFENCE_NATS_USER and --nats-password/VMFENCE_NATS_PASSWORD go together")
        ways = [w for w, on in (("user/password", self.nats_user), ("creds", self.nats_creds),
                                ("nkey", self.nats_nkey)) if on]
        if len(ways) > 1:
            raise ConfigError(f"give one NATS identity, not {' and '.join(ways)}")
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ConfigError(
                "--nats-tls-cert/VMFENCE_NATS_TLS_CERT and --nats-tls-key/VMFENCE_NATS_TLS_KEY go together"
            )
        if (self.nats_creds or self.nats_nkey) and importlib.util.find_spec("nkeys") is None:
            raise ConfigError("NATS creds and nkey files need the nkeys package (pip install nkeys)")

    @property
    def nats_auth(self) -> NatsAuth:
        return NatsAuth(
            user=self.nats_user, password=self.nats_password, creds=self.nats_creds, nkey=self.nats_nkey,
            tls_ca=self.nats_tls_ca, tls_cert=self.nats_tls_cert, tls_key=self.nats_tls_key,
        )

    @property
    def nats_display(self) -> str:
        """The URLs for a log line or an error: passwords masked."""
        return ",".join(mask_url(u) for u in self.nats_url)


@dataclass(frozen=True)
class BusSettings(Config):
    """The deployment's names on the bus."""

    prefix: str = setting(DEFAULT_PREFIX, "subject/stream prefix", pattern=PREFIX_RE,
                          want="[a-z][a-z0-9_-]*, at most 32 characters, no dots")
    partitions: int = setting(DEFAULT_PARTITIONS, "partition count of the deployment (fixed per deployment)",
                              lo=1, hi=MAX_PARTITIONS)

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix, self.partitions)


@dataclass(frozen=True)
class LogSettings(Config):
    log_format: str = setting("json", "log lines: json or text", choices=LOG_FORMATS)
    log_level: str = setting("info", "debug, info, warning or error", choices=LOG_LEVELS,
                             parse=lambda text: text.strip().lower())


@dataclass(frozen=True)
class HttpSettings(Config):
    http_host: str = setting("127.0.0.1", "bind address of /metrics, /livez, /readyz")
    http_port: int = setting(9180, "port of /metrics, /livez, /readyz; 0 = any free port", lo=0, hi=65535)


@dataclass(frozen=True)
class KubeSettings(Config):
    """For the services that talk to Kubernetes (watcher, reconciler)."""

    kubeconfig: str | None = setting(None, "kubeconfig file (absent: in-cluster)", file=True)


@dataclass(frozen=True)
class ServiceSettings(NatsSettings, BusSettings, LogSettings, HttpSettings):
    """What every vmfence service that talks to NATS reads."""
