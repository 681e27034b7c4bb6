"""The image store: guest image names resolve only inside one configured directory.

A spec's ``image`` is a *name* (``debian-12``, ``team/web``) inside the agent's image store
(``--image-dir``). ``resolve_image`` is the real guard: a name whose shape is wrong (absolute, a
``..`` component, a NUL byte — ``shared.fence.podspec.image_name_problem``) or that resolves, through
symlinks, to anything outside the store is an ``ImageError`` naming the field, and nothing under
it is ever opened. A driver given an ``image_store`` checks again what it is about to hand QEMU
(``check_in_store``), the image directory's files included (``vmlinuz`` and ``initramfs.cpio.gz``
may be symlinks too).
"""

from __future__ import annotations

import os
import shutil

from shared.fence.podspec import image_name_problem

from .base import RuntimeFailure

IMAGE_FIELD = "spec.image"


class ImageError(RuntimeFailure):
    """An image name that names nothing inside the image store: an invalid spec, never retried."""


def _inside(root: str, path: str) -> bool:
    return path == root or os.path.commonpath([root, path]) == root


def resolve_image(store: str, name: str) -> str:
    """The real path of image ``name`` inside ``store``; ImageError if it is not one."""
    problem = image_name_problem(name)
    if problem is not None:
        raise ImageError(f"{IMAGE_FIELD}: {name.replace(chr(0), '?')!r} {problem}")
    if not store:
        raise ImageError(f"{IMAGE_FIELD}: {name!r}: this agent has no image store")
    root = os.path.realpath(store)
    path = os.path.realpath(os.path.join(root, name))
    if path == root or not _inside(root, path):
        raise ImageError(f"{IMAGE_FIELD}: {name!r} resolves outside the image store {root}")
    return path


def check_in_store(store: str, image: str, files: tuple[str, ...] = ()) -> None:
    """``image`` (a resolved directory) and each of ``files`` in it are inside ``store``, symlinks
    followed; ImageError if any leaves it."""
    if "\0" in image or any("\0" in f for f in files):
        raise ImageError(f"{IMAGE_FIELD}: contains a NUL byte")
    root = os.path.realpath(store)
    for p in (image, *files):
        real = os.path.realpath(p)
        if real == root or not _inside(root, real):
            raise ImageError(f"{IMAGE_FIELD}: {p} resolves outside the image store {root}")


GUEST_IMAGE_NAME = "guest"
GUEST_FILES = ("vmlinuz", "initramfs.cpio.gz", "GUEST_VERSION")


def install_guest_image(store: str, source: str) -> str | None:
    """Copy the project's guest image (``source``, e.g. build/guest) into ``store`` as ``guest``, so
    pods may name it (``vmfence.io/image: guest``); a copy whose files match is left alone. The
    image's directory, or None when ``source`` has no image."""
    if not all(os.path.isfile(os.path.join(source, f)) for f in GUEST_FILES[:2]):
        return None
    dest = os.path.join(store, GUEST_IMAGE_NAME)
    os.makedirs(dest, mode=0o700, exist_ok=True)
    for f in GUEST_FILES:
        src, dst = os.path.join(source, f), os.path.join(dest, f)
        if not os.path.isfile(src):
            continue
        if os.path.isfile(dst) and os.path.getsize(dst) == os.path.getsize(src) \
                and os.path.getmtime(dst) >= os.path.getmtime(src):
            continue
        shutil.copyfile(src, dst + ".part")
        os.replace(dst + ".part", dst)
    return dest
