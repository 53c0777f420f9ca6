#!/usr/bin/env bash
# Builds the Debian package: target/debian/tunnelgate_<version>-<revision>_<arch>.deb
#
#   scripts/deb.sh [--prebuilt DIR | --no-build]
#
#   (default)        cargo build --release --locked --bin tunnelgate, then package it
#   --prebuilt DIR   package DIR/tunnelgate as it is
#   --no-build       package target/release/tunnelgate as it is
#
# The files are what scripts/install.sh installs, staged with DESTDIR and PREFIX=/usr:
# /usr/bin/tunnelgate (stripped here, as dh_strip would), the /usr/bin/tunnelgate-wg link, both
# units in /usr/lib/systemd/system (ExecStart=/usr/bin/tunnelgate ...), the manual pages in
# /usr/share/man/man8, the docs and example configs in /usr/share/doc/tunnelgate, and
# /etc/tunnelgate, mode 0700, owned by the package; and Debian's own: the copyright file,
# changelog.Debian.gz and the lintian overrides, from packaging/deb. The control fields come
# from [package.metadata.deb] in Cargo.toml; its `$auto` becomes the shared libraries the
# binary links, as dpkg-shlibdeps finds them. The maintainer scripts are in packaging/deb:
# dh_installsystemd's blocks, written out. `lintian` passes on the result (scripts/test.sh
# runs it). Needs dpkg-dev (dpkg-shlibdeps, and binutils' strip), python3 (to read Cargo.toml)
# and, to build, cargo. The install and its ways out: README.md, "Install".
set -euo pipefail
# Directories in the package get 0755 unless install.sh says otherwise (/etc/tunnelgate: 0700),
# whatever the caller's umask.
umask 022
CALLER_DIR="$PWD"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
absolute() { [[ -z "$1" || "$1" == /* ]] && echo "$1" || echo "$CALLER_DIR/$1"; }

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit "${1:-2}"
}

PREBUILT=""
NO_BUILD=0
while (($#)); do
    case "$1" in
    --prebuilt)
        [[ $# -ge 2 ]] || usage
        PREBUILT="$(absolute "$2")"
        shift
        ;;
    --no-build) NO_BUILD=1 ;;
    -h | --help) usage 0 ;;
    *)
        echo "deb.sh: unknown argument: $1" >&2
        usage
        ;;
    esac
    shift
done
for tool in dpkg-deb dpkg-shlibdeps python3 strip; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "deb.sh: $tool missing (apt-get install --no-install-recommends dpkg-dev python3)" >&2
        exit 1
    fi
done

TARGET="${CARGO_TARGET_DIR:-target}"
if [[ -n "$PREBUILT" ]]; then
    SRC="$PREBUILT"
elif ((NO_BUILD)); then
    SRC="$TARGET/release"
else
    echo "==> cargo build --release --locked --bin tunnelgate" >&2
    cargo build --release --locked --bin tunnelgate
    SRC="$TARGET/release"
fi
[[ -x "$SRC/tunnelgate" ]] || {
    echo "deb.sh: $SRC/tunnelgate is missing: build it first (cargo build --release --locked)" >&2
    exit 1
}

# One line per field, from Cargo.toml: the package's own fields and [package.metadata.deb].
fields="$(python3 - <<'EOF'
import tomllib
with open("Cargo.toml", "rb") as f:
    package = tomllib.load(f)["package"]
deb = package["metadata"]["deb"]
print("name=" + package["name"])
print("version=" + package["version"])
print("license=" + package["license"])
for key in ["maintainer", "section", "priority", "revision", "depends", "recommends",
            "maintainer-scripts", "synopsis", "extended-description"]:
    print(key + "=" + " ".join(str(deb[key]).split()))
EOF
)"
field() { sed -n "s/^$1=//p" <<<"$fields"; }
NAME="$(field name)"
VERSION="$(field version)-$(field revision)"
PACKAGING="$(field maintainer-scripts)"
# The changelog's newest entry is this version: bump both together.
changelog_version="$(sed -n '1s/^[^ ]* (\([^)]*\)).*/\1/p' "$PACKAGING/changelog")"
if [[ "$changelog_version" != "$VERSION" ]]; then
    echo "deb.sh: $PACKAGING/changelog's newest entry is $changelog_version, the package is $VERSION (Cargo.toml): add an entry" >&2
    exit 1
fi
ARCH="$(dpkg --print-architecture)"
OUT="$TARGET/debian/${NAME}_${VERSION}_${ARCH}.deb"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tunnelgate-deb.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# dpkg-shlibdeps wants a source package's layout: debian/control, and the tree in debian/NAME.
STAGE="$WORK/debian/$NAME"
mkdir -p "$STAGE"
chmod 0755 "$STAGE"
: >"$WORK/debian/control"

# --- the files: install.sh's, under /usr -------------------------------------------------------
install_log="$WORK/install.log"
if ! DESTDIR="$STAGE" PREFIX=/usr BINDIR=/usr/bin UNITDIR=/usr/lib/systemd/system SYSCONFDIR=/etc \
    MANDIR=/usr/share/man DOCDIR="/usr/share/doc/$NAME" scripts/install.sh --prebuilt "$SRC" \
    2>"$install_log"; then
    cat "$install_log" >&2
    exit 1
fi
# What dh_strip does (the debug symbols are not shipped: no -dbgsym package).
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$STAGE/usr/bin/$NAME"
install -m 0644 "$PACKAGING/copyright" "$STAGE/usr/share/doc/$NAME/copyright"
gzip -9n <"$PACKAGING/changelog" >"$STAGE/usr/share/doc/$NAME/changelog.Debian.gz"
chmod 0644 "$STAGE/usr/share/doc/$NAME/changelog.Debian.gz"
install -d -m 0755 "$STAGE/usr/share/lintian/overrides"
install -m 0644 "$PACKAGING/lintian-overrides" "$STAGE/usr/share/lintian/overrides/$NAME"

# --- control -----------------------------------------------------------------------------------
mkdir -p "$STAGE/DEBIAN"   # also how dpkg-shlibdeps finds the package's root
shlibs="$(cd "$WORK" && dpkg-shlibdeps -O "debian/$NAME/usr/bin/tunnelgate")"
shlibs="${shlibs#shlibs:Depends=}"
depends="$(field depends)"
depends="${depends//\$auto/$shlibs}"
{
    echo "Package: $NAME"
    echo "Version: $VERSION"
    echo "Architecture: $ARCH"
    echo "Maintainer: $(field maintainer)"
    echo "Installed-Size: $(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)"
    echo "Depends: $depends"
    echo "Recommends: $(field recommends)"
    echo "Section: $(field section)"
    echo "Priority: $(field priority)"
    echo "Description: $(field synopsis)"
    field extended-description | fold -s -w 78 | sed -e 's/ *$//' -e 's/^/ /'
} >"$STAGE/DEBIAN/control"
for script in preinst postinst prerm postrm; do
    if [[ -f "$PACKAGING/$script" ]]; then
        install -m 0755 "$PACKAGING/$script" "$STAGE/DEBIAN/$script"
    fi
done
(cd "$STAGE" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z |
    xargs -0 md5sum >DEBIAN/md5sums)
chmod 0644 "$STAGE/DEBIAN/md5sums"

mkdir -p "$(dirname "$OUT")"
dpkg-deb --root-owner-group --build "$STAGE" "$OUT" >/dev/null
echo "==> $OUT"
dpkg-deb --info "$OUT" | sed -n '/Package:/,$p'
dpkg-deb --contents "$OUT"
