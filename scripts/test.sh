#!/usr/bin/env bash
# The one command that runs every test of tunnelgate:
#   formatting, clippy, unit + golden tests, then the network-namespace suites (root).
# Installs the system packages the suites need (Debian/Ubuntu, --no-install-recommends) when missing.
# Runs every step even after a failure, prints the cargo test summaries, and exits non-zero if any
# step failed. CI (.ci/run) runs exactly this, as root, on a fresh clone.
#
# As a user whose Rust comes from rustup: `sudo scripts/test.sh`. sudo's PATH has no ~/.cargo/bin,
# so cargo runs as root with that user's toolchain (the netns suites need root), and target/ is
# handed back to the user at the end. `--print-cargo` says which cargo it would run and exits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/cargo-user.sh
if [[ "${1:-}" == "--print-cargo" ]]; then
    describe_cargo root scripts/test.sh
    exit
fi
[[ $# -eq 0 ]] || { echo "usage: [sudo] scripts/test.sh [--print-cargo]" >&2; exit 2; }
describe_cargo root scripts/test.sh >/dev/null

export DEBIAN_FRONTEND=noninteractive
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
if [[ "${CI:-}" == "true" ]]; then
    export CARGO_INCREMENTAL=0   # a fresh clone gains nothing from incremental state
fi

is_root() { [[ "$(id -u)" == "0" ]]; }

# --- system packages -----------------------------------------------------------------------------
source scripts/packages.sh
# conntrack: the takeover suites' balancers delete a flow's entries when they move, as kube-proxy does.
install_missing wireguard-go wireguard-tools iperf3 nftables iptables dnsmasq iproute2 iputils-ping procps conntrack ||
    echo "warning: the netns suites need them" >&2
# tests/systemd_unit/ boots a real systemd in systemd-nspawn, on a Debian rootfs it debootstraps
# once into /var/tmp/tunnelgate-test-rootfs (skipped with a message when it cannot).
install_missing systemd-container debootstrap util-linux ||
    echo "warning: the booted-systemd test will be skipped" >&2
# scripts/image.sh builds the image with podman (runc) on a debootstrapped base, cached in
# /var/tmp/tunnelgate-image-rootfs; the pod test (tests/sidecar_fake_api/pod_image.rs) runs it.
install_missing podman runc debootstrap || echo "warning: the image and pod test will be skipped" >&2
# scripts/deb.sh builds the Debian package (dpkg-shlibdeps is in dpkg-dev) and lintian checks
# it (lintian brings man-db, which tests/install.rs renders the manual pages with);
# tests/examples.rs runs the README's key commands as a non-root user through sudo.
install_missing dpkg-dev python3 sudo lintian || echo "warning: the package and sudo tests will be skipped" >&2
# The manifest and fake-API suites run `kubectl kustomize` and `kubectl apply` (Debian's
# kubernetes-client when no kubectl is installed).
if ! command -v kubectl >/dev/null 2>&1; then
    install_missing kubernetes-client || echo "warning: the kubectl checks need kubectl" >&2
fi
# The manifest suite validates containers/k8s against the real Kubernetes schemas, offline, with
# kubernetes-validate in a Python virtual environment of its own in /var/tmp (Debian 12's pip
# refuses the system's Python: PEP 668). Without it those tests skip, and under CI=true fail.
install_missing python3-venv || echo "warning: the manifest schema tests need python3-venv" >&2
scripts/kubernetes-validate.sh >/dev/null ||
    echo "warning: no kubernetes-validate (scripts/kubernetes-validate.sh): the manifest schema tests will fail under CI=true, and skip otherwise" >&2
for c in rustfmt clippy; do
    if ! cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1 && command -v rustup >/dev/null; then
        as_toolchain_owner rustup component add "$c"
    fi
done

# --- disk ----------------------------------------------------------------------------------------
# A first run needs about 25 GB (docs/testing.md, "What it leaves behind, and the disk it needs"),
# most of it build output in target/ and fuzz/target/; a later run reuses nearly all of it. Said
# before the builds start, and again in the summary.
need_gb=25
[[ -d target/debug ]] && need_gb=5
avail_gb=$(($(df -Pk . | awk 'NR == 2 {print $4}') / 1024 / 1024))
disk_note=""
if ((avail_gb < need_gb)); then
    disk_note="warning: ${avail_gb} GB free for this checkout; a first run of the suite needs about 25 GB, a later one about 5 (docs/testing.md)"
    echo "$disk_note" >&2
fi

# --- steps ---------------------------------------------------------------------------------------
LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/tunnelgate-test.XXXXXX")"
trap 'rm -rf "$LOG_DIR"; give_back_build_dirs' EXIT
declare -a RESULTS=()
failed=0

step() { # step NAME LOGFILE CMD...
    local name="$1" log="$2"
    shift 2
    echo
    echo "==> $name: $*"
    local start=$SECONDS rc=0
    "$@" 2>&1 | tee "$log" || rc=$?
    local secs=$((SECONDS - start))
    if ((rc == 0)); then
        RESULTS+=("ok     ${name} (${secs}s)")
    else
        RESULTS+=("FAILED ${name} (exit ${rc}, ${secs}s)")
        failed=1
    fi
}

step "cargo fmt --check" "$LOG_DIR/fmt.log" cargo fmt --all --check
step "cargo clippy" "$LOG_DIR/clippy.log" cargo clippy --all-targets --all-features -- -D warnings
step "cargo clippy (daemon only)" "$LOG_DIR/clippy-daemon.log" cargo clippy --all-targets -- -D warnings
step "daemon build has no Kubernetes crates" "$LOG_DIR/tree.log" scripts/check-daemon-deps.sh
# The sidecar's scale tests (group_at/group_past/group_converges) run once, in the release step
# below, where their bounds are asserted too: in a debug build they take minutes and assert less.
step "cargo test (unit, golden)" "$LOG_DIR/test.log" cargo test --all-features --no-fail-fast -- \
    --skip group_at --skip group_past --skip group_converges
# The proxy group at 10,000 and 20,000 Services against the stand-in API server, in a release
# build: only there are its time and memory bounds asserted (20 % clashes converge in <= 2 s,
# <= 10 writes for a burst of 50, RSS <= 64 MiB; a debug build checks the rest and prints them).
step "sidecar at scale (release: time and memory bounds)" "$LOG_DIR/scale.log" \
    cargo test --release --features sidecar --test sidecar_fake_api -- --test-threads=1 \
    group_at group_past group_converges
# The Debian package, which tests/systemd_unit/deb_package.rs installs into a clean Debian root
# in the netns step. It takes the daemon the release step above linked (`--no-build`): that
# build enables the sidecar feature in the library, which the daemon binary does not use, and
# the daemon-only build `scripts/deb.sh` makes by default recompiles 41 crates (about 2
# CPU-minutes) for the same program.
step "Debian package (scripts/deb.sh)" "$LOG_DIR/deb.log" scripts/deb.sh --no-build
# Debian's rules, as lintian reads them: no error and no warning. An override is in
# packaging/deb/lintian-overrides, each with why.
step "lintian on the package" "$LOG_DIR/lintian.log" scripts/lint-deb.sh
# The image as containers/README.md builds it: its `podman build` line as written, the compile
# stage included (about 9 CPU-minutes: 12 minutes from scratch beside other builds on this
# 2-core VM), from local stand-ins for its FROM images.
# It builds at the lowest priority in the background of the netns suites, like the fuzz build
# below; the pod test runs that image after them.
IMAGE_LOG="$LOG_DIR/image-documented.log"
image_pid=""
if is_root; then
    image_start=$SECONDS
    nice -n 19 scripts/image.sh --documented >"$IMAGE_LOG" 2>&1 &
    image_pid=$!
fi
# Fuzz smoke: every cargo-fuzz target in fuzz/, built with libFuzzer's coverage instrumentation on
# stable (scripts/fuzz-smoke.sh says how, and what an ASan run on nightly adds), 5 s each.
# TUNNELGATE_FUZZ_SECS sets the time per target. The instrumented build is about 9 minutes of
# CPU on a fresh checkout (its own target directory, fuzz/target) and the netns suites beside
# it mostly wait on timers and the network, so it builds at the lowest priority in the
# background while they run; the targets run after them.
FUZZ_BUILD_LOG="$LOG_DIR/fuzz-build.log"
fuzz_build_start=$SECONDS
nice -n 19 scripts/fuzz-smoke.sh --build-only >"$FUZZ_BUILD_LOG" 2>&1 &
fuzz_build_pid=$!
# tests/netns_takeover_interop.rs runs boringtun-cli and gotatun (crate gotatun-cli) as
# WireGuard peers. They are built once into the benches' cache (benches/iperf/bench.py installs
# there too), about 30 s and 90 s of build the first time, and reused after; the test finds
# them there or on PATH.
TOOL_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tunnelgate-bench"
install_peers() { # install_peers BINARY:CRATE...
    local pair binary crate
    for pair in "$@"; do
        binary="${pair%%:*}" crate="${pair#*:}"
        if command -v "$binary" >/dev/null 2>&1 || [[ -x "$TOOL_CACHE/bin/$binary" ]]; then
            echo "$binary already installed (PATH or $TOOL_CACHE/bin)"
        else
            cargo install "$crate" --locked --root "$TOOL_CACHE" || return 1
        fi
    done
}
if is_root; then
    step "boringtun-cli and gotatun for the interop suite (cargo install into $TOOL_CACHE)" \
        "$LOG_DIR/peers.log" install_peers boringtun-cli:boringtun-cli gotatun:gotatun-cli
fi
# The tests that run the image wait for it (below).
IMAGE_TESTS=(statefulset_pod_from_the_image podman_save_keeps_the_fully_qualified_name)
# What the daemons' run directory holds before the root suites: afterwards it holds nothing more
# (a daemon killed by a test leaves its status socket and forwarding record; the harness
# removes them, also when the test fails).
RUN_DIR=/run/tunnelgate
run_dir_before="$(ls -A "$RUN_DIR" 2>/dev/null | sort || true)"
run_dir_left() { # what the suites added to the run directory, if anything
    local now
    now="$(ls -A "$RUN_DIR" 2>/dev/null | sort || true)"
    local left
    left="$(comm -13 <(printf '%s\n' "$run_dir_before") <(printf '%s\n' "$now") | sed '/^$/d')"
    if [[ -n "$left" ]]; then
        echo "the suites left in $RUN_DIR:"
        printf '  %s\n' $left
        return 1
    fi
    echo "$RUN_DIR holds nothing the suites made"
}
if is_root; then
    step "cargo test --ignored (netns suites)" "$LOG_DIR/netns.log" \
        cargo test --all-features --no-fail-fast -- --ignored --test-threads=1 \
        "${IMAGE_TESTS[@]/#/--skip=}"
elif [[ "${CI:-}" == "true" ]]; then
    RESULTS+=("FAILED netns suites: CI must run as root")
    failed=1
else
    RESULTS+=("SKIP   netns suites: not root (run: sudo scripts/test.sh)")
fi
if [[ -n "$image_pid" ]]; then
    image_rc=0
    wait "$image_pid" || image_rc=$?
    image_secs=$((SECONDS - image_start))
    image_documented() { # the background build's log and result
        cat "$IMAGE_LOG"
        echo "(the documented build in the background: exit $image_rc after ${image_secs}s)"
        return "$image_rc"
    }
    step "image: containers/README.md's podman build (scripts/image.sh --documented)" \
        "$LOG_DIR/image.log" image_documented
    # The other way in: the host's release binaries as the build context `build` (the runtime
    # stage's layers come from the build above), under a tag of its own. The binaries are those
    # the scale step linked, as the package's are: image.sh's own `cargo build --release`
    # would build them again (a test build turns on the dev-dependencies' features, so the
    # two builds share no artifact of the crates that use them), about 3 more minutes.
    step "image: host binaries (scripts/image.sh)" "$LOG_DIR/image-host.log" \
        env TUNNELGATE_IMAGE_SKIP_CARGO=1 scripts/image.sh localhost/tunnelgate:host-binaries
    step "pod test (the documented image)" "$LOG_DIR/pod.log" \
        cargo test --all-features --no-fail-fast --test sidecar_fake_api -- --ignored \
        --test-threads=1 "${IMAGE_TESTS[@]}"
fi
if is_root; then
    step "nothing left in $RUN_DIR" "$LOG_DIR/run-dir.log" run_dir_left
fi
fuzz_build_rc=0
wait "$fuzz_build_pid" || fuzz_build_rc=$?
fuzz_build_secs=$((SECONDS - fuzz_build_start))
fuzz_after_build() { # the background build's log and result, then the targets
    cat "$FUZZ_BUILD_LOG"
    echo "(fuzz build in the background: exit $fuzz_build_rc after ${fuzz_build_secs}s)"
    ((fuzz_build_rc == 0)) || return "$fuzz_build_rc"
    scripts/fuzz-smoke.sh
}
step "cargo-fuzz targets (stable, coverage-guided)" "$LOG_DIR/fuzz.log" fuzz_after_build

# --- summary -------------------------------------------------------------------------------------
summarize() { # the per-binary "test result" lines of a cargo test log
    [[ -f "$1" ]] || return 0
    awk '/^ *Running /{bin=$0; sub(/^ *Running (unittests )?/,"",bin); sub(/ \(.*$/,"",bin)}
         /^ *Doc-tests /{bin="doc-tests " $2}
         /^test result:/{r=$0; sub(/^test result: /,"",r); sub(/; finished in/," in",r); printf "  %-32s %s\n", bin, r}' "$1" |
        grep -v "0 passed; 0 failed; 0 ignored; 0 measured" || true
    grep -E '^---- .+ stdout ----$' "$1" | sed -E 's/^---- (.+) stdout ----$/  failed: \1/' || true
}
echo
echo "==================== summary ===================="
echo "cargo test (unit, golden):"
summarize "$LOG_DIR/test.log"
if [[ -f "$LOG_DIR/netns.log" ]]; then
    echo "cargo test --ignored (netns suites):"
    summarize "$LOG_DIR/netns.log"
fi
if [[ -f "$LOG_DIR/pod.log" ]]; then
    echo "pod test:"
    summarize "$LOG_DIR/pod.log"
fi
echo
printf '%s\n' "${RESULTS[@]}"
[[ -z "$disk_note" ]] || echo "$disk_note"
if ((failed)); then
    echo "FAILED"
    exit 1
fi
echo "all tests passed"
