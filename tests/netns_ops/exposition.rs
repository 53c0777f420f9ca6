//! A strict reader of the Prometheus text exposition format, and a test that it rejects bad text.

use super::*;

/// A parsed exposition: every sample, and the declared type and help of every family.
#[derive(Debug, Default)]
pub(crate) struct Exposition {
    pub(crate) samples: Vec<Sample>,
    pub(crate) types: BTreeMap<String, String>,
    pub(crate) helps: BTreeMap<String, String>,
}

impl Exposition {
    /// The value of the one sample `name` whose labels include `labels` (`None` if absent;
    /// every sample also has `interface`, which [`scrape`] checks).
    pub(crate) fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let found: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .collect();
        assert!(found.len() <= 1, "{name} {labels:?} appears twice");
        found.first().copied()
    }

    /// [`Exposition::value`] that must exist.
    pub(crate) fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.value(name, labels)
            .unwrap_or_else(|| panic!("no sample {name} {labels:?} in /metrics"))
    }

    /// The family a sample name belongs to: itself, or `x` for `x_total` of a counter `x`.
    pub(crate) fn family_of(&self, sample: &str) -> Option<(String, String)> {
        // A counter's samples are `x_total`, typed `# TYPE x_total counter` (the classic
        // format, which types a sample by its own name) or `# TYPE x counter` (OpenMetrics);
        // never the bare family name.
        if let Some(t) = self
            .types
            .get(sample)
            .filter(|t| *t != "counter" || sample.ends_with("_total"))
        {
            return Some((sample.to_string(), t.clone()));
        }
        let base = sample.strip_suffix("_total")?;
        match self.types.get(base) {
            Some(t) if t == "counter" => Some((base.to_string(), t.clone())),
            _ => None,
        }
    }
}

/// Parses Prometheus text strictly: only `# HELP`, `# TYPE` (types the classic parser knows),
/// `# UNIT` and a final `# EOF` as comments; no blank lines; every sample belongs to a family
/// declared by a `# TYPE` line before it (a counter `x` owns `x_total`); a family's lines are
/// contiguous; at most one HELP and TYPE per family; no series (name + label set) twice; the
/// text ends with a newline.
pub(crate) fn parse_exposition(text: &str) -> Result<Exposition, String> {
    if !text.ends_with('\n') {
        return Err("the text does not end with a newline".into());
    }
    let mut ex = Exposition::default();
    let mut series: BTreeSet<(String, Vec<(String, String)>)> = BTreeSet::new();
    let mut closed: BTreeSet<String> = BTreeSet::new();
    let mut current: Option<String> = None;
    let mut eof = false;
    // Moves on to `family`, refusing to come back to one that was left.
    let mut enter = |family: &str, current: &mut Option<String>| -> Result<(), String> {
        if current.as_deref() != Some(family) {
            if closed.contains(family) {
                return Err(format!("lines of {family} are not contiguous"));
            }
            if let Some(prev) = current.take() {
                closed.insert(prev);
            }
            *current = Some(family.to_string());
        }
        Ok(())
    };
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let err = |e: String| format!("line {n}: {e}: {line:?}");
        if eof {
            return Err(err("text after # EOF".into()));
        }
        if line.is_empty() {
            return Err(err("empty line".into()));
        }
        if line == "# EOF" {
            eof = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let rest = rest
                .strip_prefix(' ')
                .ok_or_else(|| err("bad comment".into()))?;
            let (kind, rest) = rest
                .split_once(' ')
                .ok_or_else(|| err("bad comment".into()))?;
            let (name, arg) = rest.split_once(' ').unwrap_or((rest, ""));
            if !valid_metric_name(name) {
                return Err(err(format!("bad family name {name:?}")));
            }
            enter(name, &mut current).map_err(&err)?;
            match kind {
                "TYPE" => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&arg) {
                        return Err(err(format!("type {arg:?} unknown to the classic parser")));
                    }
                    if ex.types.insert(name.into(), arg.into()).is_some() {
                        return Err(err(format!("second TYPE for {name}")));
                    }
                }
                "HELP" => {
                    if ex.helps.insert(name.into(), arg.into()).is_some() {
                        return Err(err(format!("second HELP for {name}")));
                    }
                }
                "UNIT" => {}
                _ => return Err(err(format!("unknown comment kind {kind:?}"))),
            }
            continue;
        }
        let sample = parse_sample_line(line).map_err(err)?;
        let (family, ty) = ex
            .family_of(&sample.name)
            .ok_or_else(|| err(format!("{} has no # TYPE before it", sample.name)))?;
        if ty == "counter" && sample.value < 0.0 {
            return Err(err("negative counter".into()));
        }
        enter(&family, &mut current).map_err(&err)?;
        let key = (
            sample.name.clone(),
            sample.labels.clone().into_iter().collect::<Vec<_>>(),
        );
        if !series.insert(key) {
            return Err(err("duplicate series".into()));
        }
        ex.samples.push(sample);
    }
    Ok(ex)
}

