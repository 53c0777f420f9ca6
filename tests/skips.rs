//! No test passes without making its check under `CI=true`: every skip goes through the one
//! helper, `tests/common/skip.rs` (`skip`, which panics under `CI=true`), and shows where it is
//! called. The sources of every test (`tests/`, and the `#[test]` functions of `src/` and
//! `crates/`) are read as Rust ([`syn`]), and these are refused:
//!
//! - a `print!`/`eprintln!`/... that mentions skipping, outside the helper: a test that says it
//!   skips and then returns would print ok in CI;
//! - the string `"CI"` outside the helper: a test that decides by itself what CI means;
//! - a `return` in a test function that does not follow a skip: a call to `skip`, or to a
//!   helper named `..._or_skip`, earlier in its block, in the condition of its `if`, or in the
//!   initializer of its `let ... else`. A test that ends early otherwise has stopped checking;
//! - a function that calls `skip` itself but is neither a test nor named `..._or_skip`, so a
//!   test's call to it would not show that it may skip.

use std::path::{Path, PathBuf};
use syn::visit::Visit;

/// The helper, the one place that may print a skip and read `CI` (the library's unit tests
/// include the same file through `src/test_util.rs`).
const HELPER: &str = "tests/common/skip.rs";
/// This checker, which names `"CI"` to look for it.
const CHECKER: &str = "tests/skips.rs";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether an attribute list marks a test: `#[test]`, `#[tokio::test(..)]`, ...
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs
        .iter()
        .any(|a| a.path().segments.last().is_some_and(|s| s.ident == "test"))
}

/// Whether a function of this name may skip: `skip` itself, or a helper named `..._or_skip`.
fn is_skipping_name(name: &str) -> bool {
    name == "skip" || name.ends_with("_or_skip")
}

/// Finds a call to a function (or method) whose name `call` (or `method`) accepts.
struct Calls {
    call: fn(&str) -> bool,
    method: fn(&str) -> bool,
    found: bool,
}

impl<'ast> Visit<'ast> for Calls {
    fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
        if let syn::Expr::Path(p) = &*call.func {
            if p.path
                .segments
                .last()
                .is_some_and(|s| (self.call)(&s.ident.to_string()))
            {
                self.found = true;
            }
        }
        syn::visit::visit_expr_call(self, call);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        if (self.method)(&call.method.to_string()) {
            self.found = true;
        }
        syn::visit::visit_expr_method_call(self, call);
    }
}

/// Whether `expr` calls a function that may skip (methods too, but not `Iterator::skip`).
fn calls_skip(expr: &syn::Expr) -> bool {
    let mut calls = Calls {
        call: is_skipping_name,
        method: |m| m.ends_with("_or_skip"),
        found: false,
    };
    calls.visit_expr(expr);
    calls.found
}

/// Whether a function body calls `skip` (or `ok_or_skip`) itself.
fn calls_skip_directly(block: &syn::Block) -> bool {
    let mut calls = Calls {
        call: |f| f == "skip" || f == "ok_or_skip",
        method: |_| false,
        found: false,
    };
    calls.visit_block(block);
    calls.found
}

/// The `return`s of one test function that no skip guards. Closures, async blocks and nested
/// items return from themselves, so they are not entered.
struct Returns {
    /// Whether the innermost enclosing block (or branch) is past a skip.
    guarded: Vec<bool>,
    unguarded: usize,
}

impl Returns {
    fn of(block: &syn::Block) -> usize {
        let mut r = Returns {
            guarded: vec![false],
            unguarded: 0,
        };
        r.visit_block(block);
        r.unguarded
    }

    fn now(&self) -> bool {
        self.guarded.last().copied().unwrap_or(false)
    }

    fn with<T>(&mut self, guarded: bool, f: impl FnOnce(&mut Self) -> T) -> T {
        self.guarded.push(guarded);
        let out = f(self);
        self.guarded.pop();
        out
    }
}

impl<'ast> Visit<'ast> for Returns {
    fn visit_block(&mut self, block: &'ast syn::Block) {
        let outer = self.now();
        self.with(outer, |r| {
            for stmt in &block.stmts {
                r.visit_stmt(stmt);
                let skipped = match stmt {
                    syn::Stmt::Local(l) => l.init.as_ref().is_some_and(|i| calls_skip(&i.expr)),
                    syn::Stmt::Expr(e, _) => calls_skip(e),
                    syn::Stmt::Item(_) | syn::Stmt::Macro(_) => false,
                };
                if skipped {
                    if let Some(g) = r.guarded.last_mut() {
                        *g = true;
                    }
                }
            }
        });
    }

    fn visit_local(&mut self, local: &'ast syn::Local) {
        if let Some(init) = &local.init {
            self.visit_expr(&init.expr);
            if let Some((_, diverge)) = &init.diverge {
                let guarded = self.now() || calls_skip(&init.expr);
                self.with(guarded, |r| r.visit_expr(diverge));
            }
        }
    }

    fn visit_expr_if(&mut self, e: &'ast syn::ExprIf) {
        self.visit_expr(&e.cond);
        let guarded = self.now() || calls_skip(&e.cond);
        self.with(guarded, |r| r.visit_block(&e.then_branch));
        if let Some((_, other)) = &e.else_branch {
            self.visit_expr(other);
        }
    }

    fn visit_expr_return(&mut self, e: &'ast syn::ExprReturn) {
        if !self.now() {
            self.unguarded += 1;
        }
        syn::visit::visit_expr_return(self, e);
    }

