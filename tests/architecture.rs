//! The house rules the compiler does not see on its own: which code may do I/O. The pure core
//! is its own crate (`crates/core`) with no I/O dependency; in the `tunnelgate` crate only the
//! shells (`src/shell/`, `src/sidecar/shell/`) and the binaries (`src/bin/`) reach tokio, the
//! filesystem, processes, sockets or the environment. Everything else is pure: it decides, and
//! a shell carries the decision out. (The clocks are clippy's job: `clippy.toml`.)

use std::path::{Path, PathBuf};
use std::process::Command;

/// The crates the core may depend on, each for a pure reason. A new one is a design decision:
/// add it here with its reason, or put the code that needs it in a shell.
const CORE_DEPENDENCIES: &[(&str, &str)] = &[
    ("base64", "key encoding"),
    (
        "boringtun",
        "the WireGuard session (wg.rs): our fork, crates/boringtun",
    ),
    ("hex", "UAPI keys"),
    ("ipnet", "networks in the config and rule models"),
    (
        "libc",
        "constants only: errno and syscall numbers (checked below)",
    ),
    ("rand_core", "fresh private keys (getrandom)"),
    ("serde", "the config and status models"),
    ("serde_json", "nft JSON and check reports"),
    ("thiserror", "error types"),
    ("toml", "the config file's syntax"),
    ("tracing", "the core's log lines"),
    ("x25519-dalek", "public keys from private keys"),
];

/// Crates that do I/O, and must not be anywhere in the core's dependency tree.
const IO_CRATES: &[&str] = &[
    "tokio",
    "mio",
    "hyper",
    "hyper-util",
    "socket2",
    "rtnetlink",
    "netlink-proto",
    "netlink-sys",
    "tun-rs",
    "hickory-resolver",
    "kube",
    "caps",
    "flate2",
    "tracing-subscriber",
];

/// What pure code must not name: the runtime, files, processes, sockets, the environment.
const IO_PATTERNS: &[&str] = &[
    "tokio",
    "std::fs",
    "File::open",
    "File::create",
    "OpenOptions",
    "std::process::Command",
    "Command::new",
    "std::net::TcpListener",
    "std::net::TcpStream",
    "std::net::UdpSocket",
    "std::os::unix::net",
    "std::env::var",
    "std::thread::spawn",
    "hyper::",
    "kube::",
    "nix::",
    "socket2::",
    "rtnetlink::",
    "tun_rs::",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Test-only code may do what it likes: files named `tests.rs` or `test_util.rs`, files under a
/// `tests/` folder, and whatever follows a `#[cfg(test)]` module in a file.
fn is_test_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "tests.rs"
        || name == "test_util.rs"
        || path.components().any(|c| c.as_os_str() == "tests")
}

/// The lines of `text` that are production code: comments dropped, and everything from the
/// first `#[cfg(test)]` that gates a module to the end (test modules close each file here).
fn production_lines(text: &str) -> Vec<(usize, &str)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines
                .get(i + 1)
                .is_some_and(|next| next.trim_start().starts_with("mod ") || next.contains(" mod "))
        {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        let code = line.split("//").next().unwrap_or("");
        out.push((i + 1, code));
    }
    out
}

