//! The shipped examples pass as shipped: for every file in `config/`, the shell lines of its
//! header's `# Setup` block, and the install block of `docs/router.md`, run as written (only
//! `/etc` moved into a temp dir, `sudo` left out, and `scripts/install.sh` into a `DESTDIR` with
//! the binary under test) up to their `tunnelgate check`, which must then pass; and, run by a
//! non-root user with sudo (root: `-- --ignored`), the README's key commands and its two
//! commands (`sudo scripts/demo.sh`, `sudo scripts/test.sh`) with cargo only in that user's
//! `~/.cargo/bin`, as rustup puts it.

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
        .position(|l| {
            let l = l.trim_start();
            l.strip_prefix("sudo ")
                .unwrap_or(l)
                .starts_with("tunnelgate check ")
        })
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
        // Every key the steps made is 0600 (umask 077, no chmod after the fact).
        let etc = stage.root.join("etc/tunnelgate");
        let keys: Vec<PathBuf> = ["private.key", "psk"]
            .iter()
            .map(|k| etc.join(k))
            .filter(|p| p.exists())
            .collect();
        assert!(!keys.is_empty(), "config/{name}: no key made");
        for key in keys {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&key).expect("key").permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "config/{name}: {}", key.display());
        }
        drop(stage.tmp);
    }
}

#[test]
fn router_md_install_steps_run_and_pass_check() {
    let text = std::fs::read_to_string(repo("docs/router.md")).expect("router.md");
    let block = sh_block_after(&text, "## Install").expect("an sh block under ## Install");
    // Typed by a user with sudo; run here by the test's own user into a temp root.
    let block: Vec<String> = block.iter().map(|l| l.replace("sudo ", "")).collect();
    let steps = up_to_check(&block);
    assert!(
        steps.iter().any(|l| l.starts_with("scripts/install.sh")),
        "router.md installs with scripts/install.sh, as the user: {steps:#?}"
    );
    // Keys are made under umask 077, never world-readable for an instant before a chmod.
    for key in ["genkey", "genpsk"] {
        let line = steps.iter().find(|l| l.contains(key));
        let line = line.unwrap_or_else(|| panic!("no {key} line: {steps:#?}"));
        assert!(
            line.contains("umask 077") && !line.contains("chmod"),
            "{line}"
        );
    }
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

/// A user made for one test, with a home and a sudoers rule that lets it run anything as root
/// (without a password; `sudo`'s PATH is `bin` first, so `tunnelgate` is the binary under test,
/// and has no `~/.cargo/bin`, as Debian's `secure_path`). The rule goes first, then the user and
/// its home, when dropped.
struct SudoUser {
    name: String,
    home: PathBuf,
    sudoers: PathBuf,
}

impl SudoUser {
    fn new(bin: &Path) -> SudoUser {
        // Unique per test binary and call: the tests of this file may run at once.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("tgsudo{}x{n}", std::process::id() % 100_000);
        let home = PathBuf::from(format!("/home/{name}"));
        let _ = Command::new("userdel").args(["-r", &name]).output();
        // useradd makes the home, not its parent (a minimal container may have no /home).
        std::fs::create_dir_all("/home").expect("/home");
        let made = output_of(
            {
                let mut c = Command::new("useradd");
                c.args(["--create-home", "--user-group", "--shell", "/bin/sh"])
                    .arg("--home-dir")
                    .arg(&home)
                    .arg(&name);
                c
            },
            None,
        );
        assert!(made.success(), "useradd: {made:?}");
        let sudoers = PathBuf::from(format!("/etc/sudoers.d/tunnelgate-test-{name}"));
        let user = SudoUser {
            name,
            home,
            sudoers,
        };
        let rule = format!(
            "Defaults:{0} secure_path=\"{1}:/usr/sbin:/usr/bin:/sbin:/bin\"\n\
             {0} ALL=(root) NOPASSWD: ALL\n",
            user.name,
            bin.display()
        );
        let staged = user.sudoers.with_extension("tmp");
        std::fs::write(&staged, rule).expect("sudoers rule");
        let checked = output_of(
            {
                let mut c = Command::new("visudo");
                c.arg("-cf").arg(&staged);
                c
            },
            None,
        );
        assert!(checked.success(), "visudo: {checked:?}");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o440)).expect("chmod");
        std::fs::rename(&staged, &user.sudoers).expect("sudoers.d");
        user
    }

    /// `script` in bash as this user (`runuser`), from `dir`.
    fn run(&self, script: &str, dir: &Path) -> CmdOutput {
        let mut c = Command::new("runuser");
        c.args([
            "-u", &self.name, "--", "bash", "-e", "-o", "pipefail", "-c", script,
        ])
        .current_dir(dir)
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
        output_of(c, None)
    }
}

