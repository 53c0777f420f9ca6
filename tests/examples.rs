//! The shipped examples pass as shipped: for every file in `config/`, the shell lines of its
//! header's `# Setup` block, and the install block of `docs/router.md`, run as written (only
//! `/etc` moved into a temp dir, and `scripts/install.sh` into a `DESTDIR` with the binary under
//! test) up to their `tunnelgate check`, which must then pass.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The commands of a config file's header: the `#   ` lines after `# Setup`.
fn setup_block(text: &str) -> Option<Vec<String>> {
    let mut lines = text.lines().skip_while(|l| !l.starts_with("# Setup"));
    lines.next()?;
    Some(
        lines
            .map_while(|l| l.strip_prefix("#   "))
            .map(str::to_string)
            .collect(),
    )
}

/// The first ```sh block after `heading` in a Markdown text.
fn sh_block_after(text: &str, heading: &str) -> Option<Vec<String>> {
    let mut lines = text
        .lines()
        .skip_while(|l| l.trim() != heading)
        .skip_while(|l| l.trim() != "```sh");
    lines.next()?;
    Some(
        lines
            .take_while(|l| l.trim() != "```")
            .map(str::to_string)
            .collect(),
    )
}

/// The commands up to and including the first `tunnelgate check`: what comes after (systemctl,
/// `tunnelgate run`) starts services.
fn up_to_check(lines: &[String]) -> Vec<String> {
    let check = lines
        .iter()
        .position(|l| l.trim_start().starts_with("tunnelgate check "))
        .unwrap_or_else(|| panic!("no `tunnelgate check` line in {lines:#?}"));
    lines[..=check].to_vec()
}

/// A temp root for the steps: `/etc/tunnelgate` becomes `ROOT/etc/tunnelgate`, and
/// `tunnelgate` on PATH is the binary under test.
struct Stage {
    tmp: TempDir,
    bin: PathBuf,
    root: PathBuf,
}

impl Stage {
    fn new(tag: &str) -> Stage {
        let tmp = TempDir::new(tag);
        let bin = tmp.path().join("bin");
        std::fs::create_dir_all(&bin).expect("bin dir");
        std::os::unix::fs::symlink(tunnelgate_bin(), bin.join("tunnelgate")).expect("link");
        let root = tmp.path().join("root");
        Stage { tmp, bin, root }
    }

    fn rewrite(&self, line: &str) -> String {
        let etc = format!("{}/etc/tunnelgate", self.root.display());
        line.replace("/etc/tunnelgate", &etc).replace(
            "scripts/install.sh",
            &format!(
                "DESTDIR={} scripts/install.sh --prebuilt {}",
                self.root.display(),
                self.bin.display()
            ),
        )
    }

    /// Runs `lines` (rewritten) in one bash from the checkout; PATH finds what install.sh put
    /// into ROOT/usr/local/bin first, then the binary under test.
    fn run(&self, lines: &[String]) -> CmdOutput {
        let script: Vec<String> = lines.iter().map(|l| self.rewrite(l)).collect();
        let mut cmd = Command::new("bash");
        cmd.args(["-e", "-o", "pipefail", "-c", &script.join("\n")]);
        cmd.current_dir(repo(""));
        let path = format!(
            "{}:{}:{}",
            self.root.join("usr/local/bin").display(),
            self.bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        cmd.env("PATH", path);
        let out = output_of(cmd, None);
        assert!(
            out.success(),
            "the steps failed:\n{}\n{out:?}",
            script.join("\n")
        );
        out
    }
}

#[test]
fn the_block_readers_find_the_steps() {
    let header = "# x\n#\n# Setup (as root):\n#   a one\n#   b two  # c\n#\n# more\n[interface]\n";
    assert_eq!(
        setup_block(header),
        Some(vec!["a one".to_string(), "b two  # c".to_string()])
    );
    assert_eq!(setup_block("# no block\n"), None);
    let md = "# T\n\n```sh\nno\n```\n\n## Install\n\ntext\n\n```sh\none\ntwo\n```\n";
    assert_eq!(
        sh_block_after(md, "## Install"),
        Some(vec!["one".to_string(), "two".to_string()])
    );
    let lines = vec![
        "x".to_string(),
        "tunnelgate check --config f".to_string(),
        "systemctl start".to_string(),
    ];
    assert_eq!(up_to_check(&lines), lines[..2]);
}

#[test]
fn every_example_config_passes_check_after_its_setup_steps() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo("config"))
        .expect("config/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    for file in files {
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        let text = std::fs::read_to_string(&file).expect("example");
        let steps = setup_block(&text)
            .unwrap_or_else(|| panic!("config/{name} has no `# Setup` block in its header"));
        let steps = up_to_check(&steps);
        assert!(
            steps
                .iter()
                .any(|l| l.contains(&format!("config/{name} /etc/tunnelgate/"))),
            "config/{name}'s steps copy it into place: {steps:#?}"
        );
        let stage = Stage::new("tx-example");
        let out = stage.run(&steps);
        // check prints the plan (the interface it would create) and no error.
        assert!(
            out.stdout.contains("interface"),
            "config/{name}: {}",
            out.stdout
        );
        assert!(
            !out.stderr.to_lowercase().contains("error"),
            "config/{name}: {}",
            out.stderr
        );
        drop(stage.tmp);
    }
}

#[test]
fn router_md_install_steps_run_and_pass_check() {
    let text = std::fs::read_to_string(repo("docs/router.md")).expect("router.md");
    let block = sh_block_after(&text, "## Install").expect("an sh block under ## Install");
    let steps = up_to_check(&block);
    assert!(
        steps.iter().any(|l| l.starts_with("scripts/install.sh")),
        "router.md installs with scripts/install.sh: {steps:#?}"
    );
    let stage = Stage::new("tx-router-md");
    stage.run(&steps);
    let etc = stage.root.join("etc/tunnelgate");
    for key in ["private.key", "psk"] {
        let meta = std::fs::metadata(etc.join(key)).unwrap_or_else(|e| panic!("{key}: {e}"));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{key}");
    }
    // The file the steps copied really needs the psk they made.
    let config = std::fs::read_to_string(etc.join("tunnelgate.toml")).expect("config");
    assert!(config.contains("preshared_key_file = \"psk\""), "{config}");
    // And the tunnelgate they ran was the one install.sh put on PATH.
    assert!(stage.root.join("usr/local/bin/tunnelgate").exists());
    assert!(stage.root.join("usr/local/bin/tunnelgate-wg").is_symlink());
}
