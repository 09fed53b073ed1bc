#!/usr/bin/env bash
# Generate the cluster PKI and kubeconfigs under $STATE/pki (idempotent: only
# missing files are created). Uses openssl only; ECDSA P-256 keys (fast to generate).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PKI="$STATE/pki"
mkdir -p "$PKI"; chmod 700 "$PKI"
cd "$PKI"

if [[ ! -s ca.crt ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.crt -days 3650 \
    -subj "/CN=sandman-local-ca" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
fi

# cert NAME CN O EXTKEYUSAGE [SANs]
cert() {
  local name="$1" cn="$2" org="$3" eku="$4" san="${5:-}"
  [[ -s "$name.crt" && -s "$name.key" ]] && return 0
  local subj="/CN=$cn"; [[ -n "$org" ]] && subj="/O=$org/CN=$cn"
  local ext; ext="$(mktemp)"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n "$san" ]] && echo "subjectAltName=$san"
  } > "$ext"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$name.key" -out "$name.csr" -subj "$subj" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
    -extfile "$ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$ext"
}

APISERVER_SANS="IP:127.0.0.1,IP:$BRIDGE_IP,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
cert apiserver kube-apiserver "" serverAuth "$APISERVER_SANS"
cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters clientAuth
cert admin kubernetes-admin system:masters clientAuth
cert controller-manager system:kube-controller-manager "" clientAuth
cert scheduler system:kube-scheduler "" clientAuth
cert kwok sandman-kwok system:masters clientAuth
cert kubelet "system:node:$REAL_NODE_NAME" system:nodes clientAuth
cert kubelet-serving "system:node:$REAL_NODE_NAME" system:nodes serverAuth \
  "IP:127.0.0.1,IP:$BRIDGE_IP,DNS:$REAL_NODE_NAME,DNS:localhost"

if [[ ! -s sa.key ]]; then
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out sa.key 2>/dev/null
  openssl pkey -in sa.key -pubout -out sa.pub 2>/dev/null
fi
chmod 600 ./*.key

# kubeconfig FILE USER CERTNAME
kubeconfig() {
  local file="$1" user="$2" c="$3"
  cat > "$file.tmp" <<KC
apiVersion: v1
kind: Config
clusters:
- name: sandman-local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 < ca.crt)
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 < "$c.crt")
    client-key-data: $(base64 -w0 < "$c.key")
contexts:
- name: sandman-local
  context:
    cluster: sandman-local
    user: $user
current-context: sandman-local
KC
  chmod 600 "$file.tmp"; mv "$file.tmp" "$file"
}
kubeconfig "$KUBECONFIG_PATH" kubernetes-admin admin
kubeconfig "$STATE/controller-manager.kubeconfig" system:kube-controller-manager controller-manager
kubeconfig "$STATE/scheduler.kubeconfig" system:kube-scheduler scheduler
kubeconfig "$STATE/kwok.kubeconfig" sandman-kwok kwok
kubeconfig "$STATE/kubelet.kubeconfig" "system:node:$REAL_NODE_NAME" kubelet
