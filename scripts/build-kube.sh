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
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
   && [[ -x "$OUT/etcd" && -x "$OUT/kube-apiserver" && -x "$OUT/kube-scheduler" && -x "$OUT/kube-controller-manager" ]]; then
  exit 0
fi
command -v go >/dev/null || { echo "make kube: no 'go' command on PATH (Go 1.25 or newer is needed)" >&2; exit 2; }
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
  if ! (cd "$ROOT/deploy/kube/$dir" && go build -trimpath -ldflags "$4" -o "$OUT/$name.tmp" "$pkg"); then
    echo "make kube: could not build $name from $pkg (see the go error above: a module the proxy refused is named there)" >&2
    exit 2
  fi
  mv "$OUT/$name.tmp" "$OUT/$name"
}
build etcd go.etcd.io/etcd/server/v3 etcd "-s -w"
for c in kube-apiserver kube-scheduler kube-controller-manager; do
  build kubernetes "k8s.io/kubernetes/cmd/$c" "$c" "$LDFLAGS"
done
echo "$WANT" > "$STAMP"
