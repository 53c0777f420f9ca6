//! Every relative link in the pages a user reads (README.md, CHANGELOG.md, docs/,
//! containers/README.md, each bench's README) points to a file of the repository, and every
//! `#anchor` on one of those pages to a heading it has: a run file a table cites, a page moved
//! into docs/, a renamed section.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The pages: Markdown files outside target/, .git and the vendored crates.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![
        root().join("README.md"),
        root().join("CHANGELOG.md"),
        root().join("containers/README.md"),
    ];
    for dir in ["docs", "benches"] {
        let mut stack = vec![root().join(dir)];
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "md") {
                    pages.push(p);
                }
            }
        }
    }
    pages.sort();
    pages
}

/// `](target)` links of a Markdown text, outside code blocks and code spans.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block {
            continue;
        }
        // Drop code spans: a `](x)` inside backticks is not a link.
        let prose: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, part)| part)
            .collect::<Vec<_>>()
            .join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_string());
                rest = &rest[end..];
            }
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut in_block = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
        } else if !in_block && line.starts_with('#') {
            out.insert(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

fn relative(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn every_relative_link_and_anchor_in_the_pages_resolves() {
    let mut broken = Vec::new();
    let pages = pages();
    assert!(pages.len() > 10, "found only {pages:?}");
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap_or_default();
        for link in links(&text) {
            let link = link.split_whitespace().next().unwrap_or_default();
            if link.is_empty() || link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = link.split_once('#').unwrap_or((link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap_or(Path::new(".")).join(file)
            };
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", relative(page)));
                continue;
            }
            if !fragment.is_empty() && target.extension().is_some_and(|x| x == "md") {
                let there = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&there).contains(fragment) {
                    broken.push(format!("{}: {link} (no such heading)", relative(page)));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The checker itself finds what it is for: a missing file, a missing heading, and not a
/// link inside code.
#[test]
fn the_link_checker_reads_links_and_headings_as_github_does() {
    assert_eq!(
        links("see [a](x.md#b-c) and `[not](y)`\n```\n[no](z)\n```\n[c](../d.json)"),
        ["x.md#b-c", "../d.json"]
    );
    assert!(
        anchors("# Title\n## How a replica is configured\n```\n# not\n```")
            .contains("how-a-replica-is-configured")
    );
    assert_eq!(anchor(" Floods: under `load`, 2x"), "floods-under-load-2x");
}

/// No page a user reads names one of the project's issue numbers ("issue 44"): a page shows the
/// present, and history lives in CHANGELOG.md and the run files.
#[test]
fn no_page_names_an_issue_number() {
    let mut named = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            let mut rest = lower.as_str();
            while let Some(at) = rest.find("issue ") {
                rest = &rest[at + "issue ".len()..];
                if rest.starts_with(|c: char| c.is_ascii_digit()) {
                    named.push(format!("{}:{}: {line}", relative(&page), n + 1));
                    break;
                }
            }
        }
    }
    assert!(
        named.is_empty(),
        "pages naming an issue:\n{}",
        named.join("\n")
    );
}
