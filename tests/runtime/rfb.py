"""A minimal RFB (VNC) client for the tests: which security types a display offers, and whether a
password passes its "VNC Authentication" (RFC 6143 §7.2.2: DES of a 16-byte challenge, keyed by the
password's first 8 bytes with each byte's bits reversed). DES comes from ``openssl`` (its legacy
provider): no Python DES package is installed."""

from __future__ import annotations

import asyncio
import shutil
import struct
import subprocess

RFB_VERSION = b"RFB 003.008\n"
SEC_NONE = 1
SEC_VNC_AUTH = 2
IO_TIMEOUT_S = 10.0
OPENSSL = shutil.which("openssl")


def _des_key(password: str) -> bytes:
    raw = password.encode()[:8].ljust(8, b"\0")
    return bytes(int(f"{b:08b}"[::-1], 2) for b in raw)


def vnc_response(password: str, challenge: bytes) -> bytes:
    """The client's answer to ``challenge`` for ``password``."""
    assert OPENSSL is not None, "openssl is needed for DES"
    res = subprocess.run(
        [OPENSSL, "enc", "-des-ecb", "-nopad", "-K", _des_key(password).hex(),
         "-provider", "legacy", "-provider", "default"],
        input=challenge, capture_output=True, timeout=IO_TIMEOUT_S, check=True,
    )  # fmt: skip
    assert len(res.stdout) == 16, res.stderr
    return res.stdout


async def security_types(host: str, port: int) -> list[int]:
    """The security types the display offers (1 = None, 2 = VNC Authentication)."""
    async with asyncio.timeout(IO_TIMEOUT_S):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            assert (await reader.readexactly(12)).startswith(b"RFB ")
            writer.write(RFB_VERSION)
            await writer.drain()
            n = (await reader.readexactly(1))[0]
            return list(await reader.readexactly(n))
        finally:
            writer.close()


async def vnc_login(host: str, port: int, password: str) -> bool:
    """Whether ``password`` passes the display's VNC Authentication."""
    async with asyncio.timeout(IO_TIMEOUT_S):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await reader.readexactly(12)
            writer.write(RFB_VERSION)
            await writer.drain()
            n = (await reader.readexactly(1))[0]
            offered = list(await reader.readexactly(n))
            assert SEC_VNC_AUTH in offered, offered
            writer.write(bytes([SEC_VNC_AUTH]))
            await writer.drain()
            challenge = await reader.readexactly(16)
            writer.write(vnc_response(password, challenge))
            await writer.drain()
            (result,) = struct.unpack(">I", await reader.readexactly(4))
            return bool(result == 0)
        finally:
            writer.close()
