#!/usr/bin/env bash
# ChaCha20-Poly1305 through ring, aws-lc-rs and OpenSSL 3, one command:
#   benches/aead/run.sh [--seconds S]
# Installs what OpenSSL's crate builds against (libssl-dev, pkg-config; needs root for that, or
# have them already), builds benches/aead (its own workspace) and writes
# benches/aead/results/<date>-aead-<commit>.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/packages.sh
install_missing libssl-dev pkg-config || true
out="benches/aead/results/$(date -u +%Y-%m-%d)-aead-$(git rev-parse --short HEAD).json"
cargo run --release --manifest-path benches/aead/Cargo.toml -- "$@" --json "$out"
echo "wrote $out"
