#!/usr/bin/env bash
# Builds tunnelgate and installs it: the binaries, the `tunnelgate-wg` link (wg-quick's
# userspace implementation), the systemd units, the manual pages, the docs and example configs,
# and the 0700 configuration directory. Run it as yourself from a checkout: it builds with your cargo and
# asks sudo for the install steps (as root it installs directly). --uninstall takes it out again.
#
#   scripts/install.sh [--sidecar] [--prebuilt DIR | --no-build]
#   scripts/install.sh --uninstall
#
#   --sidecar        also build and install tunnelgate-sidecar (the Kubernetes sidecar)
#   --prebuilt DIR   install the binaries found in DIR as they are (no cargo needed)
#   --no-build       install target/release as it is (after your own `cargo build --release`)
#   --uninstall      remove what an install with the same variables put in place: the binaries
#                    and the link, the units (one edited since is kept, and named), the manual
#                    pages, the docs and example configs, and $SYSCONFDIR/tunnelgate only if it is empty. Keys and
#                    configs there are never removed (it names what it keeps). With systemd
#                    running, it first stops and disables the units.
#
# Where things go (each overridable in the environment):
#   PREFIX=/usr/local           binaries in $PREFIX/bin (BINDIR)
#   UNITDIR=/etc/systemd/system the units; their paths follow BINDIR and SYSCONFDIR
#   SYSCONFDIR=/etc             the configuration directory $SYSCONFDIR/tunnelgate, mode 0700
#   MANDIR=$PREFIX/share/man    the manual pages tunnelgate(8), tunnelgate-COMMAND(8), in man8/
#   DOCDIR=/usr/share/doc/tunnelgate   README, docs/router.md and config/ (the units point here)
#   DESTDIR=                    a staging root everything above is put under (packaging, tests)
#
# It installs no key and no configuration file, never overwrites one in $SYSCONFDIR/tunnelgate,
# and starts nothing: it prints the next steps. scripts/deb.sh packages what it installs. A
# tunnelgate already installed elsewhere on PATH (the Debian package's /usr/bin/tunnelgate) is
# named: one of the two hides the other.
set -euo pipefail
CALLER_DIR="$PWD"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Paths given relative to where it was called from.
absolute() { [[ -z "$1" || "$1" == /* ]] && echo "$1" || echo "$CALLER_DIR/$1"; }

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit "${1:-2}"
}

SIDECAR=0
PREBUILT=""
NO_BUILD=0
UNINSTALL=0
while (($#)); do
    case "$1" in
    --sidecar) SIDECAR=1 ;;
    --uninstall) UNINSTALL=1 ;;
    --prebuilt)
        [[ $# -ge 2 ]] || usage
        PREBUILT="$2"
        shift
        ;;
    --no-build) NO_BUILD=1 ;;
    -h | --help) usage 0 ;;
    *)
        echo "install.sh: unknown argument: $1" >&2
        usage
        ;;
    esac
    shift
done

PREFIX="${PREFIX:-/usr/local}"
BINDIR="${BINDIR:-$PREFIX/bin}"
UNITDIR="${UNITDIR:-/etc/systemd/system}"
SYSCONFDIR="${SYSCONFDIR:-/etc}"
DOCDIR="${DOCDIR:-/usr/share/doc/tunnelgate}"
MANDIR="${MANDIR:-$PREFIX/share/man}"
DESTDIR="$(absolute "${DESTDIR:-}")"
PREBUILT="$(absolute "$PREBUILT")"

if ((UNINSTALL)) && { ((SIDECAR || NO_BUILD)) || [[ -n "$PREBUILT" ]]; }; then
    echo "install.sh: --uninstall takes no other option (it removes whatever an install put in place)" >&2
    usage
fi

# --- privileges --------------------------------------------------------------------------------
# Into the real system as a normal user: the install steps go through sudo.
AS_ROOT=()
if [[ -z "$DESTDIR" && "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null 2>&1; then
        AS_ROOT=(sudo)
    else
        echo "install.sh: run it as root (no sudo here), or set DESTDIR to stage the files" >&2
        exit 1
    fi
fi
run() { "${AS_ROOT[@]}" "$@"; }

UNITS=(tunnelgate.service tunnelgate@.service)
# The README as installed: of the pages it links, only router.md (beside it) and config/ are
# installed, so a note under its title says where the rest is, and its router.md link is local.
render_readme() {
    sed -n '1p' README.md
    cat <<'NOTE'

> This copy was installed with tunnelgate. Beside it are `router.md` (a subnet router or exit
> node, with or without systemd) and the example configurations in `config/`; every command
> has a manual page (`man 8 tunnelgate`, `man 8 tunnelgate-run`, ...). The other pages this
> README links (`docs/`, `containers/`, `benches/`, `CHANGELOG.md`) are in the source
> repository tunnelgate was built from.
NOTE
    sed -e '1d' -e 's|](docs/router\.md)|](router.md)|g' README.md
}
# A unit as installed: the repository's names /usr/local/bin and /etc, moved to BINDIR and
# SYSCONFDIR when they differ.
render_unit() { # render_unit NAME
    sed -e "s|/usr/local/bin/tunnelgate|$BINDIR/tunnelgate|g" \
        -e "s|/etc/tunnelgate/|$SYSCONFDIR/tunnelgate/|g" \
        "systemd/$1"
}

# --- uninstall ---------------------------------------------------------------------------------
if ((UNINSTALL)); then
    echo "==> removing from ${DESTDIR:-/}: $BINDIR, $UNITDIR, $MANDIR/man8, $DOCDIR (keys and configs stay)" >&2
    # A running service would go on with a deleted binary, and an enabled one would point at a
    # unit that is gone: stop and disable them first (the real system only, with systemd).
    if [[ -z "$DESTDIR" && -d /run/systemd/system ]] && command -v systemctl >/dev/null 2>&1; then
        run systemctl stop tunnelgate.service 'tunnelgate@*.service' || true
        run systemctl disable "${UNITS[@]}" 2>/dev/null || true
    fi
    kept=()
    for b in tunnelgate tunnelgate-sidecar; do
        if [[ -e "$DESTDIR$BINDIR/$b" ]]; then
            run rm -f "$DESTDIR$BINDIR/$b"
        fi
    done
    # The link only if it is ours (it points at tunnelgate).
    if [[ "$(readlink "$DESTDIR$BINDIR/tunnelgate-wg" 2>/dev/null)" == "tunnelgate" ]]; then
        run rm -f "$DESTDIR$BINDIR/tunnelgate-wg"
    fi
    for unit in "${UNITS[@]}"; do
        installed="$DESTDIR$UNITDIR/$unit"
        [[ -e "$installed" ]] || continue
        # A unit that is not what this checkout installs was edited in place (or comes from
        # another version): the admin's work, kept. Drop-ins ($unit.d/) are never touched.
        if render_unit "$unit" | run cmp -s - "$installed"; then
            run rm -f "$installed"
        else
            kept+=("$installed (differs from what this checkout installs: edited, or another version)")
        fi
    done
    # The pages are those of the commands of the version installed: all of tunnelgate's.
    for page in "$DESTDIR$MANDIR"/man8/tunnelgate.8.gz "$DESTDIR$MANDIR"/man8/tunnelgate-*.8.gz; do
        if [[ -e "$page" || -L "$page" ]]; then
            run rm -f "$page"
        fi
    done
    for doc in README.md router.md; do
        run rm -f "$DESTDIR$DOCDIR/$doc"
    done
    for example in config/*.toml; do
        run rm -f "$DESTDIR$DOCDIR/$example"
    done
    # The folders only when nothing else is in them.
    run rmdir "$DESTDIR$DOCDIR/config" "$DESTDIR$DOCDIR" 2>/dev/null || true
    etc="$DESTDIR$SYSCONFDIR/tunnelgate"
    if [[ -d "$etc" ]] && ! run rmdir "$etc" 2>/dev/null; then
        kept+=("$etc with what you put there: $(run ls -A "$etc" | tr '\n' ' ')")
    fi
    if [[ -z "$DESTDIR" && -d /run/systemd/system ]] && command -v systemctl >/dev/null 2>&1; then
        run systemctl daemon-reload || true
    fi
    echo "==> removed tunnelgate." >&2
    if ((${#kept[@]})); then
        echo "==> kept (remove them yourself when they are no longer needed):" >&2
        printf '    %s\n' "${kept[@]}" >&2
    fi
    exit 0
fi

BINARIES=(tunnelgate)
((SIDECAR)) && BINARIES+=(tunnelgate-sidecar)

# --- the binaries ------------------------------------------------------------------------------
if [[ -n "$PREBUILT" ]]; then
    SRC="$PREBUILT"
elif ((NO_BUILD)); then
    SRC=target/release
else
    if ! command -v cargo >/dev/null 2>&1; then
        echo "install.sh: no cargo on PATH. Install Rust (>= $(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)) with rustup:" >&2
        echo "  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh" >&2
        echo "then run scripts/install.sh as that user (it asks sudo for the install steps)." >&2
        exit 1
    fi
    # Cargo rebuilds only what changed: after an earlier release build this is quick.
    features=()
    ((SIDECAR)) && features=(--features sidecar)
    echo "==> cargo build --release --locked ${features[*]}" >&2
    cargo build --release --locked "${features[@]}"
    SRC=target/release
fi
for b in "${BINARIES[@]}"; do
    if [[ ! -x "$SRC/$b" ]]; then
        echo "install.sh: $SRC/$b is missing: build it first (cargo build --release --locked$( ((SIDECAR)) && echo ' --features sidecar'))" >&2
        exit 1
    fi
done

# --- install -----------------------------------------------------------------------------------
# The manual pages, written by the binary being installed from its own command line (a
# hidden `tunnelgate man DIR`), compressed as Debian's policy asks (gzip -9n: no name or time).
pages_tmp="$(mktemp -d)"
trap 'rm -rf "$pages_tmp"' EXIT
if ! "$SRC/tunnelgate" man "$pages_tmp" >/dev/null; then
    echo "install.sh: $SRC/tunnelgate cannot write its manual pages (tunnelgate man DIR): is it tunnelgate of this checkout, built for this machine?" >&2
    exit 1
fi
gzip -9n "$pages_tmp"/*.8

echo "==> installing into ${DESTDIR:-/}: $BINDIR, $UNITDIR, $MANDIR/man8, $SYSCONFDIR/tunnelgate, $DOCDIR" >&2
run install -d -m 0755 "$DESTDIR$BINDIR" "$DESTDIR$UNITDIR" "$DESTDIR$MANDIR/man8" "$DESTDIR$DOCDIR" "$DESTDIR$DOCDIR/config"
for b in "${BINARIES[@]}"; do
    run install -m 0755 "$SRC/$b" "$DESTDIR$BINDIR/$b"
done
# Relative, so it stays right under DESTDIR and wherever BINDIR is.
run ln -sfn tunnelgate "$DESTDIR$BINDIR/tunnelgate-wg"

run install -m 0644 "$pages_tmp"/*.8.gz "$DESTDIR$MANDIR/man8/"
# tunnelgate-wg is `tunnelgate userspace`: the same page.
run ln -sfn tunnelgate-userspace.8.gz "$DESTDIR$MANDIR/man8/tunnelgate-wg.8.gz"

units_tmp="$(mktemp -d)"
trap 'rm -rf "$units_tmp" "$pages_tmp"' EXIT
for unit in "${UNITS[@]}"; do
    render_unit "$unit" >"$units_tmp/$unit"
    run install -m 0644 "$units_tmp/$unit" "$DESTDIR$UNITDIR/$unit"
done

render_readme >"$units_tmp/README.md"
run install -m 0644 "$units_tmp/README.md" "$DESTDIR$DOCDIR/README.md"
run install -m 0644 docs/router.md "$DESTDIR$DOCDIR/router.md"
run install -m 0644 config/*.toml "$DESTDIR$DOCDIR/config/"

# Keys live here: readable by root only. An existing directory keeps its files.
run install -d -m 0700 "$DESTDIR$SYSCONFDIR/tunnelgate"

# --- what is left to do ------------------------------------------------------------------------
missing=()
command -v nft >/dev/null 2>&1 || command -v iptables-restore >/dev/null 2>&1 ||
    missing+=("nftables (or iptables): the firewall rules (apt-get install --no-install-recommends nftables)")
command -v wg >/dev/null 2>&1 ||
    missing+=("wireguard-tools (optional): wg show / wg-quick (apt-get install --no-install-recommends wireguard-tools)")
if ((${#missing[@]})); then
    echo "==> not installed on this host:" >&2
    printf '    %s\n' "${missing[@]}" >&2
fi
# Another tunnelgate (the Debian package's, or an install with another PREFIX): a shell runs the
# one first on PATH (/usr/local/bin comes before /usr/bin), and systemd the unit in
# /etc/systemd/system before the package's in /usr/lib/systemd/system. Say which is which.
for other in /usr/local/bin /usr/bin /bin /usr/local/sbin /usr/sbin; do
    [[ "$other" != "$BINDIR" && -f "$DESTDIR$other/tunnelgate" && ! -L "$DESTDIR$other/tunnelgate" ]] || continue
    [[ "$other" == /bin && -L "$DESTDIR/bin" ]] && continue # /bin is /usr/bin (merged /usr)
    from="another install"
    if [[ -z "$DESTDIR" ]] && owner="$(dpkg-query -S "$other/tunnelgate" 2>/dev/null)"; then
        from="the Debian package ${owner%%:*}"
    fi
    echo "==> warning: $DESTDIR$other/tunnelgate is installed too ($from), beside $DESTDIR$BINDIR/tunnelgate:" >&2
    echo "    \`tunnelgate\` runs whichever comes first on PATH, and systemd runs the units in $UNITDIR." >&2
    echo "    Keep one: \`sudo apt remove tunnelgate\` for the package, or \`scripts/install.sh --uninstall\` for this copy." >&2
done
cat >&2 <<EOF
==> installed $(printf '%s ' "${BINARIES[@]}")tunnelgate-wg and the units (scripts/install.sh --uninstall removes them). Next:
    sudo sh -c 'umask 077; tunnelgate genkey > $SYSCONFDIR/tunnelgate/private.key'
    sudo sh -c 'tunnelgate pubkey < $SYSCONFDIR/tunnelgate/private.key'   # your public key, for the peers
    sudo cp $DOCDIR/config/minimal.toml $SYSCONFDIR/tunnelgate/tunnelgate.toml   # then edit it
    sudo tunnelgate check --config $SYSCONFDIR/tunnelgate/tunnelgate.toml
    sudo systemctl daemon-reload && sudo systemctl enable --now tunnelgate
EOF
