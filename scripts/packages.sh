# Sourced by scripts/*.sh and benches/*/run.sh: installs missing Debian packages.
#
# install_missing PKG...   installs those of PKG... that dpkg does not have, with
#                          --no-install-recommends (wireguard-tools would otherwise pull a kernel).
#                          Returns 1 and warns when some are missing and cannot be installed here
#                          (not root, or no apt-get).
install_missing() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null; then
        echo "==> installing ${missing[*]}" >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
    else
        echo "warning: missing packages (${missing[*]}) and cannot install them here" >&2
        return 1
    fi
}
