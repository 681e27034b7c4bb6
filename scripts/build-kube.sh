#!/usr/bin/env bash
# Builds the real control plane (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager) from the Go module proxy into .venv/kube/bin.
# Pinned by deploy/kube/{kubernetes,etcd}/go.mod; a second run does nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${VMFENCE_KUBE_BIN:-$ROOT/.venv/kube/bin}"
K8S_VERSION="$(awk '/^require k8s.io\/kubernetes /{print $3}' "$ROOT/deploy/kube/kubernetes/go.mod")"
ETCD_VERSION="$(awk '/^require go.etcd.io\/etcd\/server\/v3 /{print $3}' "$ROOT/deploy/kube/etcd/go.mod")"
STAMP="$OUT/.versions"
WANT="kubernetes=$K8S_VERSION etcd=$ETCD_VERSION"
# one line saying why the last build failed, beside bin/; the real-control-plane tests report it
# (tests/kube_real skip with it, and fail with it under CI); removed by a build that succeeds
ERROR_FILE="$(dirname "$OUT")/build-error"
fail() {
  mkdir -p "$(dirname "$OUT")"
  echo "$1" > "$ERROR_FILE"
  echo "make kube: $1" >&2
  exit 2
}
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
   && [[ -x "$OUT/etcd" && -x "$OUT/kube-apiserver" && -x "$OUT/kube-scheduler" && -x "$OUT/kube-controller-manager" ]]; then
  rm -f "$ERROR_FILE"
  exit 0
fi
command -v go >/dev/null || fail "no 'go' command on PATH (Go 1.25 or newer is needed)"
mkdir -p "$OUT"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
LDFLAGS="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
build() {  # dir, package, output name
  local dir="$1" pkg="$2" name="$3"
  echo "make kube: building $name ($pkg)" >&2
  local errlog
  errlog="$(mktemp)"
  if ! (cd "$ROOT/deploy/kube/$dir" && go build -trimpath -ldflags "$4" -o "$OUT/$name.tmp" "$pkg") 2>"$errlog"; then
    cat "$errlog" >&2
    # the first line naming a module the proxy or the checksum database refused, else go's first error
    local why
    why="$(grep -m1 -E 'reading https?://|: (410 Gone|404 Not Found|403 Forbidden)|verifying .*: |module .* not found|dial tcp|SECURITY ERROR' "$errlog" \
           || grep -m1 -v '^#' "$errlog" || echo "go build exited non-zero")"
    rm -f "$errlog"
    fail "could not build $name from $pkg: $why"
  fi
  cat "$errlog" >&2
  rm -f "$errlog"
  mv "$OUT/$name.tmp" "$OUT/$name"
}
build etcd go.etcd.io/etcd/server/v3 etcd "-s -w"
for c in kube-apiserver kube-scheduler kube-controller-manager; do
  build kubernetes "k8s.io/kubernetes/cmd/$c" "$c" "$LDFLAGS"
done
echo "$WANT" > "$STAMP"
rm -f "$ERROR_FILE"
