#!/usr/bin/env bash
# Sets up kubernetes-validate, which checks manifests against the real Kubernetes OpenAPI
# schemas offline, in a Python virtual environment of its own, and prints the path of its
# kubernetes-validate. tests/sidecar_manifests looks for it there; scripts/test.sh runs this.
#
#   scripts/kubernetes-validate.sh     # then: "$(scripts/kubernetes-validate.sh)" --strict -k 1.33.0 FILE
#
# Debian 12's pip refuses to install into the system's Python (PEP 668,
# "externally-managed-environment"), hence the environment: /var/tmp/tunnelgate-kubernetes-validate
# (about 150 MB), kept for the next run like the test roots; TUNNELGATE_VALIDATE_VENV moves it.
# An environment that already has this version is reused without a download. It needs python3
# with its venv module (Debian: python3-venv) and PyPI. pip is given the system's CA bundle
# (PIP_CERT, if set, wins), so a TLS-inspecting proxy whose CA the system trusts works too.
set -euo pipefail

VENV="${TUNNELGATE_VALIDATE_VENV:-/var/tmp/tunnelgate-kubernetes-validate}"
VERSION=1.37.0
BIN="$VENV/bin/kubernetes-validate"

if [[ "$("$BIN" --version 2>/dev/null || true)" == "$VERSION" ]]; then
    echo "$BIN"
    exit 0
fi
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    echo "kubernetes-validate.sh: python3 has no venv module: apt-get install --no-install-recommends python3-venv" >&2
    exit 1
fi
rm -rf "$VENV"
python3 -m venv "$VENV" >&2
cert=()
if [[ -z "${PIP_CERT:-}" && -f /etc/ssl/certs/ca-certificates.crt ]]; then
    cert=(--cert /etc/ssl/certs/ca-certificates.crt)
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check "${cert[@]}" "kubernetes-validate==$VERSION" >&2
"$BIN" --version >&2
echo "$BIN"
