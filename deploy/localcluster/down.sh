#!/usr/bin/env bash
# Stop the Sandman local cluster: only the processes up.sh started (by recorded
# PID, checked against the recorded binary), after removing the pod sandboxes
# the real node created. Keeps etcd data, PKI and the build cache, so the next
# up.sh is fast. `down.sh --purge` also deletes the state directory.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PIDS="$STATE/pids"
PURGE=0; [[ "${1:-}" == "--purge" ]] && PURGE=1
[[ -d "$STATE" ]] || { log "no state at $STATE: nothing to stop"; exit 0; }
exec 9>"$STATE/lock"
flock -w 600 9 || die "another up.sh/down.sh holds $STATE/lock"

pid_of() { # NAME -> pid if alive and running the recorded binary
  local pf="$PIDS/$1.pid" pid exe
  [[ -s "$pf" ]] || return 1
  read -r pid exe < "$pf"
  [[ -n "$pid" && -d /proc/$pid ]] || return 1
  [[ "$(readlink -f /proc/$pid/exe 2>/dev/null)" == "$(readlink -f "$exe")" ]] || return 1
  echo "$pid"
}

stop() { # NAME [TIMEOUT]
  local name="$1" timeout="${2:-20}" pid
  if pid="$(pid_of "$name")"; then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + timeout))
    while [[ -d /proc/$pid ]] && (( SECONDS < deadline )); do sleep 0.2; done
    if [[ -d /proc/$pid ]]; then log "$name did not exit, SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; sleep 0.5; fi
  fi
  rm -f "$PIDS/$name.pid"
}

# 1. kubelet first, so it does not restart what we tear down; the policy engine with it,
#    then its steering rules (they only reference our bridge and our queue)
stop kubelet
stop kube-network-policies
for hook in INPUT FORWARD; do
  while iptables -w 5 -D "$hook" -i "$BRIDGE_NAME" -j "$NETPOL_CHAIN" 2>/dev/null; do :; done
done
if iptables -w 5 -F "$NETPOL_CHAIN" 2>/dev/null; then
  iptables -w 5 -X "$NETPOL_CHAIN" 2>/dev/null || true
fi

# 2. pod sandboxes on the real node (CRI stop = CNI DEL, then remove)
if pid_of containerd >/dev/null; then
  CRICTL=("$CRICTL_BIN/crictl" --runtime-endpoint "unix://$CTRD_SOCK" --timeout 30s)
  if [[ -x "${CRICTL[0]}" ]]; then
    pods="$("${CRICTL[@]}" pods -q 2>/dev/null || true)"
    if [[ -n "$pods" ]]; then
      log "removing $(wc -l <<<"$pods") pod sandbox(es)"
      for p in $pods; do "${CRICTL[@]}" stopp "$p" >/dev/null 2>&1 || true; done
      for p in $pods; do "${CRICTL[@]}" rmp -f "$p" >/dev/null 2>&1 || true; done
    fi
  fi
fi
stop containerd 30

# 3. control plane, reverse start order
stop kwok
stop kube-scheduler
stop kube-controller-manager
stop kube-apiserver 30
stop etcd 30
stop registry

# 4. leftovers of our own containers: shims whose cmdline names our containerd socket/state
for p in $(pgrep -f containerd-shim-runc-v2 || true); do
  cmdline="$(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null || true)"
  if [[ "$cmdline" == *"$CTRD_SOCK"* ]]; then
    log "killing leftover shim $p"; kill -KILL "$p" 2>/dev/null || true
  fi
done
# mounts under our state dir (container rootfs, pod volumes), deepest first
mounts="$(grep -o " $STATE/[^ ]*" /proc/self/mounts 2>/dev/null || true)"
for m in $(sort -r <<<"$mounts"); do
  umount -l "$m" 2>/dev/null || true
done

if [[ $PURGE = 1 ]]; then
  log "purging $STATE"
  ip link del "$BRIDGE_NAME" 2>/dev/null || true
  if [[ "$CGROUP_ROOT" != "/" ]]; then   # only our own cgroup root, deepest first, only if empty
    for h in /sys/fs/cgroup/*/; do
      [[ -d "$h${CGROUP_ROOT#/}" ]] && find "$h${CGROUP_ROOT#/}" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
  fi
  rm -rf "$STATE"
fi
log "cluster stopped"
