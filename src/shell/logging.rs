//! Logging setup: tracing to stderr, human-readable or JSON, level from `RUST_LOG`.
//!
//! When stderr is the systemd journal (`JOURNAL_STREAM` names stderr's device and inode) the
//! human format becomes the journal's: each event is one line with the sd-daemon `<N>` priority
//! prefix from its level, no timestamp (the journal has its own), and the newlines inside a
//! message written as `\n` so a multi-line error stays one entry. JSON stays JSON.
//!
//! The format comes from `--log-format` or the environment variable [`LOG_FORMAT_ENV`]
//! (declare the flag with `#[arg(long, value_enum, env = LOG_FORMAT_ENV, default_value_t)]`,
//! or pass its value to [`LogFormat::from_var`]). What is logged is the callers' business: one line per
//! meaningful event, never per packet, never a key.

use std::fmt;
use std::io::IsTerminal as _;
use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// The environment variable that selects the log format (`human` or `json`).
pub const LOG_FORMAT_ENV: &str = "TUNNELGATE_LOG_FORMAT";

/// How log lines look.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One readable line per event (the default).
    #[default]
    #[value(alias = "text")]
    Human,
    /// One JSON object per line, for log collectors.
    Json,
    /// Entries for the systemd journal, priority from the level (chosen by itself under systemd).
    Journal,
}

/// A log format name that is none of `human`, `json`, `journal`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown log format {0:?}: expected \"human\", \"json\" or \"journal\"")]
pub struct UnknownLogFormat(pub String);

impl FromStr for LogFormat {
    type Err = UnknownLogFormat;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "human" | "text" => Ok(LogFormat::Human),
            "json" => Ok(LogFormat::Json),
            "journal" => Ok(LogFormat::Journal),
            _ => Err(UnknownLogFormat(s.to_string())),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Human => "human",
            LogFormat::Json => "json",
            LogFormat::Journal => "journal",
        })
    }
}

impl LogFormat {
    /// The format the variable's value (clap's, through `--log-format`) asks for: unset or blank is `Human`; a value
    /// that is not UTF-8 is as unknown as a typo.
    pub fn from_var(
        value: Result<String, std::env::VarError>,
    ) -> Result<LogFormat, UnknownLogFormat> {
        match value {
            Ok(v) if !v.trim().is_empty() => v.parse(),
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(LogFormat::Human),
            Err(std::env::VarError::NotUnicode(v)) => {
                Err(UnknownLogFormat(v.to_string_lossy().into_owned()))
            }
        }
    }
}

/// True when `journal_stream` (the value of `JOURNAL_STREAM`, `DEV:INODE` in decimal) names the
/// file whose device and inode are `dev` and `ino`: systemd connected it to the journal.
pub fn is_journal_stream(journal_stream: Option<&str>, dev: u64, ino: u64) -> bool {
    let Some((d, i)) = journal_stream.and_then(|v| v.trim().split_once(':')) else {
        return false;
    };
    d.parse() == Ok(dev) && i.parse() == Ok(ino)
}

/// Whether this process's stderr is the journal.
fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(value) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    is_journal_stream(Some(&value), meta.dev(), meta.ino())
}

/// The sd-daemon priority of a level (`<3>` error ... `<7>` debug).
pub fn journal_priority(level: tracing::Level) -> u8 {
    match level {
        tracing::Level::ERROR => 3,
        tracing::Level::WARN => 4,
        tracing::Level::INFO => 6,
        _ => 7,
    }
}

/// One journal line: `<N>` and the event's text with its inner newlines written as `\n`.
pub fn journal_line(level: tracing::Level, text: &str) -> String {
    let body = text.trim_end_matches('\n').replace('\n', "\\n");
    format!("<{}>{body}\n", journal_priority(level))
}

/// Collects one event's text and writes it to stderr as one [`journal_line`] when dropped.
pub struct JournalWriter {
    level: tracing::Level,
    buf: Vec<u8>,
}

