//! The proxy's endpoints file (where peers authenticated, where a takeover may send) is on a volume that outlives a container restart, in a folder the daemon will read back.

use super::*;
use std::os::unix::fs::PermissionsExt;
use tunnelgate::config::PublicKey;
use tunnelgate::shell::endpoints::{load, save};

/// The proxy container of `pod` keeps its endpoints file on an `emptyDir` it may write, one
/// folder below the mount (`TUNNELGATE_STATE_DIR`), and the base config leaves the path to
/// that variable; the daemon's own save and load then work with the folder as the kubelet makes
/// it, world-writable, where a file written at the top would be refused when read back.
pub(crate) fn assert_endpoints_kept_across_a_container_restart(
    what: &str,
    pod: &Value,
    base: &str,
) {
    let base: toml::Table = base.parse().expect("base config");
    let interface = base["interface"]["name"].as_str().expect("interface.name");
    let proxy = pod["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "proxy"))
        .unwrap_or_else(|| panic!("{what}: no proxy container"));
    // The root is read-only: the default /var/lib/tunnelgate could not be written without a
    // volume.
    assert_eq!(
        proxy["securityContext"]["readOnlyRootFilesystem"], true,
        "{what}"
    );
    assert_eq!(proxy["securityContext"]["runAsUser"], 0, "{what}");
    assert!(
        base.get("takeover")
            .and_then(|t| t.get("state_file"))
            .is_none(),
        "{what}: the base config leaves the endpoints file to TUNNELGATE_STATE_DIR"
    );
    let dir = env(proxy, "TUNNELGATE_STATE_DIR");
    let (volume, mount_path) = proxy["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let at = m["mountPath"].as_str()?;
            dir.strip_prefix(at)
                .is_some_and(|rest| rest.starts_with('/') && rest.len() > 1)
                .then(|| (m, at.to_string()))
        })
        .max_by_key(|(_, at)| at.len())
        .map(|(m, at)| {
            assert_ne!(m["readOnly"], true, "{what}: {m}");
            (m["name"].as_str().unwrap_or_default().to_string(), at)
        })
        .unwrap_or_else(|| panic!("{what}: {dir} is on no volume of the proxy, one folder down"));
    let source = pod["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == volume.as_str()))
        .unwrap_or_else(|| panic!("{what}: no volume {volume}"));
    // An emptyDir: it lives as long as the pod, so a restarted container finds the file.
    assert!(source["emptyDir"].is_object(), "{what}: {source}");
    assert!(
        pod["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["name"] != "proxy")
            .all(|c| mount(c, &volume).is_none()),
        "{what}: only the proxy mounts {volume}"
    );

    // The daemon's own save and load, in a folder made as the kubelet makes an emptyDir
    // (0777 on disk, 1777 as tmpfs).
    let tmp = common::TempDir::new("tg-state-volume");
    let top = tmp.path().join("volume");
    std::fs::create_dir(&top).expect("volume");
    let mode = if source["emptyDir"]["medium"] == "Memory" {
        0o1777
    } else {
        0o777
    };
    std::fs::set_permissions(&top, std::fs::Permissions::from_mode(mode)).expect("chmod");
    let identity = PublicKey([1; 32]);
    let endpoint: std::net::SocketAddr = "198.51.100.7:51820".parse().expect("endpoint");
    let text =
        tunnelgate::core::endpoints_file::render(&identity, [(&PublicKey([2; 32]), &endpoint)]);
    let file = format!("{interface}.endpoints");
    let below = top.join(dir.strip_prefix(&format!("{mount_path}/")).expect("below"));
    let path = below.join(&file);
    save(&path, &text).expect("the daemon writes its endpoints file there");
    let restored = load(&path, &identity)
        .unwrap_or_else(|e| panic!("{what}: a restarted daemon would not read {dir}: {e}"));
    assert_eq!(restored.peers.get(&PublicKey([2; 32])), Some(&endpoint));
    // At the top of the volume the same file would be written, and refused when read back.
    let at_top = top.join(&file);
    save(&at_top, &text).expect("written at the top");
    let why = load(&at_top, &identity)
        .expect_err("a folder others may write")
        .to_string();
    assert!(why.contains("its folder"), "{why}");
}

/// The single-Service proxy.
#[test]
fn single_proxy_keeps_its_endpoints_file_across_a_container_restart() {
    assert_endpoints_kept_across_a_container_restart("containers/k8s", &pod(), &base_config());
}

/// The group's replicas (both overlays run this StatefulSet; group-shared's base config is
/// checked with its build).
#[test]
fn group_replicas_keep_their_endpoints_file_across_a_container_restart() {
    let base = group_find("ConfigMap", Some(GROUP_NS), "tgp-base")["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .to_string();
    assert_endpoints_kept_across_a_container_restart("containers/k8s/group", &group_pod(), &base);
}
