//! The command line for wg-quick users, without a running tunnel (no root needed):
//! `import wg-quick` (TOML on stdout, keys in 0600 files, every unmapped key named with its
//! line, exit 2 on what is not a wg-quick file and nothing written), `check` of an INI file
//! pointing to `import`, `genpsk`, real help texts, and every unknown key of a TOML reported.

mod common;

use common::{tunnelgate_cli as cli, CmdOutput, TempDir};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

/// RFC 7748 section 6.1: Alice's private key, and Bob's public key.
const PRIVATE: &str = "dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=";
const PEER_PUB: &str = "3p7bfXt9wbTTW2HC7OQ1Nz+DQ8hbeGdNrfx+FG+IK08=";
const PSK: &str = "GmJ0hyhkThm2Nw9Kfxk1V2FYDJ9j1Wd/TPbuM0DyAuo=";

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

fn wg_quick_text() -> String {
    format!(
        "# the office tunnel\n\
         [Interface]\n\
         PrivateKey = {PRIVATE}\n\
         Address = 100.64.0.2/32, fd7a:115c:a1e0::2/128\n\
         ListenPort = 51821\n\
         DNS = 1.1.1.1\n\
         PostUp = iptables -A FORWARD -i %i -j ACCEPT\n\
         SaveConfig = true\n\
         \n\
         [Peer]\n\
         PublicKey = {PEER_PUB}\n\
         PresharedKey = {PSK}\n\
         Endpoint = 192.0.2.1:51820\n\
         AllowedIPs = 100.64.0.1/32\n\
         AllowedIPs = fd7a:115c:a1e0::1/128\n\
         PersistentKeepalive = 25\n"
    )
}

fn import(args: &[&str]) -> CmdOutput {
    let mut all = vec!["import", "wg-quick"];
    all.extend_from_slice(args);
    cli(&all, None)
}

#[test]
fn import_prints_toml_writes_0600_keys_and_names_what_it_left_out() {
    let dir = TempDir::new("import");
    let conf = dir.write("wg7.conf", &wg_quick_text());
    let out = import(&[&conf.display().to_string()]);
    assert_eq!(out.code, Some(0), "{out:?}");

    // The keys went to 0600 files beside the file, never to stdout.
    let key = dir.path().join("wg7.key");
    let psk = dir.path().join("wg7.peer0.psk");
    assert_eq!(dir.read("wg7.key").trim(), PRIVATE);
    assert_eq!(dir.read("wg7.peer0.psk").trim(), PSK);
    assert_eq!(mode_of(&key), 0o600);
    assert_eq!(mode_of(&psk), 0o600);
    assert!(!out.stdout.contains(PRIVATE) && !out.stdout.contains(PSK));
    assert!(!out.stderr.contains(PRIVATE) && !out.stderr.contains(PSK));
    assert!(
        out.stdout
            .contains(&format!("private_key_file = \"{}\"", key.display())),
        "{}",
        out.stdout
    );

    // Every key it could not map, with its line.
    for needle in ["line 6: DNS", "line 7: PostUp", "line 8: SaveConfig"] {
        assert!(out.stderr.contains(needle), "{needle}: {}", out.stderr);
    }

    // The TOML is a valid tunnelgate config, with what the INI said.
    let toml = dir.write("tunnelgate.toml", &out.stdout);
    let check = cli(&["check", "--config", &toml.display().to_string()], None);
    assert_eq!(check.code, Some(0), "{check:?}\n{}", out.stdout);
    for needle in ["wg7", "100.64.0.2/32", "fd7a:115c:a1e0::2/128"] {
        assert!(check.stdout.contains(needle), "{needle}: {}", check.stdout);
    }
    for needle in [
        "listen_port = 51821",
        "endpoint = \"192.0.2.1:51820\"",
        "allowed_ips = [\"100.64.0.1/32\", \"fd7a:115c:a1e0::1/128\"]",
        "persistent_keepalive = 25",
        &format!("public_key = \"{PEER_PUB}\""),
        &format!("preshared_key_file = \"{}\"", psk.display()),
    ] {
        assert!(out.stdout.contains(needle), "{needle}: {}", out.stdout);
    }

    // Again, to another key file: the same TOML but for the path, the same 0600 key.
    let other = dir.path().join("elsewhere.key");
    let again = import(&[
        &conf.display().to_string(),
        "--key-file",
        &other.display().to_string(),
    ]);
    assert_eq!(again.code, Some(0), "{again:?}");
    assert_eq!(dir.read("elsewhere.key").trim(), PRIVATE);
    assert_eq!(mode_of(&other), 0o600);
    assert!(again
        .stdout
        .contains(&format!("private_key_file = \"{}\"", other.display())));
}

