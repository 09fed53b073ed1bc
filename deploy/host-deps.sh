#!/usr/bin/env bash
# Install the Debian packages the broker and its tests use on this host (idempotent).
#   bubblewrap       local backend: sandboxes as execd processes in their own namespaces
#   slirp4netns      local backend: the egress uplink of a sandbox's network namespace
#   iptables         local backend: egress allow-lists inside a sandbox's network namespace
#   iproute2         tests: a "remote" server in a network namespace of the test's own
#   git              patch extraction and grading tests
#   chromium         end-to-end tests of the admin UI (a real headless browser)
#   fonts-dejavu-core  readable screenshots
# The local Kubernetes cluster installs its own packages (deploy/localcluster/up.sh).
set -euo pipefail
want=(bubblewrap slirp4netns iptables iproute2 git chromium fonts-dejavu-core)
missing=()
for p in "${want[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "host-deps: missing packages ${missing[*]}; run: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "host-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=900 update -qq
  apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
