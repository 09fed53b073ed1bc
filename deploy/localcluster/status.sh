#!/usr/bin/env bash
# Show the local cluster's processes (from the recorded PIDs) and node readiness.
# Exit 0 when every component runs and the API answers, 1 otherwise.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
rc=0
for name in etcd kube-apiserver kube-controller-manager kube-scheduler kwok containerd kubelet \
            kube-network-policies; do
  pf="$STATE/pids/$name.pid"; state="stopped"
  if [[ -s "$pf" ]]; then
    read -r pid exe < "$pf"
    if [[ -d /proc/$pid && "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" == "$(readlink -f "$exe")" ]]; then
      state="running pid $pid, rss $(( $(awk '/VmRSS/{print $2}' "/proc/$pid/status") / 1024 )) MB"
    else
      state="dead (stale pid $pid)"
    fi
  fi
  [[ "$state" == running* ]] || rc=1
  printf '%-24s %s\n' "$name" "$state"
done
# the rules that steer the real node's pod connections to kube-network-policies (up.sh)
hooks=()
for hook in INPUT FORWARD; do
  iptables -w 5 -C "$hook" -i "$BRIDGE_NAME" -j "$NETPOL_CHAIN" 2>/dev/null && hooks+=("$hook")
done
if (( ${#hooks[@]} == 2 )); then
  echo "netpol steering: $BRIDGE_NAME new flows (INPUT, FORWARD) -> NFQUEUE $KNP_QUEUE_ID (bypass)"
else
  echo "netpol steering: missing (${hooks[*]:-no hook}) - NetworkPolicy is not enforced"; rc=1
fi
echo "kubeconfig: $KUBECONFIG_PATH"
if [[ -x "$K8S_BIN/kubectl" ]] && "$K8S_BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" get --raw /readyz >/dev/null 2>&1; then
  "$K8S_BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" get nodes --no-headers \
    -o custom-columns='KIND:.metadata.labels.sandman\.io/node-kind,READY:.status.conditions[?(@.type=="Ready")].status' \
    | sort | uniq -c | awk '{printf "nodes: %s %s Ready=%s\n", $1, $2, $3}'
  pods="$("$K8S_BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" get pods -A --no-headers 2>/dev/null | wc -l)"
  echo "pods: $pods"
else
  echo "API server: not answering"; rc=1
fi
exit $rc
