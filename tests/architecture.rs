//! The house rules the compiler does not see on its own: which code may do I/O. The pure core
//! is its own crate (`crates/core`) with no I/O dependency; in the `tunnelgate` crate only the
//! shells (`src/shell/`, `src/sidecar/shell/`) and the binaries (`src/bin/`) reach tokio, the
//! filesystem, processes, sockets or the environment. Everything else is pure: it decides, and
//! a shell carries the decision out. (The clocks are clippy's job: `clippy.toml`.)
//!
//! Besides the line checks below, the sources are read as Rust ([`syn`]): every path and every
//! `use` tree (so `use std::{fs, ..}` is `std::fs`), outside `#[cfg(test)]` items and test
//! files. That reading checks that the core draws no randomness of its own (key generation
//! takes the caller's generator) and that the modules of `src/shell` import each other without
//! a circle, with only the entry points calling the composition root (`shell::process`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use syn::visit::Visit;

/// The crates the core may depend on, each for a pure reason. A new one is a design decision:
/// add it here with its reason, or put the code that needs it in a shell.
const CORE_DEPENDENCIES: &[(&str, &str)] = &[
    ("base64", "key encoding"),
    (
        "blake2",
        "session indices: a keyed hash of a peer's key (session_index.rs; boringtun uses it too)",
    ),
    (
        "boringtun",
        "the WireGuard session (wg.rs): our fork, crates/boringtun",
    ),
    (
        "chacha20poly1305",
        "the group's endpoint exchange, sealed (group_exchange.rs; boringtun uses it too)",
    ),
    ("hex", "UAPI keys"),
    ("ipnet", "networks in the config and rule models"),
    (
        "libc",
        "constants only: errno and syscall numbers (checked below)",
    ),
    (
        "rand_core",
        "the caller's random number generator: traits only, no getrandom (checked below)",
    ),
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
    let tree = core_cargo_tree("none");
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

/// The pure modules take the shell's results as values (the time as `now`): they name no path
/// into `shell`, read as Rust (so a clock behind `crate::shell::clock` is seen).
#[test]
fn outside_the_shells_the_tunnelgate_crate_names_no_shell() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    let mut found = Vec::new();
    for file in files.iter().filter(|f| !is_test_file(f)) {
        let relative = file.strip_prefix(root()).expect("under the root");
        // The fuzz bodies drive the shell's own code on purpose (a feature's, for fuzzing).
        if is_shell(relative) || relative == Path::new("src/fuzzing.rs") {
            continue;
        }
        for path in paths_in(file) {
            let segments: Vec<&str> = path.split("::").collect();
            // `crate::shell` (the sidecar's own `shell` module is its root's business).
            if segments.starts_with(&["crate", "shell"]) {
                found.push(format!("{}: {path}", relative.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "pure modules naming the shell (take the value as an argument):\n{}",
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

// --- The sources read as Rust ------------------------------------------------------------------

/// Whether `attrs` make an item test code: `#[test]`, `#[cfg(test)]`, `#[cfg(any(test, ..))]`.
fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        if a.path().is_ident("test") {
            return true;
        }
        if !a.path().is_ident("cfg") {
            return false;
        }
        let Ok(list) = a.meta.require_list() else {
            return false;
        };
        let tokens = list.tokens.to_string();
        tokens == "test"
            || (tokens.starts_with("any")
                && tokens
                    .split(|c: char| !c.is_alphanumeric() && c != '_')
                    .any(|w| w == "test"))
    })
}

/// Every path a file's production code names, as `a::b::c`: `use` trees flattened (a group
/// `use a::{b, c}` is `a::b` and `a::c`; `self` in a group is its parent), paths in
/// expressions, types and patterns. Items under `#[cfg(test)]` and `#[test]` are skipped.
/// Macro bodies are token streams, not read (a path only a macro names is not seen).
#[derive(Default)]
struct Paths(Vec<String>);

impl Paths {
    fn use_tree(&mut self, prefix: &str, tree: &syn::UseTree) {
        let join = |name: &str| {
            if prefix.is_empty() {
                name.to_string()
            } else {
                format!("{prefix}::{name}")
            }
        };
        match tree {
            syn::UseTree::Path(p) => self.use_tree(&join(&p.ident.to_string()), &p.tree),
            syn::UseTree::Name(n) if n.ident == "self" => self.0.push(prefix.to_string()),
            syn::UseTree::Name(n) => self.0.push(join(&n.ident.to_string())),
            syn::UseTree::Rename(r) => self.0.push(join(&r.ident.to_string())),
            syn::UseTree::Glob(_) => self.0.push(join("*")),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.use_tree(prefix, tree);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Const(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Mod(i) => &i.attrs,
            syn::Item::Static(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Trait(i) => &i.attrs,
            syn::Item::Type(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            syn::Item::Macro(i) => &i.attrs,
            _ => return syn::visit::visit_item(self, item),
        };
        if !is_test_only(attrs) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let attrs = match item {
            syn::ImplItem::Const(i) => &i.attrs,
            syn::ImplItem::Fn(i) => &i.attrs,
            syn::ImplItem::Type(i) => &i.attrs,
            _ => return syn::visit::visit_impl_item(self, item),
        };
        if !is_test_only(attrs) {
            syn::visit::visit_impl_item(self, item);
        }
    }

    fn visit_stmt(&mut self, stmt: &'ast syn::Stmt) {
        let test_only = match stmt {
            syn::Stmt::Local(l) => is_test_only(&l.attrs),
            syn::Stmt::Macro(m) => is_test_only(&m.attrs),
            _ => false,
        };
        if !test_only {
            syn::visit::visit_stmt(self, stmt);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree("", &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let text: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.0.push(text.join("::"));
        syn::visit::visit_path(self, path);
    }
}

/// The paths `file`'s production code names (see [`Paths`]).
fn paths_in(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).expect("read source");
    let parsed = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut paths = Paths::default();
    paths.visit_file(&parsed);
    paths.0
}

/// Whether `path` draws randomness from the system: `OsRng`, `getrandom`, `thread_rng`, or
/// ring's or rand's generators.
fn draws_system_randomness(path: &str) -> bool {
    let segments: Vec<&str> = path.split("::").collect();
    segments.iter().any(|s| {
        matches!(
            *s,
            "OsRng" | "getrandom" | "thread_rng" | "ThreadRng" | "SystemRandom"
        )
    }) || segments.starts_with(&["ring", "rand"])
        || (segments.len() > 1 && segments[0] == "rand")
}

#[test]
fn the_core_and_the_boringtun_fork_draw_no_randomness_of_their_own() {
    let mut files = Vec::new();
    rust_files(&root().join("crates/core/src"), &mut files);
    rust_files(&root().join("crates/boringtun/src"), &mut files);
    assert!(files.len() > 40, "the sources are found: {}", files.len());
    let found: Vec<String> = files
        .iter()
        .filter(|f| !is_test_file(f))
        .flat_map(|f| {
            let shown = f.strip_prefix(root()).unwrap_or(f).display().to_string();
            paths_in(f)
                .into_iter()
                .filter(|p| draws_system_randomness(p))
                .map(move |p| format!("{shown}: {p}"))
        })
        .collect();
    assert!(
        found.is_empty(),
        "the core takes its randomness from the caller (the shell passes OsRng):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_core_manifest_enables_no_randomness_source() {
    let manifest = std::fs::read_to_string(root().join("crates/core/Cargo.toml")).expect("read");
    let table: toml::Table = manifest.parse().expect("crates/core/Cargo.toml parses");
    let deps = table
        .get("dependencies")
        .and_then(|d| d.as_table())
        .expect("[dependencies]");
    for name in ["rand_core", "x25519-dalek"] {
        let features: Vec<&str> = deps
            .get(name)
            .and_then(|d| d.get("features"))
            .and_then(|f| f.as_array())
            .map(|f| f.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        assert!(
            !features.contains(&"getrandom"),
            "crates/core enables {name}'s getrandom: {features:?}"
        );
    }
    let default_features = deps
        .get("rand_core")
        .and_then(|d| d.get("default-features"))
        .and_then(|v| v.as_bool());
    assert_eq!(
        default_features,
        Some(false),
        "rand_core without its default features"
    );
}

/// `cargo tree` of the core's normal dependencies, each line `DEPTH NAME ...`, as (depth, name).
fn core_tree() -> Vec<(usize, String)> {
    core_cargo_tree("depth")
        .lines()
        .filter_map(|line| {
            let digits: String = line.chars().take_while(char::is_ascii_digit).collect();
            let depth = digits.parse().ok()?;
            let name = line[digits.len()..].split_whitespace().next()?.to_string();
            Some((depth, name))
        })
        .collect()
}

/// `cargo tree --offline -p tunnelgate-core -e normal --prefix PREFIX`, its output.
fn core_cargo_tree(prefix: &str) -> String {
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
            prefix,
        ])
        .current_dir(root())
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The crates that depend directly on `name` in a depth-prefixed tree.
fn parents_of(tree: &[(usize, String)], name: &str) -> BTreeSet<String> {
    let mut stack: Vec<&str> = Vec::new();
    let mut parents = BTreeSet::new();
    for (depth, crate_name) in tree {
        stack.truncate(*depth);
        if crate_name == name {
            if let Some(parent) = stack.last() {
                parents.insert((*parent).to_string());
            }
        }
        stack.push(crate_name);
    }
    parents
}

#[test]
fn getrandom_reaches_the_core_only_through_ring() {
    let tree = core_tree();
    assert!(
        tree.iter().any(|(d, n)| *d == 0 && n == "tunnelgate-core"),
        "the tree starts at the core: {tree:?}"
    );
    // ring's SystemRandom, which nothing in the core or the fork calls (checked above).
    let parents = parents_of(&tree, "getrandom");
    assert_eq!(
        parents,
        BTreeSet::from(["ring".to_string()]),
        "what pulls getrandom into the core"
    );
}

/// The module of `src/shell` that `file` belongs to (`src/shell/serve/uapi.rs`: `serve`),
/// or another name for the rest of the crate (`bin`, `sidecar`, `telemetry`, ...).
fn module_of(file: &Path) -> String {
    let rel = file.strip_prefix(root().join("src")).expect("under src");
    let parts: Vec<String> = rel
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    match parts.as_slice() {
        [shell, module, ..] if shell == "shell" => format!("shell::{module}"),
        [first, ..] => first.clone(),
        [] => String::new(),
    }
}

/// The `src/shell` modules a file's production code names: `crate::shell::X`,
/// `tunnelgate::shell::X`, and `super::X` from a file directly under `src/shell`.
fn shell_imports(file: &Path) -> BTreeSet<String> {
    let direct_child = file.parent() == Some(&root().join("src/shell"));
    paths_in(file)
        .iter()
        .filter_map(|p| {
            let s: Vec<&str> = p.split("::").collect();
            match s.as_slice() {
                ["crate" | "tunnelgate", "shell", module, ..] => Some(format!("shell::{module}")),
                ["super", module, ..] if direct_child && *module != "super" => {
                    Some(format!("shell::{module}"))
                }
                _ => None,
            }
        })
        .collect()
}

/// The import graph of `src/`: module -> the `src/shell` modules it names.
fn import_graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files.iter().filter(|f| !is_test_file(f)) {
        let module = module_of(file);
        let mut imports = shell_imports(file);
        imports.remove(&module);
        graph.entry(module).or_default().extend(imports);
    }
    graph
}

/// A circle in `graph`, if there is one, as the modules along it.
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|m| m == at) {
            let mut circle = path[i..].to_vec();
            circle.push(at.to_string());
            return Some(circle);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_string());
        for next in graph.get(at).into_iter().flatten() {
            if let Some(circle) = walk(graph, next, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.insert(at.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| walk(graph, m, &mut Vec::new(), &mut done))
}

/// The composition root, and who may call it: the binaries, and the drop-in's entry, which
/// only goes to the background before it hands over.
const ROOT: &str = "shell::process";
const ROOT_CALLERS: &[&str] = &["bin", "shell::userspace"];

#[test]
fn the_shell_imports_without_a_circle_and_only_the_entries_call_the_root() {
    let graph = import_graph();
    assert!(
        graph
            .get("shell::process")
            .is_some_and(|i| i.contains("shell::daemon")),
        "the graph is read: {graph:?}"
    );
    assert_eq!(find_circle(&graph), None, "an import circle in src/");
    let callers: Vec<&String> = graph
        .iter()
        .filter(|(module, imports)| {
            imports.contains(ROOT) && !ROOT_CALLERS.contains(&module.as_str())
        })
        .map(|(module, _)| module)
        .collect();
    assert!(
        callers.is_empty(),
        "{callers:?} call up into the composition root ({ROOT})"
    );
    // systemd is told about the process's life from one layer: the root.
    let notifiers: Vec<&String> = graph
        .iter()
        .filter(|(module, imports)| imports.contains("shell::systemd") && module.as_str() != ROOT)
        .map(|(module, _)| module)
        .collect();
    assert!(
        notifiers.is_empty(),
        "{notifiers:?} talk to systemd besides {ROOT}"
    );
}

/// The modules of one folder under `src/shell` (`dataplane/`, `serve/`): sibling file ->
/// the siblings its production code names (`super::X`, `crate::shell::FOLDER::X`).
fn sibling_graph(folder: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let parent = folder
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let siblings: BTreeSet<String> = std::fs::read_dir(folder)
        .expect("folder")
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            name.strip_suffix(".rs").map(str::to_string)
        })
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for sibling in &siblings {
        let file = folder.join(format!("{sibling}.rs"));
        let named = paths_in(&file)
            .iter()
            .filter_map(|p| {
                let s: Vec<&str> = p.split("::").collect();
                match s.as_slice() {
                    ["super", module, ..] => Some(module.to_string()),
                    ["crate" | "tunnelgate", "shell", f, module, ..] if *f == parent => {
                        Some(module.to_string())
                    }
                    _ => None,
                }
            })
            .filter(|m| siblings.contains(m) && m != sibling)
            .collect();
        graph.insert(sibling.clone(), named);
    }
    graph
}

/// Inside a folder of the shell, too, the files import each other without a circle (the
/// packet loops, the handshake path and takeovers once did: each named another's helpers).
#[test]
fn the_files_of_each_shell_folder_import_each_other_without_a_circle() {
    let mut folders = Vec::new();
    for entry in std::fs::read_dir(root().join("src/shell")).expect("src/shell") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            folders.push(path);
        }
    }
    let dataplane = sibling_graph(&root().join("src/shell/dataplane"));
    assert!(
        dataplane
            .get("timers")
            .is_some_and(|i| i.contains("handshakes") && i.contains("takeover")),
        "the graph is read: {dataplane:?}"
    );
    for folder in folders {
        let graph = sibling_graph(&folder);
        assert_eq!(
            find_circle(&graph),
            None,
            "an import circle in {}",
            folder.display()
        );
    }
}

/// The reader itself: it sees through use groups and renames, skips test code, and finds a
/// circle and only a circle.
#[test]
fn the_reader_flattens_use_trees_skips_tests_and_finds_circles() {
    let dir = std::env::temp_dir().join(format!("tg-arch-syn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("sample.rs");
    std::fs::write(
        &file,
        "use std::{fs, io::{self, Read as R}};\n\
         use rand_core::*;\n\
         fn f() { let _ = rand_core::OsRng; }\n\
         #[cfg(test)]\n\
         fn g() { let _ = ring::rand::SystemRandom::new(); }\n\
         struct S;\n\
         impl S { #[cfg(test)] fn h() { getrandom::fill(); } }\n\
         #[cfg(test)]\n\
         mod tests { use tokio::net::UdpSocket; }\n",
    )
    .expect("write sample");
    let paths = paths_in(&file);
    std::fs::remove_dir_all(&dir).ok();
    for want in [
        "std::fs",
        "std::io",
        "std::io::Read",
        "rand_core::*",
        "rand_core::OsRng",
    ] {
        assert!(paths.iter().any(|p| p == want), "{want} in {paths:?}");
    }
    let random: Vec<&String> = paths
        .iter()
        .filter(|p| draws_system_randomness(p))
        .collect();
    assert_eq!(random, ["rand_core::OsRng"], "test code skipped: {paths:?}");
    assert!(!paths.iter().any(|p| p.starts_with("tokio")), "{paths:?}");

    let graph = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, to) in edges {
            g.entry(from.to_string())
                .or_default()
                .insert(to.to_string());
        }
        g
    };
    let circle = find_circle(&graph(&[("a", "b"), ("b", "c"), ("c", "b"), ("a", "d")]));
    assert_eq!(circle, Some(vec!["b".into(), "c".into(), "b".into()]));
    assert_eq!(
        find_circle(&graph(&[("a", "b"), ("a", "c"), ("b", "c")])),
        None
    );
    let tree: Vec<(usize, String)> = [
        (0, "core"),
        (1, "boringtun"),
        (2, "ring"),
        (3, "getrandom"),
        (1, "x25519"),
    ]
    .iter()
    .map(|(d, n)| (*d, n.to_string()))
    .collect();
    assert_eq!(
        parents_of(&tree, "getrandom"),
        BTreeSet::from(["ring".to_string()])
    );
}

// --- The environment: every TUNNELGATE_* variable is read in shell::tuning ----------------------

/// The file that reads every `TUNNELGATE_*` variable, and the one exempt: the test hooks'
/// (compiled only with the `test-hooks` feature, never in a user's build).
const TUNING: &str = "src/shell/tuning.rs";
const TEST_HOOKS: &str = "src/shell/test_hooks.rs";

/// Every `const NAME: &str = "TUNNELGATE_..."` in `files`, by name.
fn tunnelgate_consts(files: &[PathBuf]) -> BTreeMap<String, String> {
    #[derive(Default)]
    struct Consts(BTreeMap<String, String>);
    impl<'ast> Visit<'ast> for Consts {
        fn visit_item_const(&mut self, c: &'ast syn::ItemConst) {
            if let syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) = &*c.expr
            {
                self.0.insert(c.ident.to_string(), s.value());
            }
        }
    }
    let mut consts = Consts::default();
    for file in files {
        let text = std::fs::read_to_string(file).expect("read source");
        if let Ok(parsed) = syn::parse_file(&text) {
            consts.visit_file(&parsed);
        }
    }
    consts.0
}

/// The environment reads of production code (`env::var`, `env::var_os`, `env::vars`,
/// `env::vars_os`), each with the function it is in and the variable it names when it can be
/// told (a literal, or a constant of `consts`): `None` when it cannot (a parameter, an
/// iteration over all, another crate's constant: the argument's text is kept).
struct EnvReads<'a> {
    consts: &'a BTreeMap<String, String>,
    function: String,
    reads: Vec<EnvRead>,
}

#[derive(Debug)]
struct EnvRead {
    function: String,
    named: Option<String>,
    argument: String,
}

impl EnvReads<'_> {
    fn in_function(&mut self, name: String, visit: impl FnOnce(&mut Self)) {
        let outer = std::mem::replace(&mut self.function, name);
        visit(self);
        self.function = outer;
    }
}

