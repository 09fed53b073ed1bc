#!/usr/bin/env bash
# Bring up a kind cluster with the broker's dev install (in-cluster PostgreSQL and Redis).
#
#   deploy/kind/up.sh          # create (or reuse) the cluster, build + load the image, apply dev
#   deploy/kind/up.sh --down   # delete the cluster
#
# Needs Docker (or Podman with KIND_EXPERIMENTAL_PROVIDER=podman), kind >= 0.20 and kubectl.
# It CANNOT run on the project's build machine (there is a docker client but no Docker
# engine there); that machine uses deploy/localcluster + the localcluster overlay instead,
# which the test suite exercises. The cluster tests run against this cluster too:
#   SANDMAN_TEST_KUBECONFIG=$(deploy/kind/up.sh) .venv/bin/pytest -m cluster
# (the localcluster-only deploy test then fails or skips: it needs the local cluster's
# real node and containerd).
#
# The dev overlay pulls postgres:17 and redis:7 from Docker Hub; the broker image is
# built here from the Containerfile and loaded into the nodes (no registry needed).
# Prints the kubeconfig path on stdout (last line), like deploy/localcluster/up.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh" kind
NAME="${SANDMAN_KIND_CLUSTER:-sandman}"
IMAGE="${SANDMAN_BROKER_IMAGE:-localhost/sandman-broker:dev}"
KUBECONFIG_OUT="${SANDMAN_KIND_KUBECONFIG:-$STATE_ROOT/kind/kubeconfig}"
DOCKER="${DOCKER:-docker}"

for tool in kind kubectl "$DOCKER"; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
"$DOCKER" info >/dev/null 2>&1 || die "no container engine answers '$DOCKER info' (kind needs a running Docker or Podman)"

if [[ "${1:-}" == "--down" ]]; then
  kind delete cluster --name "$NAME"
  exit 0
fi

mkdir -p "$(dirname "$KUBECONFIG_OUT")"
if ! kind get clusters 2>/dev/null | grep -qx "$NAME"; then
  log "creating cluster $NAME"
  kind create cluster --name "$NAME" --config "$REPO_ROOT/deploy/kind/cluster.yaml" --kubeconfig "$KUBECONFIG_OUT" --wait 120s >&2
else
  kind get kubeconfig --name "$NAME" > "$KUBECONFIG_OUT"
fi
export KUBECONFIG="$KUBECONFIG_OUT"

log "building $IMAGE from deploy/broker-image/Containerfile"
"$DOCKER" build -f "$REPO_ROOT/deploy/broker-image/Containerfile" -t "$IMAGE" "$REPO_ROOT" >&2
log "loading $IMAGE into the nodes"
kind load docker-image --name "$NAME" "$IMAGE" >&2

# Task images for sandboxes must be present on the nodes too (or in a registry they can
# pull from); load your own the same way: kind load docker-image --name sandman IMAGE

# The key behind every execd token is generated here, once per install, never committed.
kubectl create namespace sandman-system --dry-run=client -o yaml | kubectl apply -f - >&2
if ! kubectl -n sandman-system get secret sandman-secret-key >/dev/null 2>&1; then
  log "generating SANDMAN_SECRET_KEY into the Secret sandman-secret-key"
  kubectl -n sandman-system create secret generic sandman-secret-key \
    --from-literal=SANDMAN_SECRET_KEY="$(head -c 48 /dev/urandom | base64 | tr -d '\n')" >/dev/null
fi
log "applying the dev overlay"
kubectl apply --server-side -k "$REPO_ROOT/deploy/k8s/overlays/dev" >&2
kubectl -n sandman-system wait --for=condition=complete job/sandman-migrate --timeout=300s >&2
for d in sandman-redis sandman-worker sandman-web sandman-beat; do
  kubectl -n sandman-system rollout status "deployment/$d" --timeout=300s >&2
done
kubectl -n sandman-system rollout status statefulset/sandman-postgres --timeout=300s >&2
log "ready: kubectl -n sandman-system port-forward svc/sandman-web 8000:80  (admin UI)"
echo "$KUBECONFIG_OUT"