impl std::io::Write for JournalWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for JournalWriter {
    fn drop(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let line = journal_line(self.level, &String::from_utf8_lossy(&self.buf));
        // One write per entry, so entries of concurrent threads do not interleave.
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
}

/// The [`tracing_subscriber::fmt::MakeWriter`] of the journal format.
struct JournalMakeWriter;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for JournalMakeWriter {
    type Writer = JournalWriter;
    fn make_writer(&'a self) -> JournalWriter {
        JournalWriter {
            level: tracing::Level::INFO,
            buf: Vec::new(),
        }
    }
    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> JournalWriter {
        JournalWriter {
            level: *meta.level(),
            buf: Vec::new(),
        }
    }
}

/// Installs the global tracing subscriber: `format` lines on stderr, filtered by `RUST_LOG`
/// (default `info`). An invalid `RUST_LOG` falls back to `info` with a warning. Calling it
/// again (tests) leaves the first subscriber in place.
pub fn init_logging(format: LogFormat) {
    let (filter, bad_filter) = match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(spec) if !spec.trim().is_empty() => match EnvFilter::try_new(&spec) {
            Ok(f) => (f, None),
            Err(e) => (EnvFilter::new("info"), Some(format!("{spec:?}: {e}"))),
        },
        Err(std::env::VarError::NotUnicode(spec)) => {
            (EnvFilter::new("info"), Some(format!("{spec:?}: not UTF-8")))
        }
        _ => (EnvFilter::new("info"), None),
    };
    let format = match format {
        LogFormat::Human if stderr_is_journal() => LogFormat::Journal,
        f => f,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Journal => builder
            .with_writer(JournalMakeWriter)
            .with_ansi(false)
            .without_time()
            .with_level(false)
            .with_target(false)
            .try_init(),
        LogFormat::Human => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
    if installed.is_ok() {
        if let Some(problem) = bad_filter {
            tracing::warn!("ignoring invalid RUST_LOG {problem}; logging at info");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum as _;

    #[test]
    fn parses_format_names() {
        assert_eq!("human".parse(), Ok(LogFormat::Human));
        assert_eq!("text".parse(), Ok(LogFormat::Human));
        assert_eq!(" JSON ".parse(), Ok(LogFormat::Json));
        assert_eq!(
            "yaml".parse::<LogFormat>(),
            Err(UnknownLogFormat("yaml".into()))
        );
        assert_eq!(LogFormat::default(), LogFormat::Human);
    }

    #[test]
    fn value_enum_matches_display() {
        for f in LogFormat::value_variants() {
            let name = f.to_possible_value().expect("not skipped");
            assert_eq!(name.get_name(), f.to_string());
            assert_eq!(
                <LogFormat as clap::ValueEnum>::from_str(name.get_name(), false),
                Ok(*f)
            );
        }
        assert_eq!(
            <LogFormat as clap::ValueEnum>::from_str("text", false),
            Ok(LogFormat::Human)
        );
    }

    #[test]
    fn works_as_a_clap_flag() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[arg(long, value_enum, default_value_t)]
            log_format: LogFormat,
        }
        let cli = Cli::try_parse_from(["x", "--log-format", "json"]).expect("parses");
        assert_eq!(cli.log_format, LogFormat::Json);
        let cli = Cli::try_parse_from(["x"]).expect("parses");
        assert_eq!(cli.log_format, LogFormat::Human);
        assert!(Cli::try_parse_from(["x", "--log-format", "xml"]).is_err());
    }

    #[test]
    fn journal_lines_carry_the_priority_and_stay_one_entry() {
        use tracing::Level;
        assert_eq!(
            journal_line(
                Level::ERROR,
                "Reload rejected error=invalid configuration:\n  interface.listen_port: bad\n"
            ),
            "<3>Reload rejected error=invalid configuration:\\n  interface.listen_port: bad\n"
        );
        assert_eq!(journal_line(Level::WARN, "w\n"), "<4>w\n");
        assert_eq!(journal_line(Level::INFO, "Tunnel up"), "<6>Tunnel up\n");
        assert_eq!(journal_line(Level::DEBUG, "d"), "<7>d\n");
        assert_eq!(journal_line(Level::TRACE, "t"), "<7>t\n");
        assert_eq!(journal_line(Level::INFO, "a\nb\nc").lines().count(), 1);
    }

    #[test]
    fn journal_stream_must_name_stderr_itself() {
        assert!(is_journal_stream(Some("8:12345"), 8, 12345));
        assert!(!is_journal_stream(Some("8:12345"), 8, 12346));
        assert!(!is_journal_stream(Some("9:12345"), 8, 12345));
        assert!(!is_journal_stream(Some("garbage"), 8, 12345));
        assert!(!is_journal_stream(None, 8, 12345));
    }

    #[test]
    fn a_log_format_that_is_not_utf8_is_refused_like_a_typo() {
        use std::os::unix::ffi::OsStringExt as _;
        let not_utf8 = std::ffi::OsString::from_vec(b"js\xffon".to_vec());
        let err = LogFormat::from_var(Err(std::env::VarError::NotUnicode(not_utf8)))
            .expect_err("not UTF-8");
        assert!(err.to_string().contains("expected \"human\""), "{err}");
        assert_eq!(
            LogFormat::from_var(Err(std::env::VarError::NotPresent)),
            Ok(LogFormat::Human)
        );
        assert_eq!(LogFormat::from_var(Ok("  ".into())), Ok(LogFormat::Human));
        let huge = "j".repeat(1 << 20);
        assert!(LogFormat::from_var(Ok(huge)).is_err());
        // JOURNAL_STREAM: numbers too large for a device or inode name nothing.
        assert!(!is_journal_stream(Some("99999999999999999999999:1"), 8, 1));
        assert!(!is_journal_stream(Some(":"), 0, 0));
    }

    #[test]
    fn init_twice_is_harmless() {
        init_logging(LogFormat::Json);
        init_logging(LogFormat::Human);
        tracing::info!(check = true, "logging initialised twice");
    }
}