impl<'ast> Visit<'ast> for EnvReads<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let test_only = match item {
            syn::Item::Fn(i) => is_test_only(&i.attrs),
            syn::Item::Mod(i) => is_test_only(&i.attrs),
            syn::Item::Impl(i) => is_test_only(&i.attrs),
            _ => false,
        };
        if !test_only {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.in_function(f.sig.ident.to_string(), |v| syn::visit::visit_item_fn(v, f));
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test_only(&f.attrs) {
            self.in_function(f.sig.ident.to_string(), |v| {
                syn::visit::visit_impl_item_fn(v, f)
            });
        }
    }

    fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
        if let syn::Expr::Path(p) = &*call.func {
            let segments: Vec<String> = p
                .path
                .segments
                .iter()
                .map(|s| s.ident.to_string())
                .collect();
            let n = segments.len();
            if n >= 2
                && segments[n - 2] == "env"
                && matches!(
                    segments[n - 1].as_str(),
                    "var" | "var_os" | "vars" | "vars_os"
                )
            {
                let argument = match call.args.first() {
                    Some(syn::Expr::Path(arg)) => arg
                        .path
                        .segments
                        .iter()
                        .map(|s| s.ident.to_string())
                        .collect::<Vec<_>>()
                        .join("::"),
                    _ => String::new(),
                };
                let named = match call.args.first() {
                    Some(syn::Expr::Lit(syn::ExprLit {
                        lit: syn::Lit::Str(s),
                        ..
                    })) => Some(s.value()),
                    Some(syn::Expr::Path(arg)) => arg
                        .path
                        .segments
                        .last()
                        .and_then(|s| self.consts.get(&s.ident.to_string()).cloned()),
                    _ => None,
                };
                self.reads.push(EnvRead {
                    function: self.function.clone(),
                    named,
                    argument,
                });
            }
        }
        syn::visit::visit_expr_call(self, call);
    }
}

