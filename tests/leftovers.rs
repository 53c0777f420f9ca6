//! What the test suite keeps on the machine is what docs/testing.md lists, and its removal
//! block removes all of it: every path in `/var/tmp` a script or test uses, the
//! Containerfile's cache and every image `scripts/image.sh` tags.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// docs/testing.md's section on what the suite leaves, up to the next section.
fn section() -> String {
    let text = read("docs/testing.md");
    let start = text
        .find("**What it leaves behind")
        .expect("the section on what the suite leaves");
    let end = text[start..]
        .find("One test at a time")
        .map_or(text.len(), |e| start + e);
    text[start..end].to_string()
}

/// The removal block: the first ```text block of the section.
fn removal(section: &str) -> String {
    let start = section.find("```text\n").expect("a removal block") + 8;
    let end = section[start..].find("```").expect("its end") + start;
    section[start..end].to_string()
}

/// Every path in `/var/tmp` whose name starts `tunnelgate-`, in the files under `dir` but this
/// one (host paths; a path inside a test's root, such as `/var/tmp/tunnelgate.deb`, has no dash).
fn var_tmp_paths(dir: &Path, out: &mut BTreeSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            var_tmp_paths(&p, out);
            continue;
        }
        if p.ends_with("tests/leftovers.rs") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&p) else {
            continue;
        };
        for (i, _) in text.match_indices("/var/tmp/tunnelgate-") {
            let name: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "/-_.".contains(*c))
                .collect();
            out.insert(name.trim_end_matches('.').to_string());
        }
    }
}

#[test]
fn every_path_the_suite_keeps_is_listed_and_removed() {
    let mut paths = BTreeSet::new();
    for dir in ["scripts", "tests"] {
        var_tmp_paths(&root().join(dir), &mut paths);
    }
    paths.remove("/var/tmp/tunnelgate-");
    for expected in [
        "/var/tmp/tunnelgate-test-rootfs",
        "/var/tmp/tunnelgate-image-rootfs",
        "/var/tmp/tunnelgate-kubernetes-validate",
    ] {
        assert!(
            paths.contains(expected),
            "the reader finds {expected}: {paths:?}"
        );
    }
    paths.insert("/var/tmp/buildah-cache".into());
    let section = section();
    let removal = removal(&section);
    for path in &paths {
        assert!(
            section.contains(&format!("`{path}`")),
            "{path} is not in the table"
        );
        assert!(removal.contains(path), "{path} is not removed:\n{removal}");
    }
}

#[test]
fn every_image_the_image_script_tags_is_listed_and_removed() {
    let script = read("scripts/image.sh");
    let section = section();
    let removal = removal(&section);
    let mut images = vec![
        "localhost/tunnelgate:latest",
        "localhost/tunnelgate:host-binaries",
    ];
    for var in ["BASE=", "DOC_BASE=", "DOC_BUILDER="] {
        let line = script
            .lines()
            .find(|l| l.starts_with(var))
            .unwrap_or_else(|| panic!("scripts/image.sh sets {var}"));
        images.push(&line[var.len()..]);
    }
    assert!(read("scripts/test.sh").contains("localhost/tunnelgate:host-binaries"));
    for image in images {
        assert!(
            section.contains(&format!("`{image}`")),
            "{image} is not in the table"
        );
        assert!(
            removal.contains(image),
            "{image} is not removed:\n{removal}"
        );
    }
}

/// The README says how much disk a build and the suite take, with the figures of the section.
#[test]
fn the_readme_says_how_much_disk_the_suite_needs() {
    let readme = read("README.md");
    let section = section();
    for figure in ["25 GB", "19 GB", "3.5 GB"] {
        assert!(section.contains(figure), "docs/testing.md: {figure}");
        assert!(readme.contains(figure), "README.md: {figure}");
    }
    assert!(readme.contains("0.5 GB"), "the release build's size");
}
