#!/usr/bin/env bash
# Build the vmfence guest image: a Debian kernel (vmlinuz) + a busybox initramfs.
#
#   scripts/build-guest-image.sh [OUTDIR]        (default: build/guest)
#
# Cached: if OUTDIR/vmlinuz and OUTDIR/initramfs.cpio.gz exist, nothing is done
# (set FORCE=1 to rebuild). Needs apt-get (Debian packages), dpkg-deb and gzip.
#
# The guest:
#   - mounts proc/sys/dev, loads the NIC driver (e1000 + virtio-net modules packed from the .deb),
#   - configures eth0 from the kernel command line (vmfence.ip=ADDR/PREFIX vmfence.gw=GATEWAY: the
#     agent's address pool on its bridge), else as 10.0.2.15/24 via 10.0.2.2 (QEMU user networking),
#   - writes a random token to /tmp/token (lives only in guest RAM),
#   - serves HTTP on port 8080 (busybox httpd): GET /token returns the token, GET / returns "ok",
#   - prints "VMFENCE-READY <token>" on the serial console (ttyS0) once the server is up,
#   - then runs a shell on the serial console (vmfence console).
# The driver boots it with: -kernel vmlinuz -initrd initramfs.cpio.gz -append "console=ttyS0 quiet [vmfence.ip=.. vmfence.gw=..]"
# GUEST_VERSION in OUTDIR stamps which revision of this script built the image (see below).
set -euo pipefail

OUTDIR="${1:-build/guest}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"

# Bump GUEST_VERSION whenever the guest's init or contents change: an image built by an older
# script (no stamp, or another number) is rebuilt instead of being served from the cache.
GUEST_VERSION=3
if [[ -z "${FORCE:-}" && -s "$OUTDIR/vmlinuz" && -s "$OUTDIR/initramfs.cpio.gz" \
      && "$(cat "$OUTDIR/GUEST_VERSION" 2>/dev/null)" == "$GUEST_VERSION" ]]; then
    echo "guest image cached in $OUTDIR"
    exit 0
fi

WORK="$OUTDIR/.work"
rm -rf "$WORK"
mkdir -p "$WORK/debs" "$WORK/kernel" "$WORK/busybox" "$WORK/root"
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT

log() { echo "[build-guest-image] $*" >&2; }

# --- which kernel package does linux-image-amd64 depend on? ---------------------------------------
kpkg_of_meta() {
    apt-cache depends linux-image-amd64 2>/dev/null \
        | awk '/Depends: linux-image-[0-9].*-amd64$/ {print $2; exit}'
}
KPKG="$(kpkg_of_meta || true)"
if [[ -z "$KPKG" ]]; then
    log "apt lists missing or stale: running apt-get update"
    apt-get update -qq >&2 || true
    KPKG="$(kpkg_of_meta || true)"
fi
[[ -n "$KPKG" ]] || { log "cannot resolve linux-image-amd64's kernel package"; exit 1; }
log "kernel package: $KPKG"

cd "$WORK/debs"
# apt-get download drops privileges to _apt when it can; the work dir must be writable for it.
chmod 777 "$WORK/debs" 2>/dev/null || true
apt-get download -q "$KPKG" busybox-static >&2
KDEB="$(ls "$WORK"/debs/linux-image-*.deb | head -n1)"
BDEB="$(ls "$WORK"/debs/busybox-static_*.deb | head -n1)"
dpkg-deb -x "$KDEB" "$WORK/kernel"
dpkg-deb -x "$BDEB" "$WORK/busybox"

VMLINUZ="$(ls "$WORK"/kernel/boot/vmlinuz-* | head -n1)"
KVER="$(basename "$VMLINUZ" | sed 's/^vmlinuz-//')"
MODDIR="$WORK/kernel/lib/modules/$KVER"
BUSYBOX="$WORK/busybox/bin/busybox"
[[ -x "$BUSYBOX" ]] || { log "busybox not found in $BDEB"; exit 1; }
log "kernel $KVER"

# --- initramfs tree --------------------------------------------------------------------------------
ROOT="$WORK/root"
mkdir -p "$ROOT"/{bin,sbin,dev,proc,sys,tmp,www,etc,lib/modules}
cp "$BUSYBOX" "$ROOT/bin/busybox"

# NIC drivers. Debian builds them as modules; copy the ones we may need, in load order, and
# decompress them if the kernel package ships them compressed.
MODS=(
    drivers/net/ethernet/intel/e1000/e1000
    drivers/virtio/virtio_ring
    drivers/virtio/virtio
    drivers/virtio/virtio_pci_modern_dev
    drivers/virtio/virtio_pci_legacy_dev
    drivers/virtio/virtio_pci
    net/core/failover
    drivers/net/net_failover
    drivers/net/virtio_net
)
: > "$ROOT/etc/modules"
for m in "${MODS[@]}"; do
    base="$(basename "$m")"
    for ext in ko ko.xz ko.zst ko.gz; do
        src="$MODDIR/kernel/$m.$ext"
        [[ -f "$src" ]] || continue
        case "$ext" in
            ko) cp "$src" "$ROOT/lib/modules/$base.ko" ;;
            ko.xz) xz -dc "$src" > "$ROOT/lib/modules/$base.ko" ;;
            ko.zst) zstd -dcq "$src" > "$ROOT/lib/modules/$base.ko" ;;
            ko.gz) gzip -dc "$src" > "$ROOT/lib/modules/$base.ko" ;;
        esac
        echo "$base" >> "$ROOT/etc/modules"
        break
    done