/// The environment reads in `text` (see [`EnvReads`]).
fn env_reads(text: &str, consts: &BTreeMap<String, String>) -> Vec<EnvRead> {
    let parsed = syn::parse_file(text).expect("parse");
    let mut reads = EnvReads {
        consts,
        function: String::new(),
        reads: Vec::new(),
    };
    reads.visit_file(&parsed);
    reads.reads
}

/// The variables outside `TUNNELGATE_*` the daemon reads where they are used: systemd's and the
/// kernel's protocols, tracing's filter, wireguard-go's and Kubernetes' own.
const OTHER_VARIABLES: [&str; 9] = [
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "JOURNAL_STREAM",
    "PATH",
    "POD_NAME",
    "POD_NAMESPACE",
    "WG_PROCESS_FOREGROUND",
    "STATE_DIRECTORY",
];

/// Whether a read of `named` may sit outside `shell::tuning`: a variable it can tell that is
/// not ours (or tracing's `RUST_LOG`, named through `EnvFilter::DEFAULT_ENV`).
fn may_read_elsewhere(read: &EnvRead) -> bool {
    match read.named.as_deref() {
        Some(name) => !name.starts_with("TUNNELGATE_") && OTHER_VARIABLES.contains(&name),
        None => read.argument == "EnvFilter::DEFAULT_ENV",
    }
}