#[test]
fn what_is_not_a_wg_quick_file_exits_2_and_writes_nothing() {
    let dir = TempDir::new("import-bad");
    let cases = [
        (
            "tg0.conf",
            "[interface]\nname = \"tg0\"\naddresses = [\"10.0.0.1/32\"]\n[[peer]]\n",
            "not a wg-quick config",
        ),
        ("empty.conf", "", "no [Interface]"),
        (
            "badkey.conf",
            "[Interface]\nPrivateKey = not-a-key\nAddress = 10.0.0.1/24\n",
            "line 2: PrivateKey",
        ),
        (
            "a-name-far-too-long-for-linux.conf",
            &format!("[Interface]\nPrivateKey = {PRIVATE}\n"),
            "not an interface name",
        ),
    ];
    for (name, text, needle) in cases {
        let path = dir.write(name, text);
        let out = import(&[&path.display().to_string()]);
        assert_eq!(out.code, Some(2), "{name}: {out:?}");
        assert!(out.stderr.contains(needle), "{name}: {}", out.stderr);
        assert!(out.stdout.is_empty(), "{name}: {}", out.stdout);
    }
    let written: Vec<String> = std::fs::read_dir(dir.path())
        .expect("dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".conf"))
        .collect();
    assert!(written.is_empty(), "written: {written:?}");
    let missing = import(&[&dir.path().join("nosuch.conf").display().to_string()]);
    assert_eq!(missing.code, Some(2), "{missing:?}");
}

#[test]
fn check_and_run_of_a_wg_quick_file_point_to_import() {
    let dir = TempDir::new("check-ini");
    let conf = dir.write("wg0.conf", &wg_quick_text());
    let path = conf.display().to_string();
    for args in [
        &["check", "--config", &path][..],
        &["run", "--config", &path],
    ] {
        let out = cli(args, None);
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert!(
            out.stderr
                .contains(&format!("tunnelgate import wg-quick {path}")),
            "{args:?}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains(PRIVATE), "{}", out.stderr);
    }
}

#[test]
fn genpsk_prints_fresh_32_byte_keys() {
    let a = cli(&["genpsk"], None);
    let b = cli(&["genpsk"], None);
    assert!(a.success() && b.success(), "{a:?} {b:?}");
    let (a, b) = (a.stdout.trim(), b.stdout.trim());
    assert_ne!(a, b);
    for k in [a, b] {
        assert_eq!(k.len(), 44, "{k}");
        assert!(k.ends_with('=') && !k.ends_with("=="), "{k}");
    }
    // A preshared key is what `wg` takes as one.
    let have_wg = std::process::Command::new("wg")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if have_wg {
        let mut cmd = std::process::Command::new("wg");
        cmd.arg("pubkey");
        let out = common::output_of(cmd, Some(a));
        assert!(out.success(), "wg rejects {a}: {out:?}");
    }
}

#[test]
fn help_of_a_subcommand_is_its_real_help() {
    let run = cli(&["help", "run"], None);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.stdout, cli(&["run", "--help"], None).stdout);
    for needle in ["Run the daemon", "--config", "--log-format", "--seccomp"] {
        assert!(run.stdout.contains(needle), "{needle}: {}", run.stdout);
    }
    // --log-format lists its values instead of pointing elsewhere.
    for needle in ["human", "json", "journal"] {
        assert!(run.stdout.contains(needle), "{needle}: {}", run.stdout);
    }
    assert!(!run.stdout.contains("module doc"), "{}", run.stdout);

    let nested = cli(&["help", "import", "wg-quick"], None);
    assert_eq!(nested.code, Some(0), "{nested:?}");
    assert!(nested.stdout.contains("--key-file"), "{}", nested.stdout);
    let status = cli(&["help", "status"], None);
    assert!(status.stdout.contains("--all"), "{}", status.stdout);
    let top = cli(&["help"], None);
    for sub in ["import", "genpsk", "status"] {
        assert!(top.stdout.contains(sub), "{sub}: {}", top.stdout);
    }
    assert_eq!(cli(&["help", "nosuch"], None).code, Some(2));
}

#[test]
fn every_unknown_key_is_reported_with_a_suggestion() {
    let dir = TempDir::new("unknown-keys");
    dir.write_secret("private.key", &format!("{PRIVATE}\n"));
    let path = dir.write(
        "tunnelgate.toml",
        &format!(
            "[interface]\nname = \"tgunk0\"\nprivate_key_file = \"private.key\"\n\
             addresses = [\"100.64.0.1/32\"]\nlisten_prot = 51820\nmtu = 100\n\n\
             [[peer]]\npublic_key = \"{PEER_PUB}\"\nallowed_ips = [\"100.64.0.2/32\"]\n\n\
             [[peer]]\npublic_key = \"{PEER_PUB}\"\nallowd_ips = [\"100.64.0.3/32\"]\nPersistentKeepalive = 25\n\n\
             [helth]\nlisten = \"\"\n"
        ),
    );
    let out = cli(&["check", "--config", &path.display().to_string()], None);
    assert_eq!(out.code, Some(2), "{out:?}");
    for needle in [
        "interface.listen_prot: unknown field `listen_prot`: did you mean `listen_port`?",
        "peer[1].allowd_ips: unknown field `allowd_ips`: did you mean `allowed_ips`?",
        "peer[1].PersistentKeepalive: unknown field `PersistentKeepalive`: did you mean `persistent_keepalive`?",
        "helth: unknown field `helth`: did you mean `health`?",
        // The other problems of the same file, in the same pass.
        "interface.mtu: ",
    ] {
        assert!(out.stderr.contains(needle), "{needle}:\n{}", out.stderr);
    }
}

/// The names in `dir` other than the wg-quick inputs (`*.conf`).
fn outputs_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".conf"))
        .collect();
    names.sort();
    names
}