impl Drop for SudoUser {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.sudoers);
        let _ = Command::new("userdel").args(["-r", &self.name]).output();
        let _ = std::fs::remove_dir_all(&self.home);
    }
}

/// Gives `path` and everything under it to `user`.
fn chown_to(user: &SudoUser, path: &Path) {
    let owned = output_of(
        {
            let mut c = Command::new("chown");
            c.arg("-R").arg(format!("{0}:{0}", user.name)).arg(path);
            c
        },
        None,
    );
    assert!(owned.success(), "chown: {owned:?}");
}

/// Whether sudo is here to test with; without it the test skips ([`skip`]: CI must have it,
/// and scripts/test.sh installs it).
fn sudo_or_skip() -> bool {
    let found = Path::new("/usr/bin/sudo").exists();
    if !found {
        skip("sudo is not installed (apt-get install --no-install-recommends sudo)");
    }
    found
}

/// The README's key commands ("Connecting a standard WireGuard peer"), run as written by a
/// non-root user with sudo (only `/etc/tunnelgate` moved into a temp dir): the folder is root's
/// and 0700, the key root's and 0600 from the start, and the public key printed is the key's.
/// The form they replace, `sudo tunnelgate pubkey < /etc/tunnelgate/private.key`, fails for that
/// user: the redirection is the user's own. Needs root (a user, a sudoers rule, runuser) and
/// sudo: `cargo test --test examples -- --ignored`.
#[test]
#[ignore = "needs root and sudo"]
fn readme_key_commands_work_for_a_non_root_user_with_sudo() {
    require_root();
    if !sudo_or_skip() {
        return;
    }
    let readme = std::fs::read_to_string(repo("README.md")).expect("README");
    let rest = &readme[readme.find("On the tunnelgate host").expect("the section")..];
    // The first sh block of the section.
    let block = sh_block_after(rest, "```sh").expect("the key commands");
    assert!(
        block.iter().any(|l| l.contains("pubkey")) && block.iter().any(|l| l.contains("genkey")),
        "{block:#?}"
    );
    let stage = Stage::new("tx-readme-sudo");
    std::fs::create_dir_all(stage.root.join("etc")).expect("ROOT/etc");
    let user = SudoUser::new(&stage.bin);
    let script: Vec<String> = block.iter().map(|l| stage.rewrite(l)).collect();
    let out = user.run(&script.join("\n"), stage.tmp.path());
    assert!(
        out.success(),
        "as {}:\n{}\n{out:?}",
        user.name,
        script.join("\n")
    );

    use std::os::unix::fs::MetadataExt;
    let etc = stage.root.join("etc/tunnelgate");
    let key_path = etc.join("private.key");
    for (path, mode) in [(&etc, 0o700), (&key_path, 0o600)] {
        let meta = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(meta.mode() & 0o7777, mode, "{}", path.display());
        assert_eq!(meta.uid(), 0, "{} is root's", path.display());
    }
    let key = std::fs::read_to_string(&key_path).expect("key");
    let pubkey = tunnelgate_cli(&["pubkey"], Some(&key));
    assert!(pubkey.success(), "{pubkey:?}");
    assert_eq!(
        out.stdout.trim(),
        pubkey.stdout.trim(),
        "the README's pubkey line prints the key's public key"
    );

    // What the README said before: the user's shell opens the key, and may not.
    let old = user.run(
        &format!("sudo tunnelgate pubkey < {}", key_path.display()),
        stage.tmp.path(),
    );
    assert!(!old.success(), "{old:?}");
    assert!(old.stderr.contains("Permission denied"), "{old:?}");
}