#[test]
fn every_tunnelgate_variable_is_read_in_shell_tuning() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    let consts = tunnelgate_consts(&files);
    let mut stray = Vec::new();
    for file in &files {
        let relative = file
            .strip_prefix(root())
            .expect("under the root")
            .to_string_lossy()
            .to_string();
        if relative == TUNING || relative == TEST_HOOKS || is_test_file(file) {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read source");
        for read in env_reads(&text, &consts) {
            if !may_read_elsewhere(&read) {
                stray.push(format!("{relative}, fn {}: {read:?}", read.function));
            }
        }
    }
    assert!(
        stray.is_empty(),
        "environment variables read outside {TUNING} (read them there, or name a variable \
         that is not ours in OTHER_VARIABLES):\n{}",
        stray.join("\n")
    );
    // The one exemption stays a test build's.
    let shell = std::fs::read_to_string(root().join("src/shell.rs")).expect("src/shell.rs");
    assert!(
        shell.contains("#[cfg(feature = \"test-hooks\")]\npub mod test_hooks;"),
        "{TEST_HOOKS} is exempt only while it is compiled under the test-hooks feature"
    );
}

#[test]
fn the_environment_checker_finds_reads_by_literal_constant_and_parameter() {
    let text = r#"
        const OURS: &str = "TUNNELGATE_X";
        fn a() { let _ = std::env::var_os("TUNNELGATE_Y"); }
        fn b() { let _ = std::env::var(OURS); }
        fn c(name: &str) { let _ = env::var_os(name); }
        fn d() { let _ = std::env::var("NOTIFY_SOCKET"); }
        fn e() { for _ in std::env::vars() {} }
        #[cfg(test)]
        mod tests { fn f() { let _ = std::env::var("TUNNELGATE_Z"); } }
    "#;
    let parsed = syn::parse_file(text).expect("parse");
    let mut consts = BTreeMap::new();
    for item in &parsed.items {
        if let syn::Item::Const(c) = item {
            if let syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) = &*c.expr
            {
                consts.insert(c.ident.to_string(), s.value());
            }
        }
    }
    let reads = env_reads(text, &consts);
    let named: Vec<Option<&str>> = reads.iter().map(|r| r.named.as_deref()).collect();
    assert_eq!(
        named,
        [
            Some("TUNNELGATE_Y"),
            Some("TUNNELGATE_X"),
            None,
            Some("NOTIFY_SOCKET"),
            None
        ]
    );
    let allowed: Vec<bool> = reads.iter().map(may_read_elsewhere).collect();
    assert_eq!(allowed, [false, false, false, true, false]);
    let functions: Vec<&str> = reads.iter().map(|r| r.function.as_str()).collect();
    assert_eq!(functions, ["a", "b", "c", "d", "e"]);
}

