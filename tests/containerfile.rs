//! containers/Containerfile builds from exactly what it copies: the files its compile stage
//! `COPY`s from the context are a package Cargo can load (every `[[bin]]`, `[[test]]` and
//! `[[bench]]` target's file present), which is what the stage's `cargo build` needs first. No
//! registry or container runtime needed: Cargo loads a copy of just those files and is asked
//! for a binary that does not exist, which lists the real ones and compiles nothing.
//! Its stages are named literally (podman 4.3). The whole build, image and pod run with podman
//! in tests/sidecar_fake_api/pod_image.rs.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The sources of every `COPY` of the `build` stage (up to the next `FROM`), as written.
fn build_stage_copies(containerfile: &str) -> Vec<String> {
    let mut in_build = false;
    let mut sources = Vec::new();
    for line in containerfile.lines().map(str::trim) {
        if let Some(from) = line.strip_prefix("FROM ") {
            in_build = from.trim_end().ends_with(" AS build");
            continue;
        }
        if !in_build {
            continue;
        }
        if let Some(args) = line.strip_prefix("COPY ") {
            let words: Vec<&str> = args
                .split_whitespace()
                .filter(|w| !w.starts_with("--"))
                .collect();
            if let Some((_dest, srcs)) = words.split_last() {
                sources.extend(srcs.iter().map(|s| s.to_string()));
            }
        }
    }
    sources
}

fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).expect("mkdir");
        for entry in std::fs::read_dir(from).expect("read_dir").flatten() {
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    }
}

/// `cargo build` of the stage's features for a binary that does not exist, in `dir`: Cargo
/// loads the manifest and its targets, then stops, listing the binaries. Its stderr.
fn cargo_load(dir: &Path) -> String {
    let out = Command::new(env!("CARGO"))
        .args([
            "build",
            "--offline",
            "--locked",
            "--features",
            "sidecar",
            "--bin",
            "__none__",
        ])
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .output()
        .expect("run cargo");
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_build_stage_copies_a_package_cargo_can_load() {
    let text = std::fs::read_to_string(repo().join("containers/Containerfile")).expect("read");
    let sources = build_stage_copies(&text);
    assert!(
        sources.contains(&"Cargo.toml".to_string()) && sources.contains(&"src".to_string()),
        "{sources:?}"
    );
    let dir = std::env::temp_dir().join(format!("tg-containerfile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for src in &sources {
        copy_tree(&repo().join(src), &dir.join(src));
    }
    let stderr = cargo_load(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        stderr.contains("available bin targets")
            && stderr.contains("tunnelgate-sidecar")
            && !stderr.contains("can't find"),
        "cargo cannot load the package the Containerfile copies ({sources:?}): {stderr}"
    );
}

/// The check above is not vacuous: without tests/ and benches/ (what the Containerfile copied
/// before), Cargo refuses the manifest.
#[test]
fn without_the_test_and_bench_files_cargo_refuses_the_manifest() {
    let dir = std::env::temp_dir().join(format!("tg-containerfile-bare-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for src in ["Cargo.toml", "Cargo.lock", "crates", "src"] {
        copy_tree(&repo().join(src), &dir.join(src));
    }
    let stderr = cargo_load(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(stderr.contains("can't find"), "{stderr}");
}

/// Debian 12's podman (4.3) does not expand a build argument into a stage name: neither
/// `COPY --from=${ARG}` nor `FROM ${ARG} AS x` finds an earlier stage by that name. Every stage
/// is named literally, every `COPY --from` names one of them, and the binaries come from the
/// stage `build`, which `--build-context build=DIR` (scripts/image.sh) replaces.
#[test]
fn stages_are_named_literally_for_podman_4_3() {
    let text = std::fs::read_to_string(repo().join("containers/Containerfile")).expect("read");
    let mut stages = Vec::new();
    let mut copies_from = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
        if let Some(from) = line.strip_prefix("FROM ") {
            let words: Vec<&str> = from.split_whitespace().collect();
            if let [_, kw, name] = words[..] {
                assert!(kw.eq_ignore_ascii_case("AS"), "{line}");
                assert!(!name.contains('$'), "a stage name from an argument: {line}");
                stages.push(name.to_string());
            }
        }
        for word in line.split_whitespace() {
            if let Some(from) = word.strip_prefix("--from=") {
                copies_from.push(from.to_string());
            }
        }
    }
    assert!(stages.contains(&"build".to_string()), "{stages:?}");
    assert!(!copies_from.is_empty());
    for from in &copies_from {
        assert!(
            stages.contains(from),
            "COPY --from={from} names no stage of {stages:?}"
        );
    }
    assert!(
        copies_from.contains(&"build".to_string()),
        "{copies_from:?}"
    );
}
