"""An agent's capacity is its host's (issue 11 §3, Nodes): CPUs from sched_getaffinity, memory from
/proc/meminfo's MemTotal, minus a configurable reserve; explicit --cpus / --memory-mib win."""

from __future__ import annotations

import os
from pathlib import Path

from services.agent.config import MIN_MEMORY_MIB, AgentConfig, host_cpus, host_memory_mib


def test_the_default_capacity_is_the_hosts_minus_the_reserve(tmp_path: Path) -> None:
    cfg = AgentConfig(data_dir=str(tmp_path), reserve_memory_mib=1024)
    assert cfg.cpus == max(1, len(os.sched_getaffinity(0)))
    assert cfg.memory_mib == host_memory_mib() - 1024
    explicit = AgentConfig(data_dir=str(tmp_path), cpus=3, memory_mib=2048, reserve_cpus=1)
    assert (explicit.cpus, explicit.memory_mib) == (3, 2048), "an explicit figure is the capacity offered"
    reserved = AgentConfig(data_dir=str(tmp_path), reserve_cpus=host_cpus() + 5, reserve_memory_mib=10**9)
    assert (reserved.cpus, reserved.memory_mib) == (1, MIN_MEMORY_MIB), "a reserve never leaves a host at zero"


def test_meminfo_is_read_hostile_safe(tmp_path: Path) -> None:
    good = tmp_path / "meminfo"
    good.write_text("MemTotal:       24683584 kB\nMemFree:        1 kB\n")
    assert host_memory_mib(str(good)) == 24683584 // 1024
    for text in ("MemTotal: lots kB\n", "MemTotal: " + "9" * 5000 + " kB\n", "", "\0\xff garbage"):
        bad = tmp_path / "bad"
        bad.write_text(text, encoding="latin-1")
        assert host_memory_mib(str(bad)) == 4096
    assert host_memory_mib(str(tmp_path / "missing")) == 4096


def test_the_derivation_keeps_the_shared_settings_post_init(tmp_path: Path) -> None:
    """AgentConfig's own __post_init__ runs the shared one first (a str NATS URL becomes the list
    the checks expect: without it every AgentConfig(nats_url=...) failed its check)."""
    cfg = AgentConfig(data_dir=str(tmp_path), nats_url="nats://127.0.0.1:4222")  # type: ignore[arg-type]
    cfg.check()
    assert cfg.cpus >= 1
