"""A service process that lost its port to another process between ``free_port()`` and its bind is
started again on a new port (the bench's fleet lost a full suite's run to exactly this race); a
process that fails for any other reason is not retried."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from services.testbed.chaos.proc import Proc
from services.testbed.natsserver import free_port

# binds --http-port and answers /readyz, or says what the services say when the port is taken
SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--http-port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
try:
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError as exc:
    print(f"error: cannot listen on 127.0.0.1:{port}: {exc.strerror.lower()}", flush=True)
    sys.exit(1)
srv.serve_forever()
"""


async def test_a_start_that_lost_its_port_is_retried_on_another(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = Proc("svc", "svc", [sys.executable, "-c", SERVER, "--http-port", str(port)], port, tmp_path / "svc.log")
        try:
            assert await proc.start_ready(within_s=10)
            assert proc.port != port and proc.argv[-1] == str(proc.port)
            assert "address already in use" in (tmp_path / "svc.log").read_text()
        finally:
            proc.kill()


async def test_another_failure_is_not_retried(tmp_path: Path) -> None:
    port = free_port()
    proc = Proc("svc", "svc", [sys.executable, "-c", "raise SystemExit('no config')", "--http-port", str(port)],
                port, tmp_path / "svc.log")
    assert not await proc.start_ready(within_s=10)
    assert proc.port == port
