//! Logging setup: tracing to stderr, human-readable or JSON, level from `RUST_LOG`.
//!
//! The format comes from `--log-format` or the environment variable [`LOG_FORMAT_ENV`]
//! (declare the flag with `#[arg(long, value_enum, env = LOG_FORMAT_ENV, default_value_t)]`,
//! or call [`LogFormat::from_env`]). What is logged is the callers' business: one line per
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
}

/// A log format name that is neither `human` nor `json`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown log format {0:?}: expected \"human\" or \"json\"")]
pub struct UnknownLogFormat(pub String);

impl FromStr for LogFormat {
    type Err = UnknownLogFormat;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "human" | "text" => Ok(LogFormat::Human),
            "json" => Ok(LogFormat::Json),
            _ => Err(UnknownLogFormat(s.to_string())),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Human => "human",
            LogFormat::Json => "json",
        })
    }
}

impl LogFormat {
    /// The format [`LOG_FORMAT_ENV`] asks for; `Human` when it is unset. An invalid value is
    /// an error, so a typo does not silently change what a log collector receives.
    pub fn from_env() -> Result<LogFormat, UnknownLogFormat> {
        match std::env::var(LOG_FORMAT_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse(),
            _ => Ok(LogFormat::Human),
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
        _ => (EnvFilter::new("info"), None),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
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
    fn init_twice_is_harmless() {
        init_logging(LogFormat::Json);
        init_logging(LogFormat::Human);
        tracing::info!(check = true, "logging initialised twice");
    }
}
