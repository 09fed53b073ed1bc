#!/usr/bin/env bash
# Start the Sandman local Kubernetes cluster (idempotent).
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler  (local processes)
#   kwok managing $KWOK_NODE_COUNT fake nodes (label type=kwok)
#   one real node: kubelet + containerd + runc + CNI bridge (label sandman.io/node-kind=real)
#   kube-network-policies enforcing NetworkPolicy for the real node's pods
# Builds what is missing from the cache first. Prints the admin kubeconfig path on stdout.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
T0=$SECONDS

mkdir -p "$STATE"/{logs,pids,run} "$STATE/cni/net.d" "$STATE/cni/ipam"
# one up/down at a time (several agents and pytest share the cluster); daemons get fd 9 closed
exec 9>"$STATE/lock"
flock -w 1800 9 || die "another up.sh/down.sh holds $STATE/lock"
LOGS="$STATE/logs"; PIDS="$STATE/pids"
KUBECTL="$K8S_BIN/kubectl"
kc() { "$KUBECTL" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

# ---------------------------------------------------------------- helpers
alive() { # NAME -> 0 if the recorded pid is alive and still runs the recorded binary
  local pf="$PIDS/$1.pid" pid exe
  [[ -s "$pf" ]] || return 1
  read -r pid exe < "$pf"
  [[ -n "$pid" && -d /proc/$pid ]] || return 1
  [[ "$(readlink -f /proc/$pid/exe 2>/dev/null)" == "$(readlink -f "$exe")" ]]
}

start() { # NAME BINARY ARGS...  (no-op when already running)
  local name="$1" bin="$2"; shift 2
  start_cmd "$name" "$bin" "$bin" "$@"
}

start_cmd() { # NAME BINARY COMMAND...  (COMMAND must end by exec'ing BINARY in the same pid)
  local name="$1" bin="$2"; shift 2
  if alive "$name"; then return 0; fi
  log "starting $name"
  echo "=== $(date -Is) start: $*" >> "$LOGS/$name.log"
  setsid nohup "$@" >> "$LOGS/$name.log" 2>&1 < /dev/null 9>&- &
  echo "$! $bin" > "$PIDS/$name.pid"
}

wait_for() { # DESCRIPTION TIMEOUT_S COMMAND...
  local what="$1" timeout="$2"; shift 2
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS > deadline )); then die "timed out after ${timeout}s waiting for $what (logs: $LOGS)"; fi
    sleep 0.5
  done
}

proc_running_or_die() { alive "$1" || { tail -30 "$LOGS/$1.log" >&2; die "$1 exited (log: $LOGS/$1.log)"; }; }

# ---------------------------------------------------------------- fast path
bridge_mac="$(printf '02:00:%02x:%02x:%02x:%02x' ${BRIDGE_IP//./ })"   # see "host network"
all_names=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok containerd kubelet
           kube-network-policies registry)
