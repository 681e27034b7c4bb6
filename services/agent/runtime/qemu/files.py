"""Small synchronous helpers over the files QEMU and the kernel keep (pidfiles, /proc, logs, the
guest image): each is a sub-millisecond local operation, so the driver calls them from the loop."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator

# What the driver keeps is the guest's: its disk, its RAM (snapshots), its console, its record
# (with the VNC password). Files are the agent user's alone, directories too.
FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: str) -> None:
    """``path`` (and missing parents) as a directory only the agent user may enter."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    if os.stat(path).st_mode & 0o777 != DIR_MODE:
        os.chmod(path, DIR_MODE)


def private_file(path: str) -> None:
    """``path`` exists and is readable by the agent user alone (created empty if missing), so a
    process that opens it for writing (QEMU's serial/debugcon files, a migration's ``cat >``)
    keeps that mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)


def open_private(path: str, flags: int) -> int:
    """``os.open`` of a file created ``FILE_MODE`` (an existing one is made so)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def copy_private(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst``, which is ``FILE_MODE`` from its first byte."""
    with open(src, "rb") as fin, os.fdopen(open_private(dst, os.O_WRONLY | os.O_TRUNC), "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def read_pidfile(vm_dir: str) -> int | None:
    try:
        with open(os.path.join(vm_dir, "qemu.pid")) as f:
            return int(f.read().strip() or "0") or None
    except (FileNotFoundError, ValueError, NotADirectoryError):
        return None


def kill_pidfile(path: str) -> None:
    """SIGKILL the process a pidfile names, if it is still a QEMU (pids are reused)."""
    try:
        with open(path) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"qemu" not in f.read():
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def proc_state(pid: int) -> str | None:
    """The /proc state letter of pid, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0]


def is_our_qemu(pid: int, vm_dir: str) -> bool:
    """pid is alive (not a zombie) and is the QEMU of vm_dir (guards against pid reuse)."""
    st = proc_state(pid)
    if st is None or st in ("Z", "X"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return os.path.join(vm_dir, "qemu.pid").encode() in cmd


def tail(path: str, n: int = 800) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def file_contains(path: str, needles: tuple[bytes, ...]) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    return any(n in data for n in needles)


@contextlib.contextmanager
def short_path(path: str) -> Iterator[str]:
    """AF_UNIX paths are limited to 108 bytes: reach long ones through /proc/self/fd/<dirfd>."""
    if len(os.fsencode(path)) < 100:
        yield path
        return
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


def image_files(image: str) -> tuple[str, str] | None:
    """A guest image directory's kernel and initramfs, or None if it lacks either."""
    k, i = os.path.join(image, "vmlinuz"), os.path.join(image, "initramfs.cpio.gz")
    if os.path.isfile(k) and os.path.isfile(i):
        return k, i
    return None