done
log "modules packed: $(tr '\n' ' ' < "$ROOT/etc/modules")"

cat > "$ROOT/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mount -t tmpfs tmpfs /tmp
for m in $(cat /etc/modules); do
    insmod /lib/modules/$m.ko || echo "insmod $m failed" > /dev/console
done
ip link set lo up
i=0
while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
[ -e /sys/class/net/eth0 ] || { echo "no eth0:"; ls /sys/class/net; dmesg | tail -20; } > /dev/console
# The address: vmfence.ip=ADDR/PREFIX and vmfence.gw=GATEWAY on the kernel command line (the
# agent's pool on its bridge); without them QEMU user-mode networking's 10.0.2.15 via 10.0.2.2.
addr=10.0.2.15/24
gw=10.0.2.2
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        vmfence.ip=*) addr="${arg#vmfence.ip=}" ;;
        vmfence.gw=*) gw="${arg#vmfence.gw=}" ;;
    esac
done
ip addr add "$addr" dev eth0
ip link set eth0 up
[ -n "$gw" ] && [ "$gw" != none ] && ip route add default via "$gw"
echo "VMFENCE-NET $addr via $gw" > /dev/console
# A token that only exists in guest RAM: a hibernate/wake test reads it before and after.
token=$(head -c 16 /dev/urandom | md5sum | cut -c1-32)
echo "$token" > /tmp/token
echo ok > /www/index.html
ln -s /tmp/token /www/token
httpd -p 8080 -h /www
echo "VMFENCE-READY $token" > /dev/console
# a shell on the serial console for `vmfence console` (the agent lets in only the VM's operators)
while true; do setsid sh -c 'exec sh </dev/ttyS0 >/dev/ttyS0 2>&1'; sleep 1; done &
while true; do sleep 3600; done
EOF
chmod 755 "$ROOT/init"

# --- pack ------------------------------------------------------------------------------------------
pack_cpio() {
    # newc archive of the current directory on stdout: cpio if present, else busybox's cpio, else python.
    if command -v cpio >/dev/null 2>&1; then
        find . | LC_ALL=C sort | cpio -o -H newc --quiet
    elif "$BUSYBOX" cpio --help 2>&1 | grep -q -- '-o'; then
        find . | LC_ALL=C sort | "$BUSYBOX" cpio -o -H newc
    else
        python3 - <<'PY'
import os, stat, sys
out = sys.stdout.buffer
ino = 1
def entry(name, st, data):
    global ino
    hdr = "070701" + "".join("%08x" % v for v in (
        ino, st.st_mode, 0, 0, 1, int(st.st_mtime), len(data), 0, 0, 0, 0, len(name) + 1, 0))
    ino += 1
    b = hdr.encode() + name.encode() + b"\0"
    b += b"\0" * (-len(b) % 4)
    out.write(b + data + b"\0" * (-len(data) % 4))
for dirpath, dirnames, filenames in os.walk("."):
    dirnames.sort()
    for n in [dirpath] + [os.path.join(dirpath, f) for f in sorted(filenames)] + \
             [os.path.join(dirpath, d) for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
        st = os.lstat(n)
        name = os.path.normpath(n)
        if stat.S_ISLNK(st.st_mode):
            data = os.readlink(n).encode()
        elif stat.S_ISREG(st.st_mode):
            data = open(n, "rb").read()
        else:
            data = b""
        entry(name, st, data)
class Z: st_mode = 0; st_mtime = 0
entry("TRAILER!!!", Z, b"")
PY
    fi
}
(cd "$ROOT" && pack_cpio) | gzip -9 > "$WORK/initramfs.cpio.gz"

cp "$VMLINUZ" "$WORK/vmlinuz"
mv "$WORK/vmlinuz" "$OUTDIR/vmlinuz"
mv "$WORK/initramfs.cpio.gz" "$OUTDIR/initramfs.cpio.gz"
echo "$KVER" > "$OUTDIR/KERNEL_VERSION"
echo "$GUEST_VERSION" > "$OUTDIR/GUEST_VERSION"
log "done: $OUTDIR/vmlinuz ($(stat -c %s "$OUTDIR/vmlinuz") bytes), initramfs.cpio.gz ($(stat -c %s "$OUTDIR/initramfs.cpio.gz") bytes)"