fast=1
for n in "${all_names[@]}"; do alive "$n" || fast=0; done
[[ "$(cat "/sys/class/net/$BRIDGE_NAME/address" 2>/dev/null)" == "$bridge_mac" ]] || fast=0
if [[ $fast = 1 && -x "$KUBECTL" ]] && \
   kc get --raw /readyz >/dev/null 2>&1 && \
   [[ "$(kc get node "$REAL_NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]; then
  log "cluster already up ($((SECONDS - T0))s)"
  echo "$KUBECONFIG_PATH"
  exit 0
fi

# ---------------------------------------------------------------- host packages
need_pkgs=()
for p in containerd runc containernetworking-plugins debootstrap openssl gcc libc6-dev iproute2 curl \
         iptables util-linux; do
  dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if (( ${#need_pkgs[@]} )); then
  log "installing Debian packages: ${need_pkgs[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

# ---------------------------------------------------------------- build (cached)
"$LC_DIR/build.sh" >&2
"$LC_DIR/pki.sh"
PKI="$STATE/pki"

# ---------------------------------------------------------------- host network: bridge
if ! ip link show "$BRIDGE_NAME" >/dev/null 2>&1; then
  log "creating bridge $BRIDGE_NAME ($BRIDGE_IP/24)"
  ip link add "$BRIDGE_NAME" type bridge
fi
addrs="$(ip -4 addr show dev "$BRIDGE_NAME")"   # no pipe into grep -q: SIGPIPE + pipefail
[[ "$addrs" == *"inet $BRIDGE_IP/"* ]] || ip addr add "$BRIDGE_IP/24" dev "$BRIDGE_NAME"
# Pin the bridge's MAC. Unset, it follows the lowest MAC among its ports, so it changes as
# pods come and go; pods keep the old gateway MAC in their ARP cache for up to ~30 s and
# their packets to $BRIDGE_IP are bridged to some other pod's veth instead (connections
# to the host time out). Locally administered, derived from the bridge IP.
[[ "$(cat "/sys/class/net/$BRIDGE_NAME/address")" == "$bridge_mac" ]] ||
  ip link set dev "$BRIDGE_NAME" address "$bridge_mac"
ip link set "$BRIDGE_NAME" up
# Stale pod interfaces: after a crash or a killed session the pods' network namespaces
# outlive containerd, keeping their veths on our bridge with addresses that a fresh
# host-local IPAM would hand out again (two interfaces answering for one pod IP). When no
# containerd shim is alive, no pod can be using them: remove every veth on our bridge.
if ! pgrep -f containerd-shim-runc-v2 >/dev/null 2>&1; then
  stale="$(ip -o link show master "$BRIDGE_NAME" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1)"
  for dev in $stale; do
    log "removing stale pod interface $dev from $BRIDGE_NAME"
    ip link delete "$dev" 2>/dev/null || true
  done
fi

# ---------------------------------------------------------------- containerd + CNI
cat > "$CNI_CONF_DIR/10-sandman.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "sandman",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE_NAME",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$STATE/cni/ipam",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$BRIDGE_IP"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
JSON
mkdir -p "$CTRD_ROOT" "$CTRD_STATE"
cat > "$STATE/containerd/config.toml" <<TOML
version = 2
root = "$CTRD_ROOT"
state = "$CTRD_STATE"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "$CTRD_SOCK"
[ttrpc]
  address = "$CTRD_SOCK.ttrpc"
[debug]
  level = "info"
[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  enable_selinux = false
  disable_apparmor = true
  # this VM lacks CAP_SYS_RESOURCE: negative oom_score_adj (pause: -998) would fail in runc
  restrict_oom_score_adj = true
  max_container_log_line_size = 65536
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = false
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "/usr/sbin/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN_DIR"
    conf_dir = "$CNI_CONF_DIR"
    max_conf_num = 1
  # Registry hosts as image refs name them -> where they are served (hosts.toml per host)
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$CTRD_CERTS"
TOML
# `localhost/<name>` images are served by the loopback registry (plain HTTP on 127.0.0.1).
mkdir -p "$CTRD_CERTS/localhost"
cat > "$CTRD_CERTS/localhost/hosts.toml" <<TOML
server = "$REGISTRY_URL"
[host."$REGISTRY_URL"]
  capabilities = ["pull", "resolve"]
TOML
start containerd /usr/bin/containerd --config "$STATE/containerd/config.toml"
CTR=(ctr --address "$CTRD_SOCK" -n k8s.io)
wait_for "containerd socket" 60 "${CTR[@]}" version

# ---------------------------------------------------------------- registry
# The reference OCI registry (CNCF distribution, built from the Go module proxy) on
# loopback. Task images are PUSHED to it and the real node PULLS them by digest, so a cold
# create that lacks its image pays a real pull (only the pause image is imported: the
# runtime needs it before any pull). Blobs persist in the state dir across up/down.
mkdir -p "$STATE/registry/data"
cat > "$STATE/registry/config.yml" <<YAML
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage:
  filesystem: {rootdirectory: $STATE/registry/data}
  delete: {enabled: true}
  maintenance: {uploadpurging: {enabled: false}}
http:
  addr: 127.0.0.1:$REGISTRY_PORT
  debug: {addr: 127.0.0.1:$REGISTRY_DEBUG_PORT}
YAML
start_cmd registry "$REGISTRY_BIN/registry" env OTEL_TRACES_EXPORTER=none \
  "$REGISTRY_BIN/registry" serve "$STATE/registry/config.yml"
wait_for "registry on $REGISTRY_URL" 60 curl -fsS "$REGISTRY_URL/v2/"
printf 'localhost=%s\n' "$REGISTRY_URL" > "$STATE/registries"   # SANDMAN_REGISTRIES for clients

# ---------------------------------------------------------------- images
# pause imported (and task images pushed) in the background while the control plane
# starts; waited for before kubelet. pushed.tsv keeps each tag's digest.
import_images() {
present="$("${CTR[@]}" images ls -q 2>/dev/null || true)"
while IFS=$'\t' read -r ref tarball; do
  [[ -n "$ref" ]] || continue
  marker="$STATE/run/pushed-$(basename "$tarball")"
  if [[ "$ref" != "$PAUSE_IMAGE" ]]; then
    [[ -e "$marker" ]] && curl -fsSI -o /dev/null -H "Accept: application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json" "$REGISTRY_URL/v2/$(registry_path "$ref")" && continue
    log "pushing $ref to $REGISTRY_URL"
    digest_ref="$("$CRANE_BIN/crane" push --insecure "$tarball" "$REGISTRY_HOSTPORT/${ref#localhost/}")"
    printf '%s\t%s\n' "$ref" "${digest_ref##*@}" >> "$STATE/registry/pushed.tsv"
    touch "$marker"
    continue
  fi
  # re-import when the ref is missing or was imported from another tarball
  marker="$STATE/run/imported-$(basename "$tarball")"
  if grep -qx "$ref" <<<"$present" && [[ -e "$marker" ]]; then continue; fi
  log "importing $ref"
  "${CTR[@]}" images import --snapshotter overlayfs "$tarball" >/dev/null
  touch "$marker"
done < "$IMAGES_CACHE/index.tsv"
}
registry_path() { # localhost/name:tag -> name/manifests/tag
  local rest="${1#localhost/}"; echo "${rest%:*}/manifests/${rest##*:}"
}
import_images > "$LOGS/image-import.log" 2>&1 &
IMPORT_PID=$!

# ---------------------------------------------------------------- etcd
start etcd "$ETCD_BIN/etcd" \
  --name sandman --data-dir "$STATE/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "sandman=http://127.0.0.1:$ETCD_PEER_PORT" \
  --quota-backend-bytes $((8 * 1024 * 1024 * 1024)) \
  --auto-compaction-mode periodic --auto-compaction-retention 5m \
  --snapshot-count 50000 --log-level warn
wait_for "etcd health" 60 curl -fsS "http://127.0.0.1:$ETCD_CLIENT_PORT/health"

# ---------------------------------------------------------------- kube-apiserver
# Loopback only: every client (kubectl, the kubelet, kwok, the controller-manager, the
# scheduler, kube-network-policies, the broker's hostNetwork pods) runs in the host's network
# namespace and uses 127.0.0.1; sandbox pods must never reach it. The advertised address
# stays the bridge's, because the `kubernetes` Endpoints may not hold a loopback address.
start kube-apiserver "$K8S_BIN/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --bind-address 127.0.0.1 --secure-port "$APISERVER_PORT" --advertise-address "$BRIDGE_IP" \
  --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
  --client-ca-file "$PKI/ca.crt" \
  --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
  --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
  --kubelet-preferred-address-types InternalIP,Hostname \
  --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --api-audiences https://kubernetes.default.svc.cluster.local \
  --service-cluster-ip-range "$SERVICE_CIDR" \
  --authorization-mode Node,RBAC \
  --allow-privileged=true \
  --max-requests-inflight 3000 --max-mutating-requests-inflight 1500 \
  --event-ttl 30m \
  --profiling=false \
  --v 1
wait_for "kube-apiserver /readyz" 120 curl -fsS --cacert "$PKI/ca.crt" "https://127.0.0.1:$APISERVER_PORT/readyz"
proc_running_or_die kube-apiserver

# ---------------------------------------------------------------- controller-manager, scheduler
start kube-controller-manager "$K8S_BIN/kube-controller-manager" \
  --kubeconfig "$STATE/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$STATE/controller-manager.kubeconfig" \
  --authorization-kubeconfig "$STATE/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$KCM_PORT" \
  --leader-elect=false \
  --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
  --use-service-account-credentials=true \
  --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
  --kube-api-qps 400 --kube-api-burst 800 \
  --concurrent-gc-syncs 50 --concurrent-namespace-syncs 20 \
  --concurrent-serviceaccount-token-syncs 10 \
  --controllers '*,-nodeipam' \
  --profiling=false --v 1

cat > "$STATE/scheduler-config.yaml" <<YAML
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $STATE/scheduler.kubeconfig
  qps: 400
  burst: 800
leaderElection:
  leaderElect: false
parallelism: 16
YAML
start kube-scheduler "$K8S_BIN/kube-scheduler" \
  --config "$STATE/scheduler-config.yaml" \
  --authentication-kubeconfig "$STATE/scheduler.kubeconfig" \
  --authorization-kubeconfig "$STATE/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" --profiling=false --v 1

# ---------------------------------------------------------------- kwok fake nodes
zones=(zone-a zone-b zone-c)
nodes_yaml="$STATE/run/kwok-nodes.yaml"; : > "$nodes_yaml"
for ((i = 0; i < KWOK_NODE_COUNT; i++)); do
  name="kwok-node-$i"; zone="${zones[$((i % 3))]}"
  cat >> "$nodes_yaml" <<YAML
---
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    sandman.io/node-kind: kwok
    kubernetes.io/hostname: $name
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    node-role.kubernetes.io/agent: ""
    topology.kubernetes.io/zone: $zone
    topology.kubernetes.io/region: local
spec:
  podCIDR: 10.$((128 + i / 64)).$(( (i % 64) * 4 )).0/22
  podCIDRs: [10.$((128 + i / 64)).$(( (i % 64) * 4 )).0/22]
  taints:
  - key: kwok.x-k8s.io/node
    value: fake
    effect: NoSchedule
YAML
done
# create only missing nodes (spec.podCIDR is immutable, so never re-apply)
existing="$(kc get nodes -l type=kwok -o name 2>/dev/null | sed 's#node/##' | sort)"
missing=0
for ((i = 0; i < KWOK_NODE_COUNT; i++)); do grep -qx "kwok-node-$i" <<<"$existing" || missing=1; done
if [[ $missing = 1 ]]; then
  log "creating kwok nodes"
  kc create -f "$nodes_yaml" 2>&1 | grep -v AlreadyExists >&2 || true
fi
# capacity lives in status (which a create ignores): patch nodes that do not have it yet
patch_pids=()
have="$(kc get nodes -l type=kwok -o jsonpath='{range .items[*]}{.metadata.name}={.status.capacity.pods}{"\n"}{end}')"
for ((i = 0; i < KWOK_NODE_COUNT; i++)); do
  cur="$(sed -n "s/^kwok-node-$i=//p" <<<"$have")"
  case "$cur" in *k) cur=$(( ${cur%k} * 1000 ));; *M) cur=$(( ${cur%M} * 1000000 ));; esac
  [[ "$cur" == "$KWOK_NODE_PODS" ]] && continue
  kc patch node "kwok-node-$i" --subresource=status --type=merge -p \
    "{\"status\":{\"capacity\":{\"cpu\":\"64\",\"memory\":\"256Gi\",\"pods\":\"$KWOK_NODE_PODS\",\"ephemeral-storage\":\"1Ti\"},\"allocatable\":{\"cpu\":\"64\",\"memory\":\"256Gi\",\"pods\":\"$KWOK_NODE_PODS\",\"ephemeral-storage\":\"1Ti\"}}}" >/dev/null &
  patch_pids+=($!)
done
for p in "${patch_pids[@]}"; do wait "$p"; done   # parallel: kubectl start-up dominates
start kwok "$KWOK_BIN/kwok" \
  --kubeconfig "$STATE/kwok.kubeconfig" \
  --config "$LC_DIR/kwok-stages.yaml" \
  --manage-nodes-with-label-selector type=kwok \
  --node-lease-duration-seconds 40 \
  --server-address "127.0.0.1:$KWOK_PORT" \
  --node-ip 127.0.0.1

# ---------------------------------------------------------------- kubelet (real node)
wait "$IMPORT_PID" || { cat "$LOGS/image-import.log" >&2; die "image import failed"; }
mkdir -p "$STATE/kubelet"
if [[ "$CGROUP_ROOT" != "/" ]]; then   # kubelet wants cgroupRoot to exist in every hierarchy
  for h in /sys/fs/cgroup/*/; do
    [[ -d "$h${CGROUP_ROOT#/}" ]] && continue
    mkdir -p "$h${CGROUP_ROOT#/}"
    if [[ -e "$h/cpuset.cpus" ]]; then   # cgroup v1 cpuset children start empty
      cat "$h/cpuset.cpus" > "$h${CGROUP_ROOT#/}/cpuset.cpus"
      cat "$h/cpuset.mems" > "$h${CGROUP_ROOT#/}/cpuset.mems"
    fi
  done
fi
cat > "$STATE/kubelet-config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $BRIDGE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $PKI/kubelet-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-serving.key
containerRuntimeEndpoint: unix://$CTRD_SOCK
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
failCgroupV1: false
failSwapOn: false
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
maxPods: 110
podCIDR: $POD_CIDR
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "2%"
  imagefs.available: "2%"
serializeImagePulls: false
kubeAPIQPS: 50
kubeAPIBurst: 100
YAML
start kubelet "$K8S_BIN/kubelet" \
  --config "$STATE/kubelet-config.yaml" \
  --kubeconfig "$STATE/kubelet.kubeconfig" \
  --root-dir "$STATE/kubelet" --cert-dir "$STATE/kubelet/pki" \
  --hostname-override "$REAL_NODE_NAME" --node-ip "$BRIDGE_IP" \
  --node-labels "sandman.io/node-kind=real,topology.kubernetes.io/zone=zone-real" \
  --v 1

# ---------------------------------------------------------------- NetworkPolicy enforcement
# kube-network-policies (host process for the real node) decides every new connection of
# the node's pods in userspace from the NetworkPolicies, through an NFQUEUE. Its own
# nftables table needs the nft `queue` expression (CONFIG_NFT_QUEUE), which this kernel
# lacks (its sync logs "no such file or directory" and creates nothing). The xtables
# NFQUEUE target is built in, so up.sh steers the connections instead: new flows that
# enter from our bridge (pod -> host, pod -> pod, pod -> anywhere) go to its queue.
# --queue-bypass: when it is not running they pass unchecked (no enforcement), nothing
# hangs. Host-originated traffic (kubelet probes, the broker reaching execd) and replies
# are never queued. Only our bridge's traffic is touched; down.sh removes the chain.
ipt() { iptables -w 5 "$@"; }
ipt -N "$NETPOL_CHAIN" 2>/dev/null || true
ipt -F "$NETPOL_CHAIN"
ipt -A "$NETPOL_CHAIN" -m conntrack --ctstate NEW \
  -j NFQUEUE --queue-num "$KNP_QUEUE_ID" --queue-bypass
for hook in INPUT FORWARD; do
  ipt -C "$hook" -i "$BRIDGE_NAME" -j "$NETPOL_CHAIN" 2>/dev/null ||
    ipt -I "$hook" -i "$BRIDGE_NAME" -j "$NETPOL_CHAIN"
done
# It only supports in-cluster config (token + CA at the fixed ServiceAccount paths): give
# it a ServiceAccount token, mounted over /run in a private mount namespace of its own.
KNP_DIR="$STATE/kube-network-policies"
if ! alive kube-network-policies; then
  mkdir -p "$KNP_DIR"
  kc apply -f - >/dev/null <<'YAML'
apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-network-policies, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: kube-network-policies}
rules:
- {apiGroups: [""], resources: [pods, namespaces], verbs: [list, watch]}
- {apiGroups: [networking.k8s.io], resources: [networkpolicies], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: kube-network-policies}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kube-network-policies}
subjects: [{kind: ServiceAccount, name: kube-network-policies, namespace: kube-system}]
YAML
  (umask 077; kc -n kube-system create token kube-network-policies --duration 8760h \
     > "$KNP_DIR/token")
  cp "$PKI/ca.crt" "$KNP_DIR/ca.crt"
fi
start_cmd kube-network-policies "$KNP_BIN/kube-network-policies" \
  env KUBERNETES_SERVICE_HOST=127.0.0.1 KUBERNETES_SERVICE_PORT="$APISERVER_PORT" \
  unshare --mount --propagation private /bin/sh -c '
    sa=/run/secrets/kubernetes.io/serviceaccount
    mount -n -t tmpfs -o size=1m,mode=755 sandman-knp /run && mkdir -p "$sa" &&
      cp "$0/token" "$0/ca.crt" "$sa/" && exec "$@"' "$KNP_DIR" \
  "$KNP_BIN/kube-network-policies" \
  --hostname-override "$REAL_NODE_NAME" \
  --nfqueue-id "$KNP_QUEUE_ID" \
  --metrics-bind-address "127.0.0.1:$KNP_METRICS_PORT" \
  --disable-nri \
  --netfilter-bug-1766-fix=false \
  --v 1

# ---------------------------------------------------------------- wait for readiness
node_ready() { [[ "$(kc get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]; }
kwok_ready() {
  local n; n="$(kc get nodes -l type=kwok -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -c True)"
  [[ "$n" -ge "$KWOK_NODE_COUNT" ]]
}
wait_for "kwok nodes Ready" 120 kwok_ready
for n in kube-controller-manager kube-scheduler kwok containerd kubelet kube-network-policies registry; do
  proc_running_or_die "$n"
done
wait_for "real node $REAL_NODE_NAME Ready" 180 node_ready "$REAL_NODE_NAME"
wait_for "default serviceaccount" 60 kc get serviceaccount default -n default

log "cluster up in $((SECONDS - T0))s; nodes:"
kc get nodes -L sandman.io/node-kind,topology.kubernetes.io/zone --no-headers 2>&1 | head -30 >&2
echo "$KUBECONFIG_PATH"