#[test]
fn an_existing_key_file_is_replaced_only_with_force() {
    let dir = TempDir::new("import-exists");
    let conf = dir.write("wg7.conf", &wg_quick_text());
    let conf = conf.display().to_string();
    let theirs = format!("{PEER_PUB}\n");
    let key = dir.write_secret("wg7.key", &theirs);

    let out = import(&[&conf]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr
            .contains(&format!("{} already exists", key.display()))
            && out.stderr.contains("--force")
            && out.stderr.contains("nothing was written"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    assert_eq!(dir.read("wg7.key"), theirs, "the other key is kept");
    assert_eq!(outputs_in(dir.path()), ["wg7.key"], "not even the PSK");

    // Only the PSK exists: still refused, and the private key is not written either.
    std::fs::remove_file(&key).expect("rm");
    dir.write_secret("wg7.peer0.psk", &theirs);
    let out = import(&[&conf]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains("wg7.peer0.psk already exists"),
        "{}",
        out.stderr
    );
    assert_eq!(outputs_in(dir.path()), ["wg7.peer0.psk"]);

    let forced = import(&[&conf, "--force"]);
    assert_eq!(forced.code, Some(0), "{forced:?}");
    assert_eq!(dir.read("wg7.key").trim(), PRIVATE);
    assert_eq!(dir.read("wg7.peer0.psk").trim(), PSK);
    assert_eq!(mode_of(&dir.path().join("wg7.peer0.psk")), 0o600);
    assert!(
        forced.stderr.contains("replaced ") && forced.stderr.contains("wrote "),
        "{}",
        forced.stderr
    );
    assert_eq!(outputs_in(dir.path()), ["wg7.key", "wg7.peer0.psk"]);
}

#[test]
fn a_failed_write_leaves_the_old_keys_and_no_temporaries() {
    let dir = TempDir::new("import-fail");
    let conf = dir.write("wg7.conf", &wg_quick_text());
    let old = format!("{PEER_PUB}\n");
    dir.write_secret("wg7.key", &old);
    // The PSK's path is a folder: it can be neither written nor replaced.
    std::fs::create_dir(dir.path().join("wg7.peer0.psk")).expect("mkdir");
    let out = import(&[&conf.display().to_string(), "--force"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("wg7.peer0.psk"), "{}", out.stderr);
    assert!(out.stderr.contains("nothing was written"), "{}", out.stderr);
    assert_eq!(dir.read("wg7.key"), old, "the old key is untouched");
    assert_eq!(outputs_in(dir.path()), ["wg7.key", "wg7.peer0.psk"]);
    assert!(out.stdout.is_empty());

    // A folder that does not exist: nothing written, truthfully.
    let nowhere = dir.path().join("nosuch/wg7.key");
    let out = import(&[
        &conf.display().to_string(),
        "--key-file",
        &nowhere.display().to_string(),
    ]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("nothing was written"), "{}", out.stderr);
    assert_eq!(outputs_in(dir.path()), ["wg7.key", "wg7.peer0.psk"]);
}

#[test]
fn a_key_file_that_is_the_input_is_refused_however_spelt() {
    let dir = TempDir::new("import-self");
    let text = wg_quick_text();
    let conf = dir.write("wg7.conf", &text);
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).expect("mkdir");
    let dotdot = format!(
        "{}/../{}",
        sub.display(),
        conf.file_name().expect("name").to_string_lossy()
    );
    let link = dir.path().join("link.key");
    std::os::unix::fs::symlink(&conf, &link).expect("symlink");
    for key_file in [dotdot, link.display().to_string()] {
        for force in [false, true] {
            let mut args = vec![conf.to_str().expect("utf-8"), "--key-file", &key_file];
            if force {
                args.push("--force");
            }
            let out = import(&args);
            assert_eq!(out.code, Some(2), "{key_file} {force}: {out:?}");
            assert!(
                out.stderr.contains("is the file being imported"),
                "{}",
                out.stderr
            );
            assert_eq!(std::fs::read_to_string(&conf).expect("conf"), text);
        }
    }
    assert!(std::fs::symlink_metadata(&link).is_ok());
    assert_eq!(outputs_in(dir.path()), ["link.key", "sub"]);
}

#[test]
fn values_check_refuses_exit_2_and_write_nothing() {
    let dir = TempDir::new("import-values");
    let peer = |endpoint: &str, key: &str| {
        format!("[Peer]\nPublicKey = {key}\nEndpoint = {endpoint}\nAllowedIPs = 100.64.0.9/32\n")
    };
    let base = format!("[Interface]\nPrivateKey = {PRIVATE}\nAddress = 100.64.0.2/32\n");
    let own = {
        let out = cli(&["pubkey"], Some(PRIVATE));
        out.stdout.trim().to_string()
    };
    let cases = [
        (peer("-oProxyCommand=x:1", PEER_PUB), "line 6: Endpoint"),
        (peer("host:0", PEER_PUB), "line 6: Endpoint"),
        (peer("ho\u{7}st:51820", PEER_PUB), "line 6: Endpoint"),
        (
            format!(
                "{}{}",
                peer("192.0.2.1:1", PEER_PUB),
                peer("192.0.2.2:1", PEER_PUB).replace("100.64.0.9", "100.64.0.10")
            ),
            "line 9: PublicKey",
        ),
        (peer("192.0.2.1:1", &own), "own public key"),
    ];
    for (i, (peers, needle)) in cases.iter().enumerate() {
        let name = format!("wg{i}.conf");
        let path = dir.write(&name, &format!("{base}{peers}"));
        let out = import(&[&path.display().to_string()]);
        assert_eq!(out.code, Some(2), "{name}: {out:?}");
        assert!(out.stderr.contains(needle), "{name}: {}", out.stderr);
        assert!(!out.stderr.contains('\u{7}'), "{:?}", out.stderr);
        assert!(out.stdout.is_empty());
    }
    assert!(
        outputs_in(dir.path()).is_empty(),
        "{:?}",
        outputs_in(dir.path())
    );
}

#[test]
fn a_huge_input_is_refused_with_a_short_error() {
    let dir = TempDir::new("import-huge");
    // A 2 MiB line: refused at the 1 MiB bound, and not echoed.
    let conf = dir.write(
        "wg0.conf",
        &format!("[Interface]\n{}\n", "A".repeat(2 << 20)),
    );
    let out = import(&[&conf.display().to_string()]);
    assert_eq!(
        out.code,
        Some(2),
        "{}",
        &out.stderr[..out.stderr.len().min(500)]
    );
    assert!(
        out.stderr.contains("larger than 1048576 bytes"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.len() < 500,
        "{} bytes of stderr",
        out.stderr.len()
    );
    // Under the bound, a long bad line is quoted as an excerpt.
    let conf = dir.write(
        "wg1.conf",
        &format!("[Interface]\n{}\n", "A".repeat(500_000)),
    );
    let out = import(&[&conf.display().to_string()]);
    assert_eq!(
        out.code,
        Some(2),
        "{}",
        &out.stderr[..out.stderr.len().min(500)]
    );
    assert!(out.stderr.contains("(500000 bytes)"), "{}", out.stderr);
    assert!(
        out.stderr.len() < 500,
        "{} bytes of stderr",
        out.stderr.len()
    );
    assert!(outputs_in(dir.path()).is_empty());
}

#[test]
fn a_newline_in_the_inputs_path_stays_inside_the_comment() {
    let dir = TempDir::new("import-newline");
    let folder = dir.path().join("x\n[health]\nlisten = \"0.0.0.0:9002\"\n#");
    std::fs::create_dir(&folder).expect("mkdir");
    let conf = folder.join("wg7.conf");
    std::fs::write(&conf, wg_quick_text()).expect("write");
    let key = dir.path().join("wg7.key");
    let out = import(&[
        &conf.display().to_string(),
        "--key-file",
        &key.display().to_string(),
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        !out.stdout.lines().any(|l| l.starts_with("[health]")),
        "{}",
        out.stdout
    );
    assert!(out.stdout.starts_with("# Imported from "), "{}", out.stdout);
    assert!(out
        .stdout
        .lines()
        .next()
        .unwrap_or_default()
        .contains("\\n[health]"));
    let toml = dir.write("tunnelgate.toml", &out.stdout);
    let check = cli(&["check", "--config", &toml.display().to_string()], None);
    assert_eq!(check.code, Some(0), "{check:?}");
    assert!(!check.stdout.contains("9002"), "{}", check.stdout);
}

#[test]
fn fwmark_stays_hex_and_the_post_down_hint_names_exec_stop_post() {
    let dir = TempDir::new("import-small");
    let text = format!(
        "[Interface]\nPrivateKey = {PRIVATE}\nAddress = 100.64.0.2/32\nFwMark = 0xca6c\n\
         PostDown = iptables -D FORWARD -i %i -j ACCEPT\n"
    );
    let conf = dir.write("wg7.conf", &text);
    let out = import(&[&conf.display().to_string()]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("fwmark = 0xca6c"), "{}", out.stdout);
    assert!(
        out.stderr.contains("line 5: PostDown") && out.stderr.contains("ExecStopPost="),
        "{}",
        out.stderr
    );
}