// --- One lifecycle: no detached task or thread outside the composition root ---------------------

/// The composition root: it starts, owns and stops every long-lived task and thread.
const COMPOSITION_ROOT: &str = "src/shell/process.rs";

/// Whether `e` starts a task or a thread: `tokio::spawn`, `task::spawn_blocking`,
/// `thread::spawn`, or a `thread::Builder`'s `spawn` (seen through `?`, `expect`, `unwrap`).
fn is_spawn(e: &syn::Expr) -> bool {
    match e {
        syn::Expr::Try(t) => is_spawn(&t.expr),
        syn::Expr::MethodCall(m) if m.method == "expect" || m.method == "unwrap" => {
            is_spawn(&m.receiver)
        }
        syn::Expr::MethodCall(m) if m.method == "spawn" => {
            // A thread Builder's: the receiver chain starts at `Builder::new()`.
            let mut receiver = &*m.receiver;
            loop {
                match receiver {
                    syn::Expr::MethodCall(inner) => receiver = &inner.receiver,
                    syn::Expr::Call(c) => {
                        break matches!(&*c.func, syn::Expr::Path(p)
                            if p.path.segments.iter().any(|s| s.ident == "Builder"))
                    }
                    _ => break false,
                }
            }
        }
        syn::Expr::Call(c) => match &*c.func {
            syn::Expr::Path(p) => {
                let segments: Vec<String> = p
                    .path
                    .segments
                    .iter()
                    .map(|s| s.ident.to_string())
                    .collect();
                let n = segments.len();
                n >= 2
                    && matches!(segments[n - 1].as_str(), "spawn" | "spawn_blocking")
                    && matches!(segments[n - 2].as_str(), "tokio" | "task" | "thread")
            }
            _ => false,
        },
        _ => false,
    }
}

