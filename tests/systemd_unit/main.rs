//! `systemd/tunnelgate.service`: it passes `systemd-analyze verify`, says what the contract and
//! issue 5 ask for; the template `systemd/tunnelgate@.service` (one instance per interface,
//! issue 14) passes it too and differs from the plain unit only in its Description and config
//! file; and the daemon started the way the unit starts it (its ExecStart, its
//! capability bounding set, `NOTIFY_SOCKET`, its ExecReload) reports READY=1 once the tunnel,
//! routes and rules are up, RELOADING=1 / READY=1 around a SIGHUP, and STOPPING=1 on SIGTERM;
//! it pings the watchdog (`WATCHDOG_USEC`) only while every packet thread is alive; and under
//! a real systemd (booted in systemd-nspawn) `systemctl reload` reports a refused file, and a
//! wedged packet thread or a stalled event loop gets the service killed by the watchdog and
//! restarted. The Debian package (scripts/deb.sh) installs into a clean Debian root with its
//! files and modes, its units pass `systemd-analyze verify` and start the packaged daemon under
//! a booted systemd, an upgrade restarts it (and says so when the restart fails), and `apt
//! remove`/`apt purge` (and `dpkg -r`/`-P`) stop its tunnelgate-wg daemons too and take away
//! everything of the package's but the admin's key and config, saying so.
//!
//! The last tests need root: `cargo test --test systemd_unit -- --ignored --test-threads=1`.
#![allow(unsafe_code)] // ptrace(2), to freeze one packet thread of the running service.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tunnelgate::shell::clock;

mod booted;
mod container;
mod deb_package;
mod started;
mod unit_file;

use container::*;
use unit_file::*;
