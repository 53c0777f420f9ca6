//! What the health endpoint answers that needs no socket: its content types and the bound on
//! a `/metrics` body ([`bound_metrics`]). The server is `shell::serve::health`.

/// The classic Prometheus text format.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// OpenMetrics text, for scrapers that ask for it (the classic body is
/// [`super::classic_text`] of it).
pub const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const PLAIN_TEXT: &str = "text/plain; charset=utf-8";
/// The comment that starts the last line of a truncated `/metrics` body.
pub const TRUNCATED_COMMENT: &str = "# tunnelgate: /metrics truncated";

/// `body` if it fits in `max` bytes; else its longest prefix of whole lines that leaves room
/// for a comment line saying it was cut (and `# EOF`, which OpenMetrics parsers require).
///
/// Truncated rather than refused with a 503: the metrics render the process-wide series
/// (`build_info`, `ready`) first, so a cut body still carries what alerts are built on, and
/// the comment tells whoever reads it why peers are missing; a 503 would lose everything. The
/// body only grows with the configured peers, rules and resolved names (64 addresses per
/// name at most), so this is a guard against a mistake, not a normal state.
pub fn bound_metrics(body: String, max: usize) -> String {
    if body.len() <= max {
        return body;
    }
    let note = format!(
        "{TRUNCATED_COMMENT} at {max} bytes ({} rendered); `tunnelgate status --json` has everything\n# EOF\n",
        body.len()
    );
    let room = max.saturating_sub(note.len());
    // Bytes, not `str` slicing: a label value may hold multi-byte characters.
    let cut = body.as_bytes()[..room]
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |i| i + 1);
    tracing::warn!(
        rendered = body.len(),
        max,
        "health endpoint: /metrics truncated"
    );
    let mut out = body[..cut].to_string();
    out.push_str(&note);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_cut_at_a_line_with_a_comment() {
        let body = "a 1\nb 2\nc 3\n# EOF\n".to_string();
        assert_eq!(bound_metrics(body.clone(), 100), body);
        let long: String = (0..1000)
            .map(|i| format!("m{{n=\"é{i}\"}} {i}\n"))
            .collect();
        let cut = bound_metrics(long.clone(), 2000);
        assert!(cut.len() <= 2000, "{}", cut.len());
        assert!(long.starts_with(cut.split(TRUNCATED_COMMENT).next().unwrap_or("")));
        let lines: Vec<&str> = cut.lines().collect();
        assert!(
            lines[lines.len() - 2].starts_with(TRUNCATED_COMMENT),
            "{cut}"
        );
        assert_eq!(lines[lines.len() - 1], "# EOF");
        assert!(lines[..lines.len() - 2].iter().all(|l| l.starts_with('m')));
    }
}