/// The commands of the README's "The two commands" block: each line's command, without its
/// comment (`sudo scripts/demo.sh`, `sudo scripts/test.sh`).
fn the_two_commands(readme: &str) -> Vec<String> {
    let block = sh_block_after(readme, "## The two commands").expect("the two commands' block");
    block
        .iter()
        .map(|l| l.split('#').next().unwrap_or_default().trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The README's two commands, typed by a user whose Rust comes from rustup (cargo only in
/// `~/.cargo/bin`, which sudo's PATH drops) in a checkout of their own, get past finding cargo:
/// each with `--print-cargo`, which resolves cargo as the full run would, runs its `--version`
/// and exits. The demo builds as that user (its files stay theirs), the tests run cargo as root
/// with that user's toolchain. The user's cargo is a stand-in that says who ran it (root's
/// toolchain is under /root, which the user may not enter). Before the scripts found the
/// user's cargo, both stopped at `cargo: command not found`.
#[test]
#[ignore = "needs root and sudo"]
fn readme_two_commands_find_a_rustup_users_cargo_through_sudo() {
    require_root();
    if !sudo_or_skip() {
        return;
    }
    let readme = std::fs::read_to_string(repo("README.md")).expect("README");
    let commands = the_two_commands(&readme);
    assert_eq!(
        commands,
        ["sudo scripts/demo.sh", "sudo scripts/test.sh"],
        "the README's two commands"
    );
    let stage = Stage::new("tx-two-commands");
    let user = SudoUser::new(&stage.bin);
    // A checkout of their own: the scripts and what they read.
    let checkout = user.home.join("tunnelgate");
    std::fs::create_dir_all(checkout.join("scripts")).expect("checkout");
    for entry in std::fs::read_dir(repo("scripts"))
        .expect("scripts/")
        .flatten()
    {
        std::fs::copy(
            entry.path(),
            checkout.join("scripts").join(entry.file_name()),
        )
        .expect("copy a script");
    }
    std::fs::copy(repo("Cargo.toml"), checkout.join("Cargo.toml")).expect("Cargo.toml");
    // rustup's place for cargo, and only there.
    let cargo_bin = user.home.join(".cargo/bin");
    std::fs::create_dir_all(&cargo_bin).expect("~/.cargo/bin");
    let cargo = cargo_bin.join("cargo");
    std::fs::write(
        &cargo,
        "#!/bin/sh\necho \"cargo 1.95.0-stand-in (run by $(id -un))\"\n",
    )
    .expect("stand-in cargo");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    chown_to(&user, &user.home);

    // The premise: cargo is on the user's PATH, not on sudo's.
    let home = user.home.display();
    let theirs = user.run(
        &format!("PATH={home}/.cargo/bin:$PATH; cargo --version"),
        &checkout,
    );
    assert!(theirs.stdout.contains("run by tgsudo"), "{theirs:?}");
    let sudos = user.run("sudo sh -c 'command -v cargo'", &checkout);
    assert!(!sudos.success(), "sudo's PATH has a cargo: {sudos:?}");

    for (command, runs_as) in commands.iter().zip([user.name.as_str(), "root"]) {
        let out = user.run(
            &format!("PATH={home}/.cargo/bin:$PATH; {command} --print-cargo"),
            &checkout,
        );
        assert!(
            out.success(),
            "{command} --print-cargo as {}: {out:?}",
            user.name
        );
        assert!(
            out.stdout
                .contains(&format!("cargo: {home}/.cargo/bin/cargo, run as {runs_as}")),
            "{command}: {out:?}"
        );
        assert!(
            out.stdout
                .contains(&format!("cargo 1.95.0-stand-in (run by {runs_as})")),
            "{command}: {out:?}"
        );
    }
}

/// docs/router.md's install block as written, `sudo`s included, typed by a non-root user with
/// sudo from the checkout: `scripts/install.sh` as that user (into a `DESTDIR` of theirs, with the
/// binary under test), the keys root's and 0600 from the start, and `sudo tunnelgate check`
/// passing. The form it replaces, "as root", would have sent the user to a root without cargo.
#[test]
#[ignore = "needs root and sudo"]
fn router_md_install_steps_work_for_a_non_root_user_with_sudo() {
    require_root();
    if !sudo_or_skip() {
        return;
    }
    let text = std::fs::read_to_string(repo("docs/router.md")).expect("router.md");
    let block = sh_block_after(&text, "## Install").expect("an sh block under ## Install");
    let steps = up_to_check(&block);
    assert!(
        steps
            .iter()
            .any(|l| l.starts_with("sudo tunnelgate check ")),
        "{steps:#?}"
    );
    let stage = Stage::new("tx-router-sudo");
    let user = SudoUser::new(&stage.bin);
    std::fs::create_dir_all(&stage.root).expect("ROOT");
    chown_to(&user, &stage.root);
    let script: Vec<String> = steps.iter().map(|l| stage.rewrite(l)).collect();
    let out = user.run(&script.join("\n"), &repo(""));
    assert!(
        out.success(),
        "as {}:\n{}\n{out:?}",
        user.name,
        script.join("\n")
    );
    assert!(out.stdout.contains("interface"), "check's plan: {out:?}");

    use std::os::unix::fs::MetadataExt;
    let etc = stage.root.join("etc/tunnelgate");
    for key in ["private.key", "psk"] {
        let meta = std::fs::metadata(etc.join(key)).unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(meta.mode() & 0o7777, 0o600, "{key}");
        assert_eq!(meta.uid(), 0, "{key} is root's");
    }
    // install.sh ran as the user: what it installed is theirs.
    let installed = std::fs::metadata(stage.root.join("usr/local/bin/tunnelgate")).expect("bin");
    assert_ne!(installed.uid(), 0, "scripts/install.sh ran as the user");
}

/// One iperf figure everywhere: the demo reads tunnelgate's one-stream figure from the run file
/// the README's Performance table cites, the table shows that run's median, and the README's
/// "about N Gbit/s at both ends" is that figure rounded.
#[test]
fn the_demo_and_the_readme_give_the_run_files_iperf_figure() {
    let readme = std::fs::read_to_string(repo("README.md")).expect("README");
    let demo = std::fs::read_to_string(repo("scripts/demo.sh")).expect("demo");
    let run_file = demo
        .lines()
        .find_map(|l| l.strip_prefix("RUN_FILE="))
        .expect("the demo's RUN_FILE");
    assert!(
        readme.contains(&format!("[run file]({run_file})")),
        "the README's Performance section cites {run_file}"
    );
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo(run_file)).expect("run file"))
            .expect("JSON");
    let mut tcp1: Vec<f64> = run["setups"]["tunnelgate"]["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .filter(|r| r["test"] == "tcp1")
        .filter_map(|r| r["bps"].as_f64())
        .collect();
    tcp1.sort_by(f64::total_cmp);
    assert!(!tcp1.is_empty());
    let median = tcp1[tcp1.len() / 2] / 1e9;
    let table = format!("| TCP, 1 stream | **{median:.2} Gbit/s** |");
    assert!(readme.contains(&table), "the table's figure is {median:.2}");
    let about = format!("about {median:.0} Gbit/s at both ends");
    assert!(readme.contains(&about), "the README says {about:?}");
    assert!(
        !demo.contains("about 6 Gbit/s") && demo.contains("$BOTH_ENDS Gbit/s"),
        "the demo prints the run file's figure"
    );
}

/// The README's and install.md's clone line, run as written with `REPO` set to this checkout
/// (the URL a user has it from): it makes a checkout named `tunnelgate` and enters it.
#[test]
fn the_clone_line_makes_a_checkout() {
    for page in ["README.md", "docs/install.md"] {
        let text = std::fs::read_to_string(repo(page)).expect("page");
        let line = text
            .lines()
            .find(|l| l.starts_with("git clone "))
            .unwrap_or_else(|| panic!("{page} has no clone line"));
        let line = line.split(" #").next().unwrap_or_default().trim();
        let tmp = TempDir::new("tx-clone");
        // Under `sudo scripts/test.sh` the test runs as root and the checkout is the user's:
        // git refuses to read a repository of another owner unless the (global) config says so.
        let config = tmp.path().join("gitconfig");
        std::fs::write(&config, "[safe]\n\tdirectory = *\n").expect("gitconfig");
        let mut cmd = Command::new("bash");
        cmd.args(["-e", "-c", &format!("{line}\ntest -f Cargo.toml && pwd")])
            .current_dir(tmp.path())
            .env("GIT_CONFIG_GLOBAL", &config)
            .env("REPO", repo(""));
        let out = output_of(cmd, None);
        assert!(out.success(), "{page}: {line}: {out:?}");
        assert_eq!(
            Path::new(out.stdout.trim()),
            tmp.path().join("tunnelgate"),
            "{page}: the line ends in the checkout"
        );
    }
}

/// The README's peer key line, run as written in an empty folder: `peer.key` is 0600 from the
/// start (never readable by others in between), and what it prints is that key's public key.
#[test]
fn the_readmes_peer_key_line_writes_a_private_key() {
    if !Path::new("/usr/bin/wg").exists() {
        skip("wg is not installed (apt-get install --no-install-recommends wireguard-tools)");
        return;
    }
    let readme = std::fs::read_to_string(repo("README.md")).expect("README");
    let line = readme
        .split('`')
        .find(|code| code.contains("tee peer.key"))
        .expect("the peer key line");
    assert!(line.contains("umask 077"), "{line}");
    let tmp = TempDir::new("tx-peer-key");
    let mut cmd = Command::new("bash");
    cmd.args(["-e", "-o", "pipefail", "-c", line])
        .current_dir(tmp.path());
    let out = output_of(cmd, None);
    assert!(out.success(), "{line}: {out:?}");
    use std::os::unix::fs::PermissionsExt;
    let key = tmp.path().join("peer.key");
    let mode = std::fs::metadata(&key)
        .expect("peer.key")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "peer.key");
    let private = std::fs::read_to_string(&key).expect("key");
    let public = tunnelgate_cli(&["pubkey"], Some(&private));
    assert_eq!(
        out.stdout.trim(),
        public.stdout.trim(),
        "PEER_PUB is the key's"
    );
}