/// Whether `code` names `pattern` as a path of its own (`nix::` but not `unix::`).
fn names(code: &str, pattern: &str) -> bool {
    code.match_indices(pattern).any(|(at, _)| {
        !code[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

/// Where `file`'s production code names I/O, as `path:line: pattern`.
fn io_uses(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).expect("read source");
    let shown = file
        .strip_prefix(root())
        .unwrap_or(file)
        .display()
        .to_string();
    let mut found = Vec::new();
    for (number, code) in production_lines(&text) {
        for pattern in IO_PATTERNS {
            if names(code, pattern) {
                found.push(format!("{shown}:{number}: {pattern}"));
            }
        }
        // libc for its constants and C types only (`libc::EINVAL`, `libc::c_long`), never a call.
        for (at, _) in code.match_indices("libc::") {
            let name: String = code[at + 6..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            // Constants start upper case (`EINVAL`, `SYS_madvise`); C types with `c_`.
            let constant = name.starts_with(|c: char| c.is_ascii_uppercase());
            if !(constant || name.starts_with("c_")) {
                found.push(format!(
                    "{shown}:{number}: libc::{name} (a call, not a constant)"
                ));
            }
        }
    }
    found
}

/// Whether `path` (relative to the repository) is a place I/O belongs.
fn is_shell(path: &Path) -> bool {
    path.starts_with("src/bin")
        || path.components().any(|c| c.as_os_str() == "shell")
        || path.file_name().is_some_and(|n| n == "shell.rs")
}

#[test]
fn the_core_crate_names_only_pure_dependencies() {
    let manifest = std::fs::read_to_string(root().join("crates/core/Cargo.toml")).expect("read");
    let table: toml::Table = manifest.parse().expect("crates/core/Cargo.toml parses");
    let deps = table
        .get("dependencies")
        .and_then(|d| d.as_table())
        .expect("[dependencies]");
    let allowed: Vec<&str> = CORE_DEPENDENCIES.iter().map(|(name, _)| *name).collect();
    let unexpected: Vec<&String> = deps
        .keys()
        .filter(|k| !allowed.contains(&k.as_str()))
        .collect();
    assert!(
        unexpected.is_empty(),
        "crates/core depends on {unexpected:?}: the core does no I/O; a pure dependency goes \
         into CORE_DEPENDENCIES with its reason, anything else belongs in a shell"
    );
    assert!(
        !table.contains_key("build-dependencies"),
        "crates/core has a build script's dependencies"
    );
}

#[test]
fn no_io_crate_is_in_the_core_crates_tree() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "tunnelgate-core",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(root())
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(
        crates.contains(&"boringtun"),
        "cargo tree lists the core's crates:\n{tree}"
    );
    let io: Vec<&&str> = IO_CRATES.iter().filter(|c| crates.contains(c)).collect();
    assert!(
        io.is_empty(),
        "the core's dependency tree has I/O crates {io:?}:\n{tree}"
    );
}

#[test]
fn the_core_crate_does_no_io() {
    let mut files = Vec::new();
    rust_files(&root().join("crates/core/src"), &mut files);
    assert!(files.len() > 20, "the core's sources are found");
    let found: Vec<String> = files
        .iter()
        .filter(|f| !is_test_file(f))
        .flat_map(|f| io_uses(f))
        .collect();
    assert!(
        found.is_empty(),
        "I/O in the pure core:\n{}",
        found.join("\n")
    );
}

#[test]
fn outside_the_shells_the_tunnelgate_crate_does_no_io() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    let pure: Vec<&PathBuf> = files
        .iter()
        .filter(|f| !is_test_file(f))
        .filter(|f| !is_shell(f.strip_prefix(root()).expect("under the root")))
        .collect();
    assert!(
        pure.iter().any(|f| f.ends_with("src/telemetry.rs")),
        "the pure modules are found: {pure:?}"
    );
    let found: Vec<String> = pure.iter().flat_map(|f| io_uses(f)).collect();
    assert!(
        found.is_empty(),
        "I/O outside src/shell/, src/sidecar/shell/ and src/bin/ (move it into a shell, or \
         take its result as an argument):\n{}",
        found.join("\n")
    );
}

/// The checker itself: it must see what it is meant to forbid, and skip what it must.
#[test]
fn the_checker_finds_io_and_skips_comments_and_tests() {
    let dir = std::env::temp_dir().join(format!("tg-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("sample.rs");
    std::fs::write(
        &file,
        "//! A module.\n\
         // tokio in a comment is fine\n\
         use std::fs::read; use std::os::unix::io::AsFd;\n\
         fn f() { let _ = libc::EINVAL; let _ = libc::getpid(); }\n\
         #[cfg(test)]\n\
         mod tests { use tokio::net::UdpSocket; }\n",
    )
    .expect("write sample");
    let found = io_uses(&file);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].ends_with(":3: std::fs"), "{found:?}");
    assert!(
        found[1].ends_with(":4: libc::getpid (a call, not a constant)"),
        "{found:?}"
    );
    assert!(is_shell(Path::new("src/shell/daemon.rs")));
    assert!(is_shell(Path::new("src/sidecar/shell/api.rs")));
    assert!(is_shell(Path::new("src/bin/tunnelgate.rs")));
    assert!(!is_shell(Path::new("src/telemetry/status.rs")));
}
