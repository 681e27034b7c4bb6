"""One service process of a multi-process test stack (the chaos campaigns' and the fleet
benchmark's): a fixed argv, port and log, so a restart keeps its identity; started, stopped,
SIGKILLed and asked over HTTP whether it is ready."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the repository (this file is services/testbed/<pkg>/)
READY_TIMEOUT_S = 60.0  # a restarted component becomes ready (bounded; a miss is reported)
STOP_TIMEOUT_S = 20.0  # SIGTERM -> exit before SIGKILL
POLL_S = 0.2  # readiness has no event to wait on: bounded polling
HTTP_TIMEOUT_S = 2.0


@dataclass
class Proc:
    """One service process with a fixed argv, port and log, so a restart keeps its identity."""

    name: str
    kind: str
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # its NATS identity (VMFENCE_NATS_USER/_PASSWORD)
    keep_fds: tuple[int, ...] = ()  # the run directory's lock: held while this process lives
    popen: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        from services.testbed.stack import private_append

        env = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_NATS_")} | self.env
        err = private_append(self.log)
        try:  # the identity travels in the environment, never in argv (ps shows argv to everyone)
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, cwd=ROOT, env=env,
                start_new_session=True, umask=0o077, pass_fds=self.keep_fds,
            )
        finally:
            os.close(err)  # the child keeps its own descriptor

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    async def stop(self) -> None:
        """SIGTERM (agents then remove their VMs), bounded, then SIGKILL."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.popen.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    async def wait_ready(self, within_s: float = READY_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if not self.running:
                return False
            if await http_status(self.port, "/readyz") == 200:
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def start_ready(self, within_s: float = READY_TIMEOUT_S, attempts: int = 3) -> bool:
        """Start and wait until ready; a start that lost its port to another process between
        ``free_port()`` and its bind ("address already in use") is retried on a new port."""
        from services.testbed.natsserver import free_port

        for _ in range(attempts):
            if not self.running:
                self.start()
            if await self.wait_ready(within_s):
                return True
            if self.running or "address already in use" not in self.tail(5):
                return False
            self.rebind(free_port())
        return False

    def rebind(self, port: int) -> None:
        """Listen on ``port`` from the next start (its ``--http-port`` and its ``port``)."""
        i = self.argv.index("--http-port")
        self.argv[i + 1] = str(port)
        self.port = port

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


async def _http(port: int, request: bytes) -> int:
    """One HTTP/1.0 exchange with 127.0.0.1:``port``: the answer's status (0: no answer)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), HTTP_TIMEOUT_S)
    except (OSError, TimeoutError):
        return 0
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), HTTP_TIMEOUT_S)
        parts = line.split()
        return int(parts[1]) if len(parts) >= 2 else 0
    except (OSError, TimeoutError, ValueError):
        return 0
    finally:
        writer.close()


async def http_status(port: int, path: str) -> int:
    return await _http(port, f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())


async def http_post_json(port: int, path: str, body: dict[str, Any]) -> int:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return await _http(port, head.encode() + data)


def cli(*args: str) -> list[str]:
    """The argv of `python -m services.cli <args>` in this interpreter."""
    return [sys.executable, "-m", "services.cli", *args]
