#!/usr/bin/env bash
# Builds the Debian package: target/debian/tunnelgate_<version>-<revision>_<arch>.deb
#
#   scripts/deb.sh [--prebuilt DIR | --no-build]
#
#   (default)        cargo build --release --locked --bin tunnelgate, then package it
#   --prebuilt DIR   package DIR/tunnelgate as it is
#   --no-build       package target/release/tunnelgate as it is
#
# The files are exactly what scripts/install.sh installs, staged with DESTDIR and PREFIX=/usr:
# /usr/bin/tunnelgate, the /usr/bin/tunnelgate-wg link, both units in /usr/lib/systemd/system
# (ExecStart=/usr/bin/tunnelgate ...), the docs and example configs in
# /usr/share/doc/tunnelgate, and /etc/tunnelgate, mode 0700, owned by the package. The control
# fields come from [package.metadata.deb] in Cargo.toml; its `$auto` becomes the shared
# libraries the binary links, as dpkg-shlibdeps finds them. The maintainer scripts are in
# packaging/deb. Needs dpkg-dev (dpkg-shlibdeps), python3 (to read Cargo.toml) and, to build,
# cargo. The install and its ways out: README.md, "Install".
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
for tool in dpkg-deb dpkg-shlibdeps python3; do
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
print("description=" + package["description"])
for key in ["maintainer", "section", "priority", "revision", "depends", "recommends",
            "maintainer-scripts", "extended-description"]:
    print(key + "=" + " ".join(str(deb[key]).split()))
EOF
)"
field() { sed -n "s/^$1=//p" <<<"$fields"; }
NAME="$(field name)"
VERSION="$(field version)-$(field revision)"
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
    DOCDIR="/usr/share/doc/$NAME" scripts/install.sh --prebuilt "$SRC" 2>"$install_log"; then
    cat "$install_log" >&2
    exit 1
fi
cat >"$STAGE/usr/share/doc/$NAME/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: $NAME

Files: *
License: $(field license)
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
EOF
chmod 0644 "$STAGE/usr/share/doc/$NAME/copyright"

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
    echo "Description: $(field description)"
    field extended-description | fold -s -w 78 | sed -e 's/ *$//' -e 's/^/ /'
} >"$STAGE/DEBIAN/control"
for script in preinst postinst prerm postrm; do
    if [[ -f "$(field maintainer-scripts)/$script" ]]; then
        install -m 0755 "$(field maintainer-scripts)/$script" "$STAGE/DEBIAN/$script"
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