/// `GET /metrics`, parsed strictly (panics with the text if it does not parse). Every series
/// carries the daemon's `interface` label, and the standard `process_*` metrics are there.
pub(crate) fn scrape(tg: &Tunnelgate) -> (String, Exposition) {
    let text = tg.metrics().unwrap_or_else(|e| panic!("GET /metrics: {e}"));
    let ex = parse_exposition(&text)
        .unwrap_or_else(|e| panic!("/metrics is not valid Prometheus text: {e}\n{text}"));
    for s in &ex.samples {
        assert_eq!(
            s.labels.get("interface").map(String::as_str),
            Some(tg.name()),
            "{} without the interface label",
            s.name
        );
    }
    for name in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(ex.get(name, &[]) > 0.0, "{name} in\n{text}");
    }
    // CPU time is counted in 10 ms clock ticks: a daemon that has only started and shaken
    // hands may honestly have spent none. It must be there; it must move under traffic
    // (checked where the test has sent some).
    assert!(
        ex.get("process_cpu_seconds_total", &[]) >= 0.0,
        "process_cpu_seconds_total in\n{text}"
    );
    assert_eq!(
        ex.types
            .get("process_cpu_seconds_total")
            .map(String::as_str),
        Some("counter"),
        "the classic body types a counter by its sample name"
    );
    assert!(
        !text.contains("# EOF"),
        "no OpenMetrics-only line in the classic body"
    );
    (text, ex)
}

#[test]
fn the_exposition_checker_rejects_bad_text() {
    let ok =
        "# HELP a An a.\n# TYPE a counter\na_total{x=\"1\"} 2\n# TYPE b gauge\nb 1.5e3\n# EOF\n";
    parse_exposition(ok).unwrap_or_else(|e| panic!("{e}"));
    for (bad, why) in [
        ("a 1\n", "no TYPE"),
        ("# TYPE a gauge\na one\n", "bad value"),
        ("# TYPE a gauge\na inf\n", "rust-only float"),
        ("# TYPE a gauge\na{x=1} 1\n", "unquoted label"),
        ("# TYPE a gauge\na{x=\"1\" y=\"2\"} 1\n", "no comma"),
        ("# TYPE a gauge\na{x=\"1\",x=\"2\"} 1\n", "label twice"),
        ("# TYPE a gauge\na{x=\"\\t\"} 1\n", "bad escape"),
        ("# TYPE a info\na 1\n", "info type"),
        ("# TYPE a counter\na 1\n", "counter without _total"),
        ("# TYPE a gauge\na 1\na 2\n", "duplicate series"),
        ("# TYPE a gauge\n# TYPE a gauge\na 1\n", "second TYPE"),
        ("# TYPE a gauge\na 1\n\n", "blank line"),
        ("# TYPE a gauge\na 1", "no final newline"),
        ("# TYPE a gauge\na 1\n# EOF\na 2\n", "after EOF"),
        (
            "# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\na{x=\"1\"} 1\n",
            "interleaved",
        ),
        ("# TYPE a counter\na_total -1\n", "negative counter"),
        ("# TYPE a gauge\na  1\n", "two spaces"),
        ("# TYPE 1a gauge\n1a 1\n", "bad name"),
        ("#TYPE a gauge\na 1\n", "bad comment"),
    ] {
        assert!(parse_exposition(bad).is_err(), "accepted ({why}): {bad:?}");
    }
}