/// The spawns in production code whose handle is dropped at once (the spawn is a statement of
/// its own, or bound to `_`), by the function they are in.
#[derive(Default)]
struct Detached {
    function: String,
    found: Vec<String>,
}

impl<'ast> Visit<'ast> for Detached {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let test_only = match item {
            syn::Item::Fn(i) => is_test_only(&i.attrs),
            syn::Item::Mod(i) => is_test_only(&i.attrs),
            syn::Item::Impl(i) => is_test_only(&i.attrs),
            _ => false,
        };
        if !test_only {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        let outer = std::mem::replace(&mut self.function, f.sig.ident.to_string());
        syn::visit::visit_item_fn(self, f);
        self.function = outer;
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if is_test_only(&f.attrs) {
            return;
        }
        let outer = std::mem::replace(&mut self.function, f.sig.ident.to_string());
        syn::visit::visit_impl_item_fn(self, f);
        self.function = outer;
    }

    fn visit_stmt(&mut self, stmt: &'ast syn::Stmt) {
        let dropped = match stmt {
            syn::Stmt::Expr(e, Some(_)) => is_spawn(e),
            syn::Stmt::Local(l) => {
                matches!(l.pat, syn::Pat::Wild(_))
                    && l.init.as_ref().is_some_and(|i| is_spawn(&i.expr))
            }
            _ => false,
        };
        if dropped {
            self.found.push(self.function.clone());
        }
        syn::visit::visit_stmt(self, stmt);
    }
}

