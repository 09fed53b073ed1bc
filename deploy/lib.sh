# shellcheck shell=bash
# What every deploy script shares (sourced, not executed): strict mode, where the repository,
# the cache and the state live, and one log format. Sourced with one argument, the tag that
# prefixes the script's log lines:
#   source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh" kind      # "[12:00:00] kind: ..."
# Always pass it (an empty "" for none): without it bash hands this file the caller's $1.
# Paths follow the same SANDMAN_* variables as the Python side (broker.settings).
set -euo pipefail

# shellcheck disable=SC2034  # read by the scripts that source this file
{
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${SANDMAN_CACHE_DIR:-$HOME/.cache/sandman}"
STATE_ROOT="${SANDMAN_STATE_DIR:-$HOME/.local/state/sandman}"
LOG_TAG="${1:-}"
}

log() { printf '[%s] %s%s\n' "$(date +%H:%M:%S)" "${LOG_TAG:+$LOG_TAG: }" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
