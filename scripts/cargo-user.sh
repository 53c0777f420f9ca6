# Sourced by scripts/demo.sh and scripts/test.sh: the cargo of the person who typed the command.
#
# `sudo scripts/demo.sh` runs as root with sudo's secure_path, which drops ~/.cargo/bin, where
# rustup puts cargo: root has no cargo of its own on most machines. These helpers find the cargo
# of the user who ran sudo (SUDO_USER), as scripts/install.sh builds with the user's cargo and
# asks sudo only for what needs root.
#
# cargo_as_user ARGS...   cargo ARGS as the invoking user when the checkout is theirs (run with
#                         sudo): the build's files stay theirs. Otherwise (root itself, or a
#                         checkout that is not theirs) cargo as the caller, with their toolchain.
# use_users_toolchain     for cargo that must run as root (tests that need root): puts the
#                         invoking user's ~/.cargo/bin on PATH and their rustup toolchains in
#                         RUSTUP_HOME when root has no cargo; CARGO_HOME stays root's, so nothing
#                         root writes lands in the user's home.
# describe_cargo MODE     prints how cargo would run (MODE: user or root) and its `--version`;
#                         fails, saying how to get Rust, when there is none. The scripts'
#                         --print-cargo flag runs it and exits.
# as_toolchain_owner CMD  CMD as the user whose toolchain use_users_toolchain borrowed (rustup
#                         component add writes into their ~/.rustup), else as the caller.
# give_back_build_dirs    hands target/ and fuzz/target/ back to the invoking user when the
#                         checkout is theirs (what root built there would stop their own cargo).
# no_cargo_help           the message for no cargo at all.

# The user who ran sudo, when we are root through sudo; empty otherwise.
invoking_user() {
    if [[ "$(id -u)" == "0" && -n "${SUDO_USER:-}" && "${SUDO_USER}" != "root" ]]; then
        echo "$SUDO_USER"
    fi
}

user_home() { getent passwd "$1" | cut -d: -f6; }

# The PATH the invoking user's cargo is on: rustup's ~/.cargo/bin first, then root's PATH.
user_cargo_path() {
    local home
    home="$(user_home "$1")"
    echo "${home:+$home/.cargo/bin:}$PATH"
}

# True when the checkout (the current directory) belongs to USER.
checkout_is_users() { [[ "$(stat -c %U .)" == "$1" ]]; }

no_cargo_help() {
    local script="$1"
    echo "$script: no cargo found (on PATH${SUDO_USER:+, nor in ~$SUDO_USER/.cargo/bin}). Install Rust (>= $(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)) with rustup, as yourself:" >&2
    echo "  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh" >&2
    echo "then run: sudo $script" >&2
}

# The invoking user's cargo, when we build as them: set, the user has a cargo and the checkout is
# theirs.
builds_as_user() {
    local user
    user="$(invoking_user)"
    [[ -n "$user" ]] && checkout_is_users "$user" &&
        runuser -u "$user" -- env PATH="$(user_cargo_path "$user")" sh -c 'command -v cargo'
}

cargo_as_user() {
    local user
    user="$(invoking_user)"
    if builds_as_user >/dev/null; then
        runuser -u "$user" -- env HOME="$(user_home "$user")" PATH="$(user_cargo_path "$user")" cargo "$@"
    else
        use_users_toolchain
        cargo "$@"
    fi
}

use_users_toolchain() {
    command -v cargo >/dev/null 2>&1 && return 0
    local user home
    user="$(invoking_user)"
    [[ -n "$user" ]] || return 0
    home="$(user_home "$user")"
    [[ -n "$home" && -x "$home/.cargo/bin/cargo" ]] || return 0
    export PATH="$home/.cargo/bin:$PATH"
    TOOLCHAIN_OWNER="$user"
    if [[ -z "${RUSTUP_HOME:-}" && -d "$home/.rustup" ]]; then
        export RUSTUP_HOME="$home/.rustup"
    fi
    # Root's own cargo home for the registry and git checkouts, whatever HOME sudo kept.
    export CARGO_HOME="${CARGO_HOME:-$(user_home root)/.cargo}"
}

describe_cargo() { # describe_cargo user|root SCRIPT
    local mode="$1" script="$2" found
    if [[ "$mode" == "user" ]] && found="$(builds_as_user)"; then
        echo "cargo: $found, run as $(invoking_user)"
    else
        use_users_toolchain
        command -v cargo >/dev/null 2>&1 || { no_cargo_help "$script"; return 1; }
        echo "cargo: $(command -v cargo), run as $(id -un)"
    fi
    if [[ "$mode" == "user" ]]; then cargo_as_user --version; else cargo --version; fi
}

TOOLCHAIN_OWNER=""
as_toolchain_owner() {
    if [[ -n "$TOOLCHAIN_OWNER" ]]; then
        runuser -u "$TOOLCHAIN_OWNER" -- env HOME="$(user_home "$TOOLCHAIN_OWNER")" \
            PATH="$(user_cargo_path "$TOOLCHAIN_OWNER")" "$@"
    else
        "$@"
    fi
}

give_back_build_dirs() {
    local user d
    user="$(invoking_user)"
    [[ -n "$user" ]] && checkout_is_users "$user" || return 0
    for d in target fuzz/target; do
        [[ -d "$d" ]] && chown -R "$user:" "$d"
    done
    return 0
}
