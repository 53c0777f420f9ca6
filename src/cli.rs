//! Command-line plumbing both binaries share: how a parse failure becomes an exit status.

use clap::Parser;
use std::process::ExitCode;

/// Parses the command line. `--help` and `--version` print and exit 0; a usage error prints
/// and exits 2, as documented in the contract.
pub fn parse_or_exit<C: Parser>() -> Result<C, ExitCode> {
    C::try_parse().map_err(|e| {
        let _ = e.print();
        if e.use_stderr() {
            ExitCode::from(2)
        } else {
            ExitCode::SUCCESS
        }
    })
}
