"""Issue 10, finding 10: image names resolve only inside the configured image store.

``../x``, absolute paths, symlinks that leave the store and NUL bytes are an invalid spec: the
kernel's podspec refuses their shape at admission, and the agent — the real guard, whatever a
command carries — answers ``failed`` naming ``spec.image`` without calling the runtime with it, on
the sim and on the real QEMU driver alike. Each driver given an ``image_store`` checks again.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from services.agent.config import AgentConfig
from services.agent.runtime import ImageError, VMSpec, check_in_store, resolve_image
from services.agent.runtime.qemu import QemuDriver
from services.agent.runtime.sim import SimDriver
from services.agent.service import Agent
from shared.fence.podspec import SpecError, parse_image
from shared.fence.schema import CommandResult, Spec

from .conftest import Reports, command, fence, send

HOSTILE = ["../x", "../../etc", "a/../../x", "/etc", "/tmp/guest", "x\0y", "outside", "outside/sub"]
QEMU_MISSING = shutil.which("qemu-system-x86_64") is None or shutil.which("qemu-img") is None
REPO_GUEST = Path(__file__).resolve().parents[2] / "build" / "guest"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """An image store with one image (``fw``, empty files) and a symlink leaving the store."""
    s = tmp_path / "images"
    (s / "fw").mkdir(parents=True)
    (s / "team" / "web").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "vmlinuz").write_bytes(b"not yours")
    (outside / "initramfs.cpio.gz").write_bytes(b"not yours")
    (s / "outside").symlink_to(outside)  # a name inside the store that leads out of it
    (s / "inner").symlink_to(s / "fw")  # a link that stays inside is fine
    return s


# ---------------------------------------------------------------------------------- the shape (kernel)


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "x\0y", "a" * 1025])
def test_podspec_refuses_names_that_leave_any_store(name: str) -> None:
    with pytest.raises(SpecError, match=r"^vmfence\.io/image: ") as e:
        parse_image("vmfence.io/image", name)
    assert "\0" not in str(e.value)


@pytest.mark.parametrize("name", ["debian-12", "team/web", "a..b", "./x"])
def test_podspec_accepts_names_inside_a_store(name: str) -> None:
    assert parse_image("vmfence.io/image", name) == name


# ---------------------------------------------------------------------------------- resolution (agent)


def test_resolution_stays_inside_the_store(store: Path) -> None:
    root = os.path.realpath(store)
    assert resolve_image(str(store), "fw") == os.path.join(root, "fw")
    assert resolve_image(str(store), "team/web") == os.path.join(root, "team", "web")
    assert resolve_image(str(store), "inner") == os.path.join(root, "fw")
    for name in HOSTILE:
        with pytest.raises(ImageError, match=r"^spec\.image: "):
            resolve_image(str(store), name)
    with pytest.raises(ImageError, match="outside the image store"):
        resolve_image(str(store), ".")
    with pytest.raises(ImageError, match="no image store"):
        resolve_image("", "fw")


def test_files_of_an_image_may_not_link_out(store: Path, tmp_path: Path) -> None:
    img = store / "sneaky"
    img.mkdir()
    (img / "vmlinuz").symlink_to(tmp_path / "outside" / "vmlinuz")
    (img / "initramfs.cpio.gz").write_bytes(b"")
    check_in_store(str(store), str(store / "fw"), (str(store / "fw" / "vmlinuz"),))
    with pytest.raises(ImageError, match="outside the image store"):
        check_in_store(str(store), str(img), (str(img / "vmlinuz"), str(img / "initramfs.cpio.gz")))


async def test_sim_driver_with_a_store_refuses_an_image_outside(store: Path, tmp_path: Path) -> None:
    drv = SimDriver(state_dir=str(tmp_path / "sim"), image_store=str(store))
    await drv.open()
    with pytest.raises(ImageError):
        await drv.create(VMSpec(vm_id="v-1", image=str(store / "outside")))
    assert drv.all_vms() == []
    assert (await drv.create(VMSpec(vm_id="v-2", image=str(store / "fw")))).state == "running"


# ---------------------------------------------------------------------------------- the agent, sim driver


def is_result(cid: str) -> Callable[[object], bool]:
    return lambda i: isinstance(i, CommandResult) and i.command_id == cid


async def test_agent_answers_failed_for_an_image_outside_the_store_sim(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig], store: Path
) -> None:
    cfg = make_config(image_dir=str(store))
    driver = SimDriver(state_dir=cfg.runtime_dir, image_store=cfg.images)
    f = fence(1)
    async with Agent(cfg, driver=driver):
        for i, name in enumerate(HOSTILE):
            for op in ("create", "wake"):
                c = command(op, f"bad-{op}-{i}", f, spec=Spec(image=name), snapshot="/nonexistent.snap")
                await send(nc, c)
                r = await reports.wait(is_result(c.id))
                assert isinstance(r, CommandResult) and r.outcome == "failed", (name, r)
                assert r.error is not None and r.error.startswith("invalid spec: spec.image: "), r.error
                assert "\0" not in r.error
        # the runtime was never asked to create or restore anything
        assert [op for op in driver.history if op.op in ("create", "restore")] == []
        ok = command("create", "good-1", f, spec=Spec(image="team/web"))
        await send(nc, ok)
        r = await reports.wait(is_result(ok.id))
        assert isinstance(r, CommandResult) and r.outcome == "ok", r


# ---------------------------------------------------------------------------------- the agent, qemu driver


@pytest.fixture
def qemu_leftovers(tmp_path: Path) -> Iterator[None]:
    yield
    for pidfile in glob.glob(str(tmp_path / "**" / "qemu.pid"), recursive=True):
        with contextlib.suppress(OSError, ValueError):
            pid = int(Path(pidfile).read_text().strip())
            if pidfile.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


@pytest.mark.qemu
@pytest.mark.skipif(QEMU_MISSING, reason="qemu-system-x86_64 / qemu-img not installed")
async def test_agent_answers_failed_for_an_image_outside_the_store_qemu(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig], store: Path, tmp_path: Path,
    qemu_leftovers: None,
) -> None:
    # a store whose image files link out: the agent's resolution passes (the directory is inside),
    # the driver's check of what QEMU would open refuses it
    sneaky = store / "sneaky"
    sneaky.mkdir()
    (sneaky / "vmlinuz").symlink_to(tmp_path / "outside" / "vmlinuz")
    (sneaky / "initramfs.cpio.gz").symlink_to(tmp_path / "outside" / "initramfs.cpio.gz")
    cfg = make_config(runtime="qemu", accel="tcg", vnc_range=None, image_dir=str(store))
    f = fence(1)
    async with Agent(cfg) as agent:
        assert isinstance(agent.driver, QemuDriver)
        vms = Path(agent.driver.vms_dir)
        for i, name in enumerate([*HOSTILE, "sneaky"]):
            c = command("create", f"q-bad-{i}", f, spec=Spec(image=name))
            await send(nc, c)
            r = await reports.wait(is_result(c.id), 60)
            assert isinstance(r, CommandResult) and r.outcome == "failed", (name, r)
            assert r.error is not None and "spec.image: " in r.error, r.error
            assert not (vms / f"q-bad-{i}").exists()  # nothing was made for it, no QEMU started
        assert glob.glob(str(vms / "*" / "qemu.pid")) == []


@pytest.mark.qemu
@pytest.mark.skipif(QEMU_MISSING, reason="qemu-system-x86_64 / qemu-img not installed")
@pytest.mark.skipif(not (REPO_GUEST / "vmlinuz").is_file(), reason="guest image not built (make guest-image)")
async def test_qemu_driver_boots_an_image_from_the_store_only(
    store: Path, tmp_path: Path, qemu_leftovers: None
) -> None:
    guest = store / "guest"
    guest.mkdir()
    for f in ("vmlinuz", "initramfs.cpio.gz"):
        shutil.copyfile(REPO_GUEST / f, guest / f)
    drv = QemuDriver(state_dir=str(tmp_path / "state"), accel="tcg", image_store=str(store), reconcile_interval=0)
    await drv.open()
    try:
        with pytest.raises(ImageError):  # the same kernel, outside the store
            await drv.create(VMSpec(vm_id="outside", memory_mib=128, image=str(REPO_GUEST)))
        assert drv.vm_dir("outside") not in glob.glob(str(Path(drv.vms_dir) / "*"))
        info = await drv.create(VMSpec(vm_id="inside", memory_mib=128, image=str(guest)))
        assert info.state == "running" and info.pid is not None
        await drv.remove("inside")
    finally:
        await drv.close()