/// install.md's steps "without either script", run as written but for the build (the binary
/// under test stands in) and `systemctl`, with `sudo` left out and `/usr/local` and `/etc` moved
/// into a temporary root: the binary the units run is there, the link resolves to it, and the
/// key folder is 0700.
#[test]
fn install_md_steps_without_either_script_give_the_units_their_binary() {
    let text = std::fs::read_to_string(repo("docs/install.md")).expect("install.md");
    let block =
        sh_block_after(&text, "## Without either script").expect("an sh block under the heading");
    assert!(
        block.iter().any(|l| l.starts_with("cargo build --release")),
        "{block:#?}"
    );
    let stage = Stage::new("tx-no-script");
    let root = stage.root.display().to_string();
    let steps: Vec<String> = block
        .iter()
        .filter(|l| !l.starts_with("cargo build") && !l.contains("systemctl"))
        .map(|l| {
            l.replace("sudo ", "")
                .replace(
                    "target/release/tunnelgate",
                    &stage.bin.join("tunnelgate").display().to_string(),
                )
                .replace("/usr/local/", &format!("{root}/usr/local/"))
                .replace("/etc/", &format!("{root}/etc/"))
        })
        .collect();
    for dir in ["usr/local/bin", "etc/systemd/system"] {
        std::fs::create_dir_all(stage.root.join(dir)).expect("the root's folders");
    }
    let mut cmd = Command::new("bash");
    cmd.args(["-e", "-c", &steps.join("\n")])
        .current_dir(repo(""));
    let out = output_of(cmd, None);
    assert!(out.success(), "{steps:#?}\n{out:?}");
    for unit in ["tunnelgate.service", "tunnelgate@.service"] {
        let text = std::fs::read_to_string(stage.root.join("etc/systemd/system").join(unit))
            .expect("the unit");
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .expect("ExecStart");
        let binary = exec.split_whitespace().next().unwrap_or_default();
        assert!(
            stage.root.join(binary.trim_start_matches('/')).is_file(),
            "{unit} runs {binary}, which the steps installed"
        );
    }
    let wg = stage.root.join("usr/local/bin/tunnelgate-wg");
    assert!(wg.is_symlink() && wg.is_file(), "the link resolves");
    use std::os::unix::fs::PermissionsExt;
    let etc = std::fs::metadata(stage.root.join("etc/tunnelgate")).expect("/etc/tunnelgate");
    assert_eq!(etc.permissions().mode() & 0o777, 0o700);
}
