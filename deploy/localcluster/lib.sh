# shellcheck shell=bash
# Shared settings for the Sandman local cluster scripts (sourced, not executed).
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh" ""  # no log tag (and not the caller's $1)

LC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# ---- versions (see docs/localcluster.md for what was tried) ----
K8S_VERSION="${SANDMAN_K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${SANDMAN_ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${SANDMAN_KWOK_VERSION:-v0.8.0}"
CRICTL_VERSION="${SANDMAN_CRICTL_VERSION:-v1.37.0}"
KNP_VERSION=v0.8.0   # sigs.k8s.io/kube-network-policies; pinned in gobuild/knp/go.mod
REGISTRY_VERSION=v3.1.2  # CNCF distribution (the reference registry); gobuild/registry/go.mod
CRANE_VERSION=v0.22.1    # go-containerregistry crane (pushes the image tarballs); gobuild/crane
VERSITYGW_VERSION=v1.8.0 # S3 gateway the S3 snapshot store is tested against; gobuild/versitygw

# ---- locations ----
STATE="$STATE_ROOT/cluster"
K8S_BIN="$CACHE_DIR/k8s-$K8S_VERSION/bin"
ETCD_BIN="$CACHE_DIR/etcd-$ETCD_VERSION/bin"
KWOK_BIN="$CACHE_DIR/kwok-$KWOK_VERSION/bin"
CRICTL_BIN="$CACHE_DIR/crictl-$CRICTL_VERSION/bin"
KNP_BIN="$CACHE_DIR/kube-network-policies-$KNP_VERSION/bin"
REGISTRY_BIN="$CACHE_DIR/registry-$REGISTRY_VERSION/bin"
CRANE_BIN="$CACHE_DIR/crane-$CRANE_VERSION/bin"
VERSITYGW_BIN="$CACHE_DIR/versitygw-$VERSITYGW_VERSION/bin"
IMAGES_CACHE="$CACHE_DIR/images"
KUBECONFIG_PATH="$STATE/kubeconfig"

# ---- network ----
# SANDMAN_PORT_OFFSET, SANDMAN_BRIDGE and SANDMAN_POD_NET allow a second, independent
# instance next to the default one (used to test down/up without disturbing users).
PORT_OFFSET="${SANDMAN_PORT_OFFSET:-0}"
APISERVER_PORT="${SANDMAN_APISERVER_PORT:-$((16443 + PORT_OFFSET))}"
ETCD_CLIENT_PORT=$((12379 + PORT_OFFSET))
ETCD_PEER_PORT=$((12380 + PORT_OFFSET))
KCM_PORT=$((16257 + PORT_OFFSET))             # kube-controller-manager secure port
SCHED_PORT=$((16259 + PORT_OFFSET))           # kube-scheduler secure port
KUBELET_PORT=$((16250 + PORT_OFFSET))         # real kubelet API
KUBELET_HEALTHZ_PORT=$((16248 + PORT_OFFSET))
KWOK_PORT=$((16280 + PORT_OFFSET))            # kwok metrics/healthz
KNP_METRICS_PORT=$((16290 + PORT_OFFSET))     # kube-network-policies metrics
REGISTRY_PORT=$((16500 + PORT_OFFSET))        # the loopback OCI registry the node pulls from
REGISTRY_DEBUG_PORT=$((16501 + PORT_OFFSET))  # its health/metrics listener
KNP_QUEUE_ID=$((100 + PORT_OFFSET))           # its NFQUEUE number (one listener per queue)
BRIDGE_NAME="${SANDMAN_BRIDGE:-sandman0}"
POD_NET="${SANDMAN_POD_NET:-10.244.0}"        # first three octets of the real node's /24
POD_CIDR="$POD_NET.0/24"
BRIDGE_IP="$POD_NET.1"
SERVICE_CIDR=10.96.0.0/16
# kubelet cgroupRoot: give a second instance its own, or its kubelet would garbage
# collect the first one's pod cgroups under /kubepods
CGROUP_ROOT="${SANDMAN_CGROUP_ROOT:-/}"
# iptables chain that steers the real node's new pod connections to kube-network-policies
NETPOL_CHAIN="SANDMAN-NP-$BRIDGE_NAME"
REAL_NODE_NAME="${SANDMAN_REAL_NODE_NAME:-sandman-real-0}"
KWOK_NODE_COUNT="${SANDMAN_KWOK_NODES:-16}"
KWOK_NODE_PODS="${SANDMAN_KWOK_NODE_PODS:-1000}"

# ---- containerd (own instance, own paths, does not touch a system containerd) ----
CTRD_ROOT="$STATE/containerd/root"
CTRD_STATE="$STATE/containerd/state"
CTRD_SOCK="$STATE/containerd/containerd.sock"
CTRD_CERTS="$STATE/containerd/certs.d"
REGISTRY_HOSTPORT="127.0.0.1:$REGISTRY_PORT"
REGISTRY_URL="http://$REGISTRY_HOSTPORT"
CNI_CONF_DIR="$STATE/cni/net.d"
CNI_BIN_DIR="/usr/lib/cni"

PAUSE_IMAGE="localhost/sandman-pause:1"
