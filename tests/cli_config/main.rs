//! The command line without a running tunnel (no root needed): `genkey`/`pubkey`, and every bad
//! configuration input of issue 2 through both `tunnelgate check` and `tunnelgate run` — exit
//! code 2, a message naming the key, the bad value (never a secret) and what is expected, and
//! nothing changed on the system. `check` on the shipped example prints the plan and changes
//! nothing.
//!
//! These run as plain `#[test]`s; CI runs them as root too, which is why `run` is always given a
//! unique interface name and a deadline, and the tests check that no interface or socket appeared.

#[path = "../common/mod.rs"]
mod common;

use common::{tunnelgate_bin, unique_name, wg_socket, CmdOutput, Proc, TempDir};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// RFC 7748 section 6.1: Alice's X25519 private key and its public key, base64.
const RFC7748_PRIVATE: &str = "dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=";
const RFC7748_PUBLIC: &str = "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo=";

/// Two fixed peer public keys (any 32 bytes are a valid public key).
const PUB_B: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const PUB_C: &str = "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";

/// Where the daemon puts its status socket (the harness does not override it).
const STATUS_DIR: &str = "/var/run/tunnelgate";

mod bad_cases;
mod bad_input;
mod check;
mod gzip_env;
mod keys;

use bad_input::*;
use keys::*;
