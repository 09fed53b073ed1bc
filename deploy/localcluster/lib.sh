# shellcheck shell=bash
# Shared settings for the Sandman local cluster scripts (sourced, not executed).
set -euo pipefail

LC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$LC_DIR/../.." && pwd)"

# ---- versions (see docs/localcluster.md for what was tried) ----
K8S_VERSION="${SANDMAN_K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${SANDMAN_ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${SANDMAN_KWOK_VERSION:-v0.8.0}"
CRICTL_VERSION="${SANDMAN_CRICTL_VERSION:-v1.37.0}"

# ---- locations ----
CACHE_DIR="${SANDMAN_CACHE_DIR:-$HOME/.cache/sandman}"
STATE_ROOT="${SANDMAN_STATE_DIR:-$HOME/.local/state/sandman}"
STATE="$STATE_ROOT/cluster"
K8S_BIN="$CACHE_DIR/k8s-$K8S_VERSION/bin"
ETCD_BIN="$CACHE_DIR/etcd-$ETCD_VERSION/bin"
KWOK_BIN="$CACHE_DIR/kwok-$KWOK_VERSION/bin"
CRICTL_BIN="$CACHE_DIR/crictl-$CRICTL_VERSION/bin"
IMAGES_CACHE="$CACHE_DIR/images"
KUBECONFIG_PATH="$STATE/kubeconfig"

# ---- network ----
APISERVER_PORT="${SANDMAN_APISERVER_PORT:-16443}"
ETCD_CLIENT_PORT=12379
ETCD_PEER_PORT=12380
KCM_PORT=16257        # kube-controller-manager secure port
SCHED_PORT=16259      # kube-scheduler secure port
KUBELET_PORT=16250    # real kubelet API
KUBELET_HEALTHZ_PORT=16248
KWOK_PORT=16280       # kwok metrics/healthz
BRIDGE_NAME=sandman0
POD_CIDR=10.244.0.0/24
BRIDGE_IP=10.244.0.1
SERVICE_CIDR=10.96.0.0/16
REAL_NODE_NAME="${SANDMAN_REAL_NODE_NAME:-sandman-real-0}"
KWOK_NODE_COUNT="${SANDMAN_KWOK_NODES:-16}"
KWOK_NODE_PODS="${SANDMAN_KWOK_NODE_PODS:-1000}"

# ---- containerd (own instance, own paths, does not touch a system containerd) ----
CTRD_ROOT="$STATE/containerd/root"
CTRD_STATE="$STATE/containerd/state"
CTRD_SOCK="$STATE/containerd/containerd.sock"
CNI_CONF_DIR="$STATE/cni/net.d"
CNI_BIN_DIR="/usr/lib/cni"

PAUSE_IMAGE="localhost/sandman-pause:1"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
