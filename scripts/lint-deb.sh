#!/usr/bin/env bash
# Runs lintian on the package scripts/deb.sh built for this version (or on the .deb given) and
# fails on any error or warning, as Debian's archive would refuse them. Info-level tags are
# printed, not failed on. Overrides, each with why: packaging/deb/lintian-overrides.
#
#   scripts/lint-deb.sh [PACKAGE.deb]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v lintian >/dev/null 2>&1; then
    echo "lint-deb.sh: lintian missing (apt-get install --no-install-recommends lintian)" >&2
    exit 1
fi
deb="${1:-}"
if [[ -z "$deb" ]]; then
    version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"
    revision="$(sed -n 's/^revision = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"
    deb="${CARGO_TARGET_DIR:-target}/debian/tunnelgate_${version}-${revision}_$(dpkg --print-architecture).deb"
fi
[[ -f "$deb" ]] || {
    echo "lint-deb.sh: $deb missing: build it with scripts/deb.sh" >&2
    exit 1
}
echo "==> lintian --display-level '>=info' --fail-on error,warning $deb" >&2
# lintian as root says it would rather not; CI runs as root, and lintian only reads the .deb.
# `lintian --info` explains each tag.
lintian --display-level '>=info' --fail-on error,warning "$deb" 2>&1 |
    { grep -v '^running with root privileges is not recommended!$' || true; }
