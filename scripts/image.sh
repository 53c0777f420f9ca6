#!/usr/bin/env bash
# Builds the tunnelgate image with podman, without any registry (as root):
#   scripts/image.sh [TAG]          the host's binaries in the image; TAG defaults to
#                                   $TUNNELGATE_IMAGE, else localhost/tunnelgate:latest
#   scripts/image.sh --documented   the `podman build` line of containers/README.md, run as
#                                   written (compile stage included), from local stand-ins for
#                                   the images its FROM lines name
#
# 1. The base: a Debian bookworm rootfs made with `debootstrap --variant=minbase` (a few
#    minutes, once; cached in $TUNNELGATE_IMAGE_ROOTFS, else /var/tmp/tunnelgate-image-rootfs)
#    and imported with `podman import` as localhost/tunnelgate-base:bookworm. It stands in for
#    debian:bookworm-slim, containers/Containerfile's BASE.
# 2. Default: the binaries from `cargo build --release --locked --features sidecar --bins` on
#    the host (TUNNELGATE_IMAGE_SKIP_CARGO=1 takes target/release as it is: scripts/test.sh
#    passes it, with the binaries its scale step's `cargo test --release` linked, which this
#    build would otherwise compile again, since a test build turns on the dev-dependencies'
#    features and so shares no artifact of the crates that use them), stripped as the
#    Containerfile's compile stage strips them. They reach the build as the build context named
#    `build`, which takes the place of the Containerfile's stage of that name: podman 4.3 and
#    Docker's BuildKit then skip that stage (containers/Containerfile says why the stage name is
#    literal). The build gets host networking (the runtime stage runs apt-get against the
#    base's Debian mirror).
#    --documented: the base is also tagged docker.io/library/debian:bookworm-slim, and a Rust
#    stand-in docker.io/library/rust:1-bookworm (the Containerfile's BUILDER) is made from the
#    base, gcc and libc6-dev, the host's Rust toolchain (`rustc --print sysroot`) and the host's
#    CA bundle (the compile stage fetches crates, and registries may sit behind a
#    TLS-inspecting proxy), each only when no image of that name is there already. Then the
#    README's line, read from containers/README.md, runs with no flag added; a containers.conf
#    (CONTAINERS_CONF) gives its RUN steps the host's network, as --network host does for the
#    other builds here, so that podman's bridge network does not turn on the host's IP
#    forwarding.
# 3. It removes the untagged images the build left (the stages that are not the image, and an
#    image the tag named before), checks that both binaries run in the image, and prints the
#    image's size and what it adds to the base.
#
# podman runs as root with runc and the cgroupfs manager, and `podman run` with explicit
# ulimits: crun and the default limits do not work on the VMs this project is tested on
# (tests/sidecar_fake_api/pod_image.rs runs the image the same way).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DOCUMENTED=0
if [[ "${1:-}" == "--documented" ]]; then
    DOCUMENTED=1
    shift
fi
TAG="${1:-${TUNNELGATE_IMAGE:-localhost/tunnelgate:latest}}"
ROOTFS="${TUNNELGATE_IMAGE_ROOTFS:-/var/tmp/tunnelgate-image-rootfs}"
BASE=localhost/tunnelgate-base:bookworm
# The images containers/Containerfile's FROM lines name (its BUILDER and BASE defaults).
DOC_BASE=docker.io/library/debian:bookworm-slim
DOC_BUILDER=docker.io/library/rust:1-bookworm
MIRROR="${TUNNELGATE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

podman() {
    command podman --runtime runc --cgroup-manager cgroupfs "$@"
}
ULIMITS=(--ulimit nofile=20000:20000 --ulimit nproc=4096:4096)
# Only local images are used, so no signature is checked: Debian's default policy, given here
# because a podman whose package is not configured yet has no /etc/containers/policy.json.
POLICY="$(mktemp "${TMPDIR:-/tmp}/tunnelgate-policy.XXXXXX.json")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tunnelgate-image.XXXXXX")"
trap 'rm -rf "$POLICY" "$WORK"' EXIT
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

