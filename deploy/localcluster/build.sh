#!/usr/bin/env bash
# Build (or reuse from cache) everything the local cluster needs.
#   build.sh            # all: k8s etcd kwok crictl knp registry crane images
#   build.sh k8s etcd   # only some parts
#   build.sh versitygw  # the S3 server the tests run (not a cluster part: never in "all")
# Binaries land in ${SANDMAN_CACHE_DIR:-~/.cache/sandman}/<component>-<version>/bin,
# images in .../images/<name>-<hash>.tar. A part is rebuilt only when missing.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

export CGO_ENABLED=0 GOFLAGS=-trimpath
GOBUILD="$LC_DIR/gobuild"
TIMINGS="$CACHE_DIR/build-timings.log"
mkdir -p "$CACHE_DIR"

install_part() { # tmp-dir bin-dir: replace a part's binaries at once (never half a part)
  mkdir -p "$(dirname "$2")"; rm -rf "$2"; mv "$1" "$2"
}

record_time() { # name seconds
  printf '%s %s %ss host=%s\n' "$(date -Is)" "$1" "$2" "$(nproc)cpu" >> "$TIMINGS"
  log "built $1 in $2s"
}

build_k8s() {
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)
  local ok=1 b
  for b in "${bins[@]}"; do [[ -x "$K8S_BIN/$b" ]] || ok=0; done
  [[ $ok = 1 ]] && { log "k8s $K8S_VERSION cached in $K8S_BIN"; return; }
  local v="${K8S_VERSION#v}" major minor
  major="${v%%.*}"; minor="${v#*.}"; minor="${minor%%.*}"
  local now; now="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  local ld="-s -w"
  local p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=$now"
  done
  local tmp="$K8S_BIN.tmp.$$"; mkdir -p "$tmp"
  log "building kubernetes $K8S_VERSION (${bins[*]}) - cold this takes long on 2 cores"
  local t0=$SECONDS pkgs=()
  for b in "${bins[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  (cd "$GOBUILD/k8s" && go build -mod=mod -ldflags "$ld" -o "$tmp/" "${pkgs[@]}")
  install_part "$tmp" "$K8S_BIN"
  record_time "k8s-$K8S_VERSION" $((SECONDS - t0))
}

# go_part NAME VERSION BIN_DIR GOBUILD_SUBDIR LDFLAGS BINARY PACKAGE: one Go binary, unless cached
go_part() {
  local name=$1 version=$2 bin=$3 dir=$4 ldflags=$5 out=$6 pkg=$7
  [[ -x "$bin/$out" ]] && { log "$name $version cached"; return; }
  local tmp="$bin.tmp.$$"; mkdir -p "$tmp"
  log "building $name $version"
  local t0=$SECONDS
  (cd "$GOBUILD/$dir" && go build -mod=mod -ldflags "$ldflags" -o "$tmp/$out" "$pkg")
  install_part "$tmp" "$bin"
  record_time "$name-$version" $((SECONDS - t0))
}

build_etcd() {
  go_part etcd "$ETCD_VERSION" "$ETCD_BIN" etcd "-s -w" etcd go.etcd.io/etcd/server/v3
}

build_kwok() {
  go_part kwok "$KWOK_VERSION" "$KWOK_BIN" kwok \
    "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" kwok sigs.k8s.io/kwok/cmd/kwok
}

build_crictl() {
  go_part crictl "$CRICTL_VERSION" "$CRICTL_BIN" crictl \
    "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" \
    crictl sigs.k8s.io/cri-tools/cmd/crictl
}

build_knp() { # sigs.k8s.io/kube-network-policies: NetworkPolicy enforcement on the real node
  go_part kube-network-policies "$KNP_VERSION" "$KNP_BIN" knp "-s -w" \
    kube-network-policies sigs.k8s.io/kube-network-policies/cmd
}

build_registry() { # the registry the real node pulls task images from (see up.sh)
  go_part registry "$REGISTRY_VERSION" "$REGISTRY_BIN" registry \
    "-s -w -X github.com/distribution/distribution/v3/version.version=$REGISTRY_VERSION" \
    registry github.com/distribution/distribution/v3/cmd/registry
}

build_crane() {
  go_part crane "$CRANE_VERSION" "$CRANE_BIN" crane "-s -w" crane \
    github.com/google/go-containerregistry/cmd/crane
}

build_versitygw() { # an S3-compatible server (posix backend) for the S3 snapshot store tests
  go_part versitygw "$VERSITYGW_VERSION" "$VERSITYGW_BIN" versitygw \
    "-s -w -X main.Version=$VERSITYGW_VERSION" versitygw github.com/versity/versitygw/cmd/versitygw
}

build_images() {
  "$REPO_ROOT/deploy/images/build.sh"
}

parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(etcd kwok k8s crictl knp registry crane images)
for part in "${parts[@]}"; do
  case "$part" in
    k8s) build_k8s ;;
    etcd) build_etcd ;;
    kwok) build_kwok ;;
    crictl) build_crictl ;;
    knp) build_knp ;;
    registry) build_registry ;;
    crane) build_crane ;;
    versitygw) build_versitygw ;;
    images) build_images ;;
    *) die "unknown part $part (k8s|etcd|kwok|crictl|knp|registry|crane|versitygw|images)" ;;
  esac
done
