#!/usr/bin/env bash
# Fails when the daemon's default build (no `sidecar` feature) depends on a Kubernetes or TLS
# crate: those belong to tunnelgate-sidecar alone. Prints the normal-dependency tree's crate
# names it checked.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tree="$(cargo tree -e normal --prefix none --format '{p}' | awk '{print $1}' | sort -u)"
echo "daemon build: $(wc -l <<<"$tree") crates"
bad="$(grep -E '^(kube|kube-[a-z-]+|k8s-openapi|rustls|rustls-[a-z-]+|tokio-rustls|hyper-rustls)$' <<<"$tree" || true)"
if [[ -n "$bad" ]]; then
    echo "the daemon build pulls in crates that belong to the sidecar only:" >&2
    echo "$bad" >&2
    exit 1
fi
echo "no kube, k8s-openapi or rustls in the daemon build"
