//! Readiness follows rule failures: firewall tools that fail behind PATH wrappers, per backend.

use super::*;

/// Finds `program` on the test's PATH.
pub(crate) fn which(program: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{program} not found"))
}

/// Writes `dir/<program>` scripts that run the real program unless `flag` exists, in which
/// case they fail with a message, as a broken backend would.
pub(crate) fn failing_wrappers(dir: &TempDir, programs: &[&str], flag: &Path) {
    for p in programs {
        let real = which(p);
        dir.write_mode(
            p,
            &format!(
                "#!/bin/sh\nif [ -e '{}' ]; then\n  echo '{p}: injected failure (tunnelgate test)' >&2\n  exit 1\nfi\nexec '{}' \"$@\"\n",
                flag.display(),
                real.display()
            ),
            0o755,
        );
    }
}

/// With the backend's apply program failing, a hand-made drift cannot be repaired: `/readyz`
/// goes to 503 naming the rules, the failure counter moves; once the program works again the
/// rules come back and `/readyz` is 200.
pub(crate) fn readiness_follows_rule_failures(backend: Backend) {
    let t = Topo::new(backend);
    let bin = TempDir::new("fakebin");
    let flag = bin.path().join("fail");
    failing_wrappers(&bin, backend.apply_programs(), &flag);
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
    );
    let mut tg = t.start_env(
        backend,
        t.config(format!(
            "{}\n{}",
            firewall_toml(backend, "1s"),
            ingress_toml(&["443:8443"])
        )),
        &[("PATH", &path)],
    );
    let fresh = owned_rules(&t.proxy, backend);
    assert!(!fresh.is_empty());
    assert_eq!(tg.health_get("/readyz").map(|r| r.0), Ok(200));
    let m = scrape(&tg);
    let failures = metric_sum(&m, "tunnelgate_rule_apply_failures_total");
    assert_eq!(failures, 0.0, "no failures yet:\n{m}");
    assert!(
        m.contains(&format!("backend=\"{}\"", backend.label())),
        "rule metrics carry backend {}:\n{m}",
        backend.label()
    );

    // Break the backend, then drift the rules.
    std::fs::write(&flag, "").expect("flag file");
    match backend {
        Backend::Nftables => {
            let table = format!("tunnelgate_{}", tg.name());
            t.proxy.exec(&["nft", "delete", "table", "inet", &table]);
        }
        _ => delete_a_rule(&t.proxy, backend, tg.name()),
    }
    let mut last = None;
    let went_down = poll_until(Duration::from_secs(10), || {
        let r = tg.health_get("/readyz");
        let down = matches!(&r, Ok((503, body)) if body.contains("rules"));
        last = Some(r);
        down
    });
    assert!(
        went_down,
        "/readyz did not go to 503 naming the rules: {last:?}\nstderr:\n{}",
        tg.stderr()
    );
    eprintln!("{backend:?}: /readyz while broken: {last:?}");
    // The reason is the backend's own error message, not a side effect of how it failed.
    assert!(
        matches!(&last, Some(Ok((_, body))) if body.contains("injected failure")),
        "/readyz should carry the failing program's message: {last:?}"
    );
    let m = scrape(&tg);
    assert!(
        metric_sum(&m, "tunnelgate_rule_apply_failures_total") > failures,
        "tunnelgate_rule_apply_failures_total did not move:\n{m}"
    );
    assert_eq!(
        metric_sum(&m, "tunnelgate_rules_applied"),
        0.0,
        "rules_applied:\n{m}"
    );
    assert_eq!(metric_sum(&m, "tunnelgate_ready"), 0.0, "ready gauge:\n{m}");
    // It stays down while the backend fails (the repair keeps failing).
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(tg.health_get("/readyz").map(|r| r.0), Ok(503));

    // Fix the backend: the next repair restores the rules and readiness.
    std::fs::remove_file(&flag).expect("remove flag");
    let mut last = None;
    let back = poll_until(Duration::from_secs(10), || {
        let r = tg.health_get("/readyz");
        let ok = matches!(r, Ok((200, _)));
        last = Some(r);
        ok
    });
    assert!(back, "/readyz did not come back to 200: {last:?}");
    wait_rules_equal(
        &t.proxy,
        backend,
        &fresh,
        Duration::from_secs(5),
        "after repair",
    );
    let m = scrape(&tg);
    assert_eq!(
        metric_sum(&m, "tunnelgate_rules_applied"),
        1.0,
        "rules_applied:\n{m}"
    );

    // A reload while the backend fails: the running rules stay exactly as they are and keep
    // carrying traffic, readiness names the failure, and the new rule arrives once the tool
    // works again.
    let _https = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 8443));
    let _alt = TcpEcho::start(&t.cluster, sa(BACKEND_V4, 9443));
    t.connect_client(&tg, &[]);
    echo_ok(&t.client, sa(TG_V4, 443), "443 before the failing reload");
    std::fs::write(&flag, "").expect("flag file");
    let mut changed = tg.cfg.clone();
    changed.extra = format!(
        "{}\n{}",
        firewall_toml(backend, "1s"),
        ingress_toml(&["443:8443", "9443"])
    );
    tg.write_config(changed);
    tg.sighup();
    let mut last = None;
    let refused = poll_until(Duration::from_secs(10), || {
        let r = tg.health_get("/readyz");
        let down = matches!(&r, Ok((503, body)) if body.contains("injected failure"));
        last = Some(r);
        down
    });
    assert!(refused, "/readyz during the failing reload: {last:?}");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        owned_rules(&t.proxy, backend),
        fresh,
        "the rules running before the failing reload are untouched"
    );
    echo_ok(&t.client, sa(TG_V4, 443), "443 while the backend fails");
    tcp_blocked(&t.client, sa(TG_V4, 9443), "9443 before it is applied");
    std::fs::remove_file(&flag).expect("remove flag");
    let back = poll_until(Duration::from_secs(35), || {
        matches!(tg.health_get("/readyz"), Ok((200, _)))
    });
    assert!(back, "/readyz after the backend works again");
    assert_ne!(owned_rules(&t.proxy, backend), fresh, "the reload's rules");
    echo_ok(&t.client, sa(TG_V4, 443), "443 after recovery");
    echo_ok(
        &t.client,
        sa(TG_V4, 9443),
        "9443, the reloaded rule, after recovery",
    );
    drop(tg);
}