# Every image a build below commits (its stages, cached or not) is named in its output; the log
# is kept to find those left untagged afterwards.
BUILD_LOG="$WORK/build.log"
: >"$BUILD_LOG"
image_id() { podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

if ((DOCUMENTED)); then
    # --- 2. stand-ins, then the README's line ----------------------------------------------------
    if ! podman image exists "$DOC_BASE"; then
        echo "==> $BASE stands in for $DOC_BASE"
        podman tag "$BASE" "$DOC_BASE"
    fi
    if ! podman image exists "$DOC_BUILDER"; then
        echo "==> a Rust stand-in for $DOC_BUILDER: the host's toolchain on $DOC_BASE"
        sysroot="$(rustc --print sysroot)"
        mkdir -p "$WORK/rust"
        ca=""
        if [[ -s /etc/ssl/certs/ca-certificates.crt ]]; then
            cp /etc/ssl/certs/ca-certificates.crt "$WORK/rust/host-ca.crt"
            ca="COPY host-ca.crt /etc/ssl/certs/ca-certificates.crt"
        fi
        cat >"$WORK/rust/Containerfile" <<EOF
FROM $DOC_BASE
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \\
    && rm -rf /var/lib/apt/lists/*
$ca
RUN mkdir -p /usr/local/rust /usr/local/cargo \\
    && cp -a /mnt/toolchain/bin /mnt/toolchain/lib /mnt/toolchain/libexec /usr/local/rust/
ENV CARGO_HOME=/usr/local/cargo \\
    PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
        podman build --signature-policy "$POLICY" --network host -v "$sysroot:/mnt/toolchain:ro" \
            -t "$DOC_BUILDER" "$WORK/rust" | tee -a "$BUILD_LOG"
    fi
    line="$(grep -m1 -E '^ *podman build -f containers/Containerfile' containers/README.md |
        sed -e 's/^ *//' -e 's/ *#.*$//')"
    if ! [[ "$line" =~ ^podman\ build\ -f\ containers/Containerfile\ -t\ ([A-Za-z0-9./:_-]+)\ \.$ ]]; then
        echo "scripts/image.sh: containers/README.md's podman build line is not the plain build this runs: $line" >&2
        exit 1
    fi
    TAG="${BASH_REMATCH[1]}"
    replaced="$(image_id "$TAG")"
    echo "==> $line   (containers/README.md, as written)"
    # Its RUN steps on the host's network, as the other builds here: podman's default bridge
    # network (CNI) would turn on the host's net.ipv4.ip_forward, which new network namespaces
    # inherit, and the netns suites that run beside this build expect it off.
    printf '[containers]\nnetns = "host"\n' >"$WORK/containers.conf"
    # shellcheck disable=SC2086 # the line's words, checked above
    CONTAINERS_CONF="$WORK/containers.conf" command $line | tee -a "$BUILD_LOG"
    base_of_image="$DOC_BASE"
else
    # --- 2. host binaries, as the build context `build` ------------------------------------------
    if [[ "${TUNNELGATE_IMAGE_SKIP_CARGO:-}" != "1" ]]; then
        echo "==> cargo build --release --locked --features sidecar --bins"
        cargo build --release --locked --features sidecar --bins
    fi
    release="${CARGO_TARGET_DIR:-target}/release"
    install -D -s -m 0755 -t "$WORK/build/out" "$release/tunnelgate" "$release/tunnelgate-sidecar"
    echo "==> podman build -f containers/Containerfile -t $TAG (base $BASE, host binaries)"
    replaced="$(image_id "$TAG")"
    podman build --signature-policy "$POLICY" --network host "${ULIMITS[@]}" \
        --build-arg BASE="$BASE" --build-context build="$WORK/build" \
        -f containers/Containerfile -t "$TAG" . | tee -a "$BUILD_LOG"
    base_of_image="$BASE"
fi

# --- 3. no untagged image left; the binaries run ---------------------------------------------
# The stages' images (`--> ID`, `--> Using cache ID`) and the image the tag named before: those
# of them nothing tags now are removed. Other untagged images are not this build's.
untagged="$(podman images --quiet --no-trunc --filter dangling=true)"
made="$(sed -nE 's/^--> (Using cache )?([0-9a-f]{11,64})$/\2/p' "$BUILD_LOG")"
for full in $(for id in $made $replaced; do grep -m1 "^\(sha256:\)\?$id" <<<"$untagged"; done | sort -u); do
    podman rmi "$full" >/dev/null 2>&1 || echo "warning: could not remove the untagged image $full" >&2
done
# No network: podman's default bridge would turn on the host's IP forwarding (see above).
for bin in tunnelgate tunnelgate-sidecar; do
    echo "$TAG: $(podman run --rm --network none "${ULIMITS[@]}" "$TAG" "$bin" --version)"
done
size() { podman image inspect --format '{{.Size}}' "$1"; }
total=$(size "$TAG")
base=$(size "$base_of_image")
echo "image $TAG: $((total / 1000000)) MB, of which $(((total - base) / 1000000)) MB added to the base $base_of_image ($((base / 1000000)) MB)"
