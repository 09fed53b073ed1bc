#!/usr/bin/env bash
# Build (or reuse from cache) everything the local cluster needs.
#   build.sh            # all: k8s etcd kwok crictl knp images
#   build.sh k8s etcd   # only some parts
# Binaries land in ${SANDMAN_CACHE_DIR:-~/.cache/sandman}/<component>-<version>/bin,
# images in .../images/<name>-<hash>.tar. A part is rebuilt only when missing.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

export CGO_ENABLED=0 GOFLAGS=-trimpath
GOBUILD="$LC_DIR/gobuild"
TIMINGS="$CACHE_DIR/build-timings.log"
mkdir -p "$CACHE_DIR"

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
  mkdir -p "$(dirname "$K8S_BIN")"; rm -rf "$K8S_BIN"; mv "$tmp" "$K8S_BIN"
  record_time "k8s-$K8S_VERSION" $((SECONDS - t0))
}

build_etcd() {
  [[ -x "$ETCD_BIN/etcd" ]] && { log "etcd $ETCD_VERSION cached"; return; }
  local tmp="$ETCD_BIN.tmp.$$"; mkdir -p "$tmp"
  log "building etcd $ETCD_VERSION"
  local t0=$SECONDS
  (cd "$GOBUILD/etcd" && go build -mod=mod -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3)
  mkdir -p "$(dirname "$ETCD_BIN")"; rm -rf "$ETCD_BIN"; mv "$tmp" "$ETCD_BIN"
  record_time "etcd-$ETCD_VERSION" $((SECONDS - t0))
}

build_kwok() {
  [[ -x "$KWOK_BIN/kwok" ]] && { log "kwok $KWOK_VERSION cached"; return; }
  local tmp="$KWOK_BIN.tmp.$$"; mkdir -p "$tmp"
  log "building kwok $KWOK_VERSION"
  local t0=$SECONDS
  (cd "$GOBUILD/kwok" && go build -mod=mod \
     -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
     -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok)
  mkdir -p "$(dirname "$KWOK_BIN")"; rm -rf "$KWOK_BIN"; mv "$tmp" "$KWOK_BIN"
  record_time "kwok-$KWOK_VERSION" $((SECONDS - t0))
}

build_crictl() {
  [[ -x "$CRICTL_BIN/crictl" ]] && { log "crictl $CRICTL_VERSION cached"; return; }
  local tmp="$CRICTL_BIN.tmp.$$"; mkdir -p "$tmp"
  log "building crictl $CRICTL_VERSION"
  local t0=$SECONDS
  (cd "$GOBUILD/crictl" && go build -mod=mod \
     -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" \
     -o "$tmp/crictl" sigs.k8s.io/cri-tools/cmd/crictl)
  mkdir -p "$(dirname "$CRICTL_BIN")"; rm -rf "$CRICTL_BIN"; mv "$tmp" "$CRICTL_BIN"
  record_time "crictl-$CRICTL_VERSION" $((SECONDS - t0))
}

build_knp() { # sigs.k8s.io/kube-network-policies: NetworkPolicy enforcement on the real node
  [[ -x "$KNP_BIN/kube-network-policies" ]] && { log "kube-network-policies $KNP_VERSION cached"; return; }
  local tmp="$KNP_BIN.tmp.$$"; mkdir -p "$tmp"
  log "building kube-network-policies $KNP_VERSION"
  local t0=$SECONDS
  (cd "$GOBUILD/knp" && go build -mod=mod -ldflags "-s -w" \
     -o "$tmp/kube-network-policies" sigs.k8s.io/kube-network-policies/cmd)
  mkdir -p "$(dirname "$KNP_BIN")"; rm -rf "$KNP_BIN"; mv "$tmp" "$KNP_BIN"
  record_time "kube-network-policies-$KNP_VERSION" $((SECONDS - t0))
}

build_images() {
  "$REPO_ROOT/deploy/images/build.sh"
}

parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(etcd kwok k8s crictl knp images)
for part in "${parts[@]}"; do
  case "$part" in
    k8s) build_k8s ;;
    etcd) build_etcd ;;
    kwok) build_kwok ;;
    crictl) build_crictl ;;
    knp) build_knp ;;
    images) build_images ;;
    *) die "unknown part $part (k8s|etcd|kwok|crictl|knp|images)" ;;
  esac
done