fn detached_spawns(text: &str) -> Vec<String> {
    let parsed = syn::parse_file(text).expect("parse");
    let mut d = Detached::default();
    d.visit_file(&parsed);
    d.found
}

#[test]
fn no_task_or_thread_is_detached_outside_the_composition_root() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    let mut found = Vec::new();
    for file in files.iter().filter(|f| !is_test_file(f)) {
        let relative = file.strip_prefix(root()).expect("under the root");
        // The sidecar is another program, with its own root: its event recorder's task lives
        // as long as its runtime (not the daemon's lifecycle).
        if relative == Path::new(COMPOSITION_ROOT) || relative.starts_with("src/sidecar") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read source");
        for function in detached_spawns(&text) {
            found.push(format!("{}, fn {function}", relative.display()));
        }
    }
    assert!(
        found.is_empty(),
        "a task or thread started and its handle dropped outside {COMPOSITION_ROOT} (keep the handle and \
         join it, or hand it to the root):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_spawn_checker_finds_dropped_handles_and_passes_kept_ones() {
    let text = r#"
        fn a() { tokio::spawn(async {}); }
        fn b() { let _ = std::thread::spawn(|| ()); }
        fn c() { std::thread::Builder::new().name("x".into()).spawn(|| ()).expect("spawn"); }
        fn d() { tokio::task::spawn_blocking(|| ()); }
        fn kept() -> JoinHandle<()> { let h = tokio::spawn(async {}); h }
        fn returned() -> JoinHandle<()> { tokio::spawn(async {}) }
        fn process() { std::process::Command::new("x").spawn().expect("x"); }
        #[cfg(test)]
        mod tests { fn t() { tokio::spawn(async {}); } }
    "#;
    assert_eq!(detached_spawns(text), ["a", "b", "c", "d"]);
}
