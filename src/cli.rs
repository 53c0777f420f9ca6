//! Command-line plumbing both binaries share: how a parse failure becomes an exit status, and
//! the manual pages generated from a command's clap definition.

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

/// The manual pages of `cmd`, each a file name and its text, in section 8 (system administration): one for
/// the command (`tunnelgate.8`) and one for each command under it (`tunnelgate-run.8`,
/// `tunnelgate-import-wg-quick.8`), generated from the clap definition the command line is
/// parsed with, so that they say what `--help` says. Hidden commands and `help` get none.
/// Each page ends with the exit status and a SEE ALSO; the first also names the files.
/// Rendered in memory: the caller writes them (`tunnelgate man DIR`).
pub fn man_pages(cmd: clap::Command) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut cmd = cmd.disable_help_subcommand(true);
    // A `help` command of the program's own prints what these pages say: no page of its own.
    if cmd.find_subcommand("help").is_some() {
        cmd = cmd.mut_subcommand("help", |help| help.hide(true));
    }
    cmd.build();
    let mut pages = vec![];
    render_page(&cmd, None, &mut pages)?;
    Ok(pages)
}

/// The page of `cmd` (`parent`: the page of the command it belongs to), then those of its
/// subcommands.
fn render_page(
    cmd: &clap::Command,
    parent: Option<&str>,
    pages: &mut Vec<(String, Vec<u8>)>,
) -> std::io::Result<()> {
    let man = clap_mangen::Man::new(cmd.clone())
        .section("8")
        .source(format!("tunnelgate {}", env!("CARGO_PKG_VERSION")))
        .manual("System Administration");
    let mut page = vec![];
    man.render(&mut page)?;
    let name = cmd
        .get_display_name()
        .unwrap_or_else(|| cmd.get_name())
        .to_string();
    page.extend_from_slice(EXIT_STATUS.as_bytes());
    match parent {
        None => {
            page.extend_from_slice(FILES.as_bytes());
            page.extend_from_slice(b".SH \"SEE ALSO\"\n\\fBwg\\fR(8), \\fBwg\\-quick\\fR(8)\n");
        }
        Some(parent) => page.extend_from_slice(
            format!(
                ".SH \"SEE ALSO\"\n\\fB{}\\fR(8)\n",
                parent.replace('-', "\\-")
            )
            .as_bytes(),
        ),
    }
    pages.push((man.get_filename(), page));
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        render_page(sub, Some(&name), pages)?;
    }
    Ok(())
}

const EXIT_STATUS: &str = ".SH \"EXIT STATUS\"
0 on success, 1 on a failure at run time, 2 on bad usage or an invalid configuration.
";

const FILES: &str = ".SH FILES
.TP
\\fI/etc/tunnelgate/tunnelgate.toml\\fR
The configuration \\fBtunnelgate run\\fR and \\fBcheck\\fR read by default (also \\fB$TUNNELGATE_CONFIG\\fR); its folder, mode 0700, holds the keys.
.TP
\\fI/etc/tunnelgate/NAME.toml\\fR
The configuration of the unit instance \\fBtunnelgate@NAME.service\\fR.
.TP
\\fI/var/run/wireguard/NAME.sock\\fR
The running tunnel's WireGuard UAPI socket: \\fBwg show NAME\\fR and \\fBwg set NAME\\fR work with it.
.TP
\\fI/usr/share/doc/tunnelgate/\\fR
The documentation and example configurations.
.PP
\\fBtunnelgate\\-wg\\fR, a link to \\fBtunnelgate\\fR, is \\fBtunnelgate userspace\\fR under the command line of \\fBwireguard\\-go\\fR, for wg-quick's \\fBWG_QUICK_USERSPACE_IMPLEMENTATION\\fR.
";