    fn visit_expr_closure(&mut self, _: &'ast syn::ExprClosure) {}
    fn visit_expr_async(&mut self, _: &'ast syn::ExprAsync) {}
    fn visit_item(&mut self, _: &'ast syn::Item) {}
}

/// What one file breaks of the rules above, each as `fn NAME: what`.
struct Findings {
    helper: bool,
    found: Vec<String>,
    current: String,
}

impl Findings {
    fn check_fn(&mut self, name: String, attrs: &[syn::Attribute], block: &syn::Block) {
        let test = is_test(attrs);
        if test {
            let n = Returns::of(block);
            if n > 0 {
                self.found.push(format!(
                    "fn {name}: {n} return(s) not after a skip (call `skip(why)` first, or a \
                     helper named ..._or_skip)"
                ));
            }
        } else if calls_skip_directly(block) && !is_skipping_name(&name) {
            self.found.push(format!(
                "fn {name}: calls skip but is not named ..._or_skip"
            ));
        }
        let outer = std::mem::replace(&mut self.current, name);
        self.visit_block(block);
        self.current = outer;
    }
}

impl<'ast> Visit<'ast> for Findings {
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.check_fn(f.sig.ident.to_string(), &f.attrs, &f.block);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        self.check_fn(f.sig.ident.to_string(), &f.attrs, &f.block);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        let printer = m.path.segments.last().is_some_and(|s| {
            ["print", "println", "eprint", "eprintln"].contains(&s.ident.to_string().as_str())
        });
        let tokens = m.tokens.to_string();
        if printer && !self.helper && tokens.to_lowercase().contains("skip") {
            self.found.push(format!(
                "fn {}: prints a skip message itself (use skip(why))",
                self.current
            ));
        }
        // A macro's arguments are tokens, not expressions: `assert!(std::env::var("CI") ..)`.
        if tokens.contains("\"CI\"") && !self.helper {
            self.found.push(format!(
                "fn {}: reads \"CI\" itself (use skip(why))",
                self.current
            ));
        }
        syn::visit::visit_macro(self, m);
    }

    fn visit_lit_str(&mut self, s: &'ast syn::LitStr) {
        if s.value() == "CI" && !self.helper {
            self.found.push(format!(
                "fn {}: reads \"CI\" itself (use skip(why))",
                self.current
            ));
        }
    }
}

/// The findings in one source text; `helper`: the text is the helper's.
fn findings(text: &str, helper: bool) -> Vec<String> {
    let file = syn::parse_file(text).unwrap_or_else(|e| panic!("does not parse: {e}"));
    let mut f = Findings {
        helper,
        found: Vec::new(),
        current: String::from("(file)"),
    };
    f.visit_file(&file);
    f.found
}

#[test]
fn every_test_skips_only_through_the_helper() {
    let mut files = Vec::new();
    for dir in ["tests", "src", "crates"] {
        rust_files(&root().join(dir), &mut files);
    }
    files.sort();
    assert!(files.len() > 100, "{} files", files.len());
    let mut all = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(root()).unwrap_or(file);
        let text = std::fs::read_to_string(file).expect("read");
        let helper = rel == Path::new(HELPER) || rel == Path::new(CHECKER);
        for finding in findings(&text, helper) {
            all.push(format!("{}: {finding}", rel.display()));
        }
    }
    assert!(
        all.is_empty(),
        "tests that could pass without checking:\n{}",
        all.join("\n")
    );
    assert!(root().join(HELPER).is_file());
}

/// The checker finds each way to skip by hand, and passes the ways through the helper.
#[test]
fn the_checker_finds_skips_by_hand_and_passes_the_helper() {
    let by_hand = r#"
        #[test]
        fn printed() {
            if !have("kubectl") {
                eprintln!("SKIPPED: kubectl is not installed");
                return;
            }
        }
        #[tokio::test]
        async fn silent() {
            let Ok(x) = std::fs::read("/proc/self/stat") else { return };
        }
        #[test]
        fn own_ci() {
            assert!(std::env::var("CI").as_deref() != Ok("true"));
        }
        fn tool_present() -> bool { skip("no tool"); false }
    "#;
    let found = findings(by_hand, false);
    for expected in [
        "fn printed: prints a skip message",
        "fn printed: 1 return(s) not after a skip",
        "fn silent: 1 return(s) not after a skip",
        "fn own_ci: reads \"CI\" itself",
        "fn tool_present: calls skip but is not named ..._or_skip",
    ] {
        assert!(
            found.iter().any(|f| f.starts_with(expected)),
            "{expected:?} not in {found:#?}"
        );
    }
    assert_eq!(found.len(), 5, "{found:#?}");

    let through_the_helper = r#"
        #[test]
        fn direct() {
            if !Path::new("/usr/bin/wg").exists() {
                skip("wg is not installed");
                return;
            }
            let x = (0..3).map(|i| { if i == 1 { return 0; } i }).sum::<i32>();
        }
        #[test]
        fn through_a_helper() {
            let Some(rootfs) = rootfs_or_skip() else { return };
            if !imp.available_or_skip() { return; }
            match found() { Ok(x) => x, Err(why) => { skip(why); return; } };
        }
        fn rootfs_or_skip() -> Option<PathBuf> { ok_or_skip(rootfs()) }
        fn not_a_test() -> Option<u8> { return None; }
    "#;
    assert_eq!(findings(through_the_helper, false), Vec::<String>::new());
}
