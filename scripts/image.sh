#!/usr/bin/env bash
# Builds the tunnelgate image with podman, without any registry:
#   scripts/image.sh [TAG]          (default: $TUNNELGATE_IMAGE, else localhost/tunnelgate:latest)
#
# 1. The base: a Debian bookworm rootfs made with `debootstrap --variant=minbase` (a few
#    minutes, once; cached in $TUNNELGATE_IMAGE_ROOTFS, else /var/tmp/tunnelgate-image-rootfs)
#    and imported with `podman import` as localhost/tunnelgate-base:bookworm. It stands in for
#    debian:bookworm-slim (containers/Containerfile's BASE).
# 2. The binaries: `cargo build --release --features sidecar --bins` on the host, the profile
#    scripts/test.sh's scale step already builds, so CI compiles nothing twice. They reach the
#    Containerfile as the build context "prebuilt" (BINARIES=prebuilt): its compile stage is
#    skipped. TUNNELGATE_IMAGE_SKIP_CARGO=1 takes target/release as it is.
# 3. `podman build` of containers/Containerfile with the repository as context, the host's CA
#    bundle as a build secret (registries may sit behind a TLS-inspecting proxy) and host
#    networking (the runtime stage runs apt-get against the base's Debian mirror).
# Prints the image's size and the size of the layers it adds to the base.
#
# podman runs as root with runc and the cgroupfs manager, and explicit ulimits: crun and the
# default limits do not work on these VMs (docs in PITFALLS: "Containers here").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TAG="${1:-${TUNNELGATE_IMAGE:-localhost/tunnelgate:latest}}"
ROOTFS="${TUNNELGATE_IMAGE_ROOTFS:-/var/tmp/tunnelgate-image-rootfs}"
BASE=localhost/tunnelgate-base:bookworm
MIRROR="${TUNNELGATE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

podman() {
    command podman --runtime runc --cgroup-manager cgroupfs "$@"
}
# Only local images are used, so no signature is checked: Debian's default policy, given here
# because a podman whose package is not configured yet has no /etc/containers/policy.json.
POLICY="$(mktemp "${TMPDIR:-/tmp}/tunnelgate-policy.XXXXXX.json")"
PREBUILT="$(mktemp -d "${TMPDIR:-/tmp}/tunnelgate-image.XXXXXX")"
trap 'rm -rf "$POLICY" "$PREBUILT"' EXIT
echo '{"default": [{"type": "insecureAcceptAnything"}]}' >"$POLICY"

if [[ "$(id -u)" != "0" ]]; then
    echo "scripts/image.sh: needs root (debootstrap, podman with runc)" >&2
    exit 1
fi
for tool in podman runc debootstrap; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "scripts/image.sh: $tool missing (apt-get install --no-install-recommends podman runc debootstrap)" >&2
        exit 1
    fi
done

# --- 1. base ---------------------------------------------------------------------------------
if ! podman image exists "$BASE"; then
    if [[ ! -x "$ROOTFS/usr/bin/apt-get" ]]; then
        echo "==> debootstrap --variant=minbase bookworm $ROOTFS (once)"
        rm -rf "$ROOTFS.partial"
        debootstrap --variant=minbase bookworm "$ROOTFS.partial" "$MIRROR" >/dev/null
        mv "$ROOTFS.partial" "$ROOTFS"
    fi
    echo "==> podman import $ROOTFS as $BASE"
    # Without the downloaded packages and lists: apt-get update in the build fetches fresh ones.
    tar -C "$ROOTFS" --exclude=./var/cache/apt/archives/*.deb --exclude=./var/lib/apt/lists/* \
        -c . | podman import --signature-policy "$POLICY" - "$BASE" >/dev/null
fi

# --- 2. binaries -----------------------------------------------------------------------------
if [[ "${TUNNELGATE_IMAGE_SKIP_CARGO:-}" != "1" ]]; then
    echo "==> cargo build --release --locked --features sidecar --bins"
    cargo build --release --locked --features sidecar --bins
fi
# Without the symbol table, as the Containerfile's own compile stage installs them.
release="${CARGO_TARGET_DIR:-target}/release"
install -D -s -m 0755 -t "$PREBUILT/out" "$release/tunnelgate" "$release/tunnelgate-sidecar"

# --- 3. image --------------------------------------------------------------------------------
CA=/etc/ssl/certs/ca-certificates.crt
ca_secret=()
[[ -s "$CA" ]] && ca_secret=(--secret "id=host-ca,src=$CA")
echo "==> podman build -f containers/Containerfile -t $TAG (base $BASE, host binaries)"
podman build --signature-policy "$POLICY" --network host \
    --ulimit nofile=20000:20000 --ulimit nproc=4096:4096 \
    "${ca_secret[@]}" \
    --build-arg BASE="$BASE" \
    --build-arg BINARIES=prebuilt --build-context prebuilt="$PREBUILT" \
    -f containers/Containerfile -t "$TAG" .

size() { podman image inspect --format '{{.Size}}' "$1"; }
total=$(size "$TAG")
base=$(size "$BASE")
echo "image $TAG: $((total / 1000000)) MB, of which $(((total - base) / 1000000)) MB added to the base $BASE ($((base / 1000000)) MB)"
