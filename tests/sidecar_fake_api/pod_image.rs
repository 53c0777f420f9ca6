//! The StatefulSet's pod (containers/k8s/statefulset.yaml) run from the image with podman: the
//! proxy container (only the capabilities the manifest adds, `/dev/net/tun`, the config volume
//! read-only, read-only root) and the sidecar container (uid 65532, no capabilities, read-only
//! root) share one network namespace, as a pod's containers do. The sidecar talks to this file's
//! fake API server (listening inside the pod's namespace), the test plays the kubelet (it copies
//! the Secret into the config volume), a wireguard-go peer in another namespace reaches the
//! Service's backend (in a third namespace, at the ClusterIP) through the proxy.
//!
//! Without the init container `/proc/sys` is read-only and forwarding is off: the proxy is not
//! ready and says why (`/readyz`, `tunnelgate status`, its log). Once the sysctl is set from
//! outside, it becomes ready and ingress works. `podman stop` leaves no rule behind. The layers
//! the image adds to its base are at most 40 MB.
//!
//! The image is built by containers/README.md's `podman build` line (scripts/test.sh runs it,
//! compile stage included, with `scripts/image.sh --documented`; `scripts/image.sh` builds it
//! from host binaries): `$TUNNELGATE_IMAGE`, else `localhost/tunnelgate:latest`. Without podman
//! or the image the test is skipped with a note, unless `CI=true`. `podman save` of it, as the
//! README loads it into a cluster, keeps the fully qualified name.

use super::*;
use crate::common::{self, Netns};
use std::net::SocketAddr;

/// The bases the image may be built on: the Containerfile's default (a local stand-in where no
/// registry is reachable) and scripts/image.sh's debootstrap import.
const BASE_IMAGES: [&str; 2] = [
    "docker.io/library/debian:bookworm-slim",
    "localhost/tunnelgate-base:bookworm",
];
/// The most the image may add to its base (binaries and the runtime packages), in bytes.
const MAX_ADDED_BYTES: u64 = 40_000_000;

fn image() -> String {
    std::env::var("TUNNELGATE_IMAGE").unwrap_or_else(|_| "localhost/tunnelgate:latest".into())
}

/// `podman ARGS` with the flags these VMs need (runc, cgroupfs: containers/README.md).
fn podman(args: &[&str]) -> common::CmdOutput {
    let mut cmd = Command::new("podman");
    cmd.args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"])
        .args(args);
    common::output_of(cmd, None)
}

fn podman_ok(args: &[&str]) -> String {
    let out = podman(args);
    assert!(
        out.success(),
        "podman {args:?}: {}\n{}",
        out.stdout,
        out.stderr
    );
    out.stdout
}

/// Why the test cannot run here, if it cannot.
fn missing_prerequisite() -> Option<String> {
    if !podman(&["--version"]).success() {
        return Some("podman missing (apt-get install --no-install-recommends podman runc)".into());
    }
    if !podman(&["image", "exists", &image()]).success() {
        return Some(format!("image {} missing: run scripts/image.sh", image()));
    }
    None
}

/// What podman needs here for a container to have real-time threads at all, which a Kubernetes
/// node does not: this VM's kernel has real-time group scheduling (`CONFIG_RT_GROUP_SCHED`, cpu
/// controller on cgroup v1), under which a cgroup gets no real-time time unless it and its
/// parents are given some (`cpu.rt_runtime_us`; podman's parent `libpod_parent` has 0). The
/// kernels of Debian and Ubuntu nodes are built without it, and cgroup v2 has no such limit, so
/// there `SYS_NICE` is all it takes. A parent cgroup of the test's own, given half of what the
/// root group has left, and removed (giving it back) on drop; nothing on a host without it.
struct RealtimeParent {
    dir: Option<std::path::PathBuf>,
    runtime_us: u64,
}

impl RealtimeParent {
    const ROOT: &'static str = "/sys/fs/cgroup/cpu";

    fn new() -> RealtimeParent {
        let root = std::path::Path::new(Self::ROOT);
        let read = |p: &std::path::Path| -> Option<u64> {
            std::fs::read_to_string(p).ok()?.trim().parse().ok()
        };
        let Some(total) = read(&root.join("cpu.rt_runtime_us")) else {
            return RealtimeParent {
                dir: None,
                runtime_us: 0,
            };
        };
        let given: u64 = std::fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| read(&e.path().join("cpu.rt_runtime_us")))
            .sum();
        let runtime_us = total.saturating_sub(given) / 2;
        let dir = root.join(format!("tgpod{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("the test's cpu cgroup");
        std::fs::write(dir.join("cpu.rt_runtime_us"), runtime_us.to_string())
            .expect("real-time time for the test's cgroup");
        RealtimeParent {
            dir: Some(dir),
            runtime_us,
        }
    }

    /// The podman flags that put a container under it with real-time time.
    fn podman_args(&self) -> Vec<String> {
        let Some(dir) = &self.dir else {
            return Vec::new();
        };
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        vec![
            "--cgroup-parent".into(),
            format!("/{name}"),
            format!("--cpu-rt-runtime={}", self.runtime_us),
        ]
    }
}

impl Drop for RealtimeParent {
    fn drop(&mut self) {
        let Some(dir) = &self.dir else { return };
        let name = dir
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        // Its time first (the kernel frees it only when the cgroup is gone), then the folder
        // in every hierarchy podman made it in.
        let _ = std::fs::write(dir.join("cpu.rt_runtime_us"), "0");
        if let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in hierarchies.flatten() {
                let _ = std::fs::remove_dir(h.path().join(&name));
            }
        }
    }
}

/// A podman container, removed (with its processes) on drop.
struct Container {
    name: String,
}

impl Container {
    fn run(name: String, args: &[&str]) -> Container {
        let _ = podman(&["rm", "-f", &name]);
        let mut all = vec!["run", "-d", "--name", name.as_str(), "--pull", "never"];
        all.extend([
            "--ulimit",
            "nofile=20000:20000",
            "--ulimit",
            "nproc=4096:4096",
        ]);
        all.extend(args);
        podman_ok(&all);
        Container { name }
    }

    fn logs(&self) -> String {
        let out = podman(&["logs", &self.name]);
        format!("{}{}", out.stdout, out.stderr)
    }

    fn exec(&self, args: &[&str]) -> common::CmdOutput {
        podman(&[&["exec", self.name.as_str()][..], args].concat())
    }

    fn running(&self) -> bool {
        podman(&["inspect", "--format", "{{.State.Running}}", &self.name])
            .stdout
            .trim()
            == "true"
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "-f", "-t", "2", &self.name]);
    }
}

/// The StatefulSet's pod template, parsed from containers/k8s/statefulset.yaml.
fn pod_template() -> Value {
    let text = std::fs::read_to_string(repo().join("containers/k8s/statefulset.yaml"))
        .expect("statefulset.yaml");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("YAML");
    docs.into_iter()
        .find(|d| d["kind"] == "StatefulSet")
        .expect("a StatefulSet")["spec"]["template"]["spec"]
        .clone()
}

fn container_spec(template: &Value, name: &str) -> Value {
    template["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
        .clone()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The kubelet's part: the Secret's keys as files of the config volume, mode 0400 (the
/// manifest's defaultMode 256), written as the kubelet does (new files, then visible at once).
fn project_secret(data: &BTreeMap<String, Vec<u8>>, dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for (key, value) in data {
        let tmp = dir.join(format!(".{key}.tmp"));
        std::fs::write(&tmp, value).expect("write secret file");
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o400)).expect("chmod");
        std::fs::rename(&tmp, dir.join(key)).expect("rename");
    }
}

fn readyz(pod: &Netns) -> Result<(u16, String), String> {
    let health: SocketAddr = "127.0.0.1:9002".parse().expect("addr");
    common::http_get_ns(pod, health, "/readyz")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root, podman and the image (scripts/image.sh)"]
async fn statefulset_pod_from_the_image_is_ready_only_with_forwarding_and_serves_ingress() {
    common::require_root();
    if let Some(why) = missing_prerequisite() {
        common::skip(why);
        return;
    }

    // The pod's namespace, the peer's (the underlay between them), and the cluster's, where
    // the Service's backend answers at the ClusterIP.
    let pod = Netns::new();
    let peer = Netns::new();
    let cluster = Netns::new();
    // A pod's namespace starts with forwarding off. A new namespace copies the value of the one
    // that made it, and a host's may be on (podman's bridge network turns it on, for one).
    pod.sysctl("net.ipv4.ip_forward", "0");
    common::veth(&pod, &["10.77.0.1/24"], &peer, &["10.77.0.2/24"]);
    common::veth(&pod, &["10.96.0.1/24"], &cluster, &["10.96.0.10/24"]);
    let ns_path = format!("ns:/var/run/netns/{}", pod.name());

    let wg = common::WgGo::start(&peer, 51821, &["100.64.0.2/32"]);

    // The API server, reachable from the pod's namespace at 127.0.0.1.
    let listener = pod.in_ns(|| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind in the pod");
        l.set_nonblocking(true).expect("nonblocking");
        l
    });
    let listener = TcpListener::from_std(listener).expect("tokio listener");
    let fake = Fake::start_on(listener, vec![exposed()], BTreeMap::new());
    let inputs = Inputs::new(&fake, "pod-image");
    let iface = format!("tc{}", std::process::id() % 100_000);
    std::fs::write(
        inputs.base_path(),
        format!(
            "[interface]\nname = \"{iface}\"\nlisten_port = 51820\naddresses = [\"100.64.0.1/32\"]\n\n\
             [[peer]]\npublic_key = \"{}\"\nallowed_ips = [\"100.64.0.2/32\"]\n\
             endpoint = \"10.77.0.2:51821\"\n\n[health]\nlisten = \"0.0.0.0:9002\"\n",
            wg.public_key()
        ),
    )
    .expect("base config");
    let config_volume = pod.dir().path().join("config-volume");
    std::fs::create_dir_all(&config_volume).expect("config volume");

    let template = pod_template();
    let tag = std::process::id();

    // The sidecar as the manifest runs it: its uid, no capability, read-only root.
    let sidecar_spec = container_spec(&template, "sidecar");
    let uid = sidecar_spec["securityContext"]["runAsUser"]
        .as_u64()
        .expect("runAsUser");
    assert_eq!(uid, 65532);
    assert_eq!(
        strings(&sidecar_spec["securityContext"]["capabilities"]["drop"]),
        ["ALL"]
    );
    let base_mount = format!("{}:/etc/tunnelgate-base:ro", inputs.dir.display());
    let user = format!("{uid}:{uid}");
    let sidecar = Container::run(
        format!("tc-sidecar-{tag}"),
        &[
            "--network",
            &ns_path,
            "--user",
            &user,
            "--cap-drop",
            "all",
            "--read-only",
            "--security-opt",
            "no-new-privileges",
            "-v",
            &base_mount,
            "-e",
            "KUBECONFIG=/etc/tunnelgate-base/kubeconfig",
            "-e",
            &format!("TUNNELGATE_SECRET={NS}/{SECRET}"),
            "-e",
            &format!("TUNNELGATE_SERVICE={NS}/{SERVICE}"),
            "-e",
            "TUNNELGATE_BASE_CONFIG=/etc/tunnelgate-base/base.toml",
            &image(),
            "tunnelgate-sidecar",
        ],
    );
    let written = common::poll_until(WAIT, || {
        let data = fake.secret_of(NS, SECRET);
        data.contains_key("tunnelgate.toml") && data.contains_key("private.key")
    });
    assert!(
        written,
        "the sidecar wrote no Secret; its log:\n{}",
        sidecar.logs()
    );
    let data = fake.secret_of(NS, SECRET);
    project_secret(&data, &config_volume);

    // The proxy as the manifest runs it, without its init container: the manifest's command,
    // only its capabilities, the TUN device, the config volume read-only, read-only root.
    let proxy_spec = container_spec(&template, "proxy");
    let security = &proxy_spec["securityContext"];
    assert_eq!(strings(&security["capabilities"]["drop"]), ["ALL"]);
    let mut args: Vec<String> = vec![
        "--network".into(),
        ns_path.clone(),
        "--cap-drop".into(),
        "all".into(),
    ];
    for cap in strings(&security["capabilities"]["add"]) {
        args.extend(["--cap-add".into(), cap]);
    }
    assert_eq!(security["readOnlyRootFilesystem"], true);
    // The manifest's CPU limit, as the kubelet sets it (the cgroup's CPU quota).
    let cpu_limit = proxy_spec["resources"]["limits"]["cpu"]
        .as_str()
        .expect("limits.cpu")
        .to_string();
    args.extend(["--cpus".into(), cpu_limit.clone()]);
    // Declared before the container, so the container is removed before its parent cgroup.
    let realtime = RealtimeParent::new();
    args.extend(realtime.podman_args());
    args.extend([
        "--read-only".into(),
        "--security-opt".into(),
        "no-new-privileges".into(),
        "--device".into(),
        "/dev/net/tun".into(),
        "-v".into(),
        format!("{}:/etc/tunnelgate:ro", config_volume.display()),
        image(),
    ]);
    args.extend(strings(&proxy_spec["command"]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut proxy = Some(Container::run(format!("tc-proxy-{tag}"), &args));
    let proxy_ref = proxy.as_ref().expect("proxy");
    assert_eq!(
        pod.sysctl_get("net.ipv4.ip_forward"),
        "0",
        "forwarding off, as in a new pod"
    );

    // Not ready, and why: /readyz, status and the log name the sysctl, the error and the fix.
    let mut last = Err(String::new());
    let said_why = common::poll_until(Duration::from_secs(60), || {
        last = readyz(&pod);
        matches!(&last, Ok((503, body)) if body.contains("forwarding"))
    });
    assert!(
        said_why,
        "/readyz: {last:?}; proxy log:\n{}",
        proxy_ref.logs()
    );
    let (_, body) = last.clone().expect("answered");
    for part in [
        "net.ipv4.ip_forward",
        "Read-only file system",
        "init container",
        "securityContext.sysctls",
    ] {
        assert!(body.contains(part), "{part:?} missing from /readyz: {body}");
    }
    let status = proxy_ref.exec(&["tunnelgate", "status", "--interface", &iface]);
    assert!(
        status.stdout.contains("net.ipv4.ip_forward is off"),
        "tunnelgate status:\n{}{}",
        status.stdout,
        status.stderr
    );
    let went_ready = |log: &str| log.lines().any(|l| l.trim_end().ends_with("Ready"));
    let log = proxy_ref.logs();
    assert!(log.contains("Not ready: IP forwarding is off"), "{log}");
    assert!(
        log.contains("init container"),
        "the log says the fix:\n{log}"
    );
    assert!(!went_ready(&log), "went Ready without forwarding:\n{log}");

    // What the init container would have done, from outside: ready at the next read.
    pod.sysctl("net.ipv4.ip_forward", "1");
    let ready = common::poll_until(Duration::from_secs(15), || {
        matches!(readyz(&pod), Ok((200, _)))
    });
    assert!(
        ready,
        "/readyz: {:?}; log:\n{}",
        readyz(&pod),
        proxy_ref.logs()
    );
    assert!(went_ready(&proxy_ref.logs()), "{}", proxy_ref.logs());

    // With the manifest's SYS_NICE, the packet readers run at real-time priority in the
    // container, within its CPU limit, and status says so.
    let pid: u32 = podman_ok(&["inspect", "--format", "{{.State.Pid}}", &proxy_ref.name])
        .trim()
        .parse()
        .expect("the proxy's pid");
    let mut scheduling = Vec::new();
    let realtime = common::poll_until(Duration::from_secs(5), || {
        scheduling = common::thread_scheduling(pid);
        scheduling.iter().any(|(name, policy, _)| {
            common::is_packet_reader(name) && *policy == common::SCHED_FIFO
        })
    });
    assert!(
        realtime,
        "no reader at SCHED_FIFO: {scheduling:?}\n{}",
        proxy_ref.logs()
    );
    let status = proxy_ref.exec(&["tunnelgate", "status", "--json", "--interface", &iface]);
    let status: serde_json::Value = serde_json::from_str(&status.stdout).expect("status JSON");
    let tuning = &status["tuning"];
    assert_eq!(tuning["readers"]["access"], "capability", "{tuning}");
    assert_eq!(tuning["readers"]["priority"], 1, "{tuning}");
    let limit_milli = (cpu_limit.parse::<f64>().expect("a whole number of CPUs") * 1000.0) as u64;
    assert_eq!(tuning["cpu_quota_milli"], limit_milli, "{tuning}");
    // The readers' share of the CPUs the limit allows, for all readers together (the share
    // itself no more than the container's real-time runtime allows, where the kernel limits it).
    let share = tuning["readers"]["share_percent"].as_u64().expect("share");
    assert!((1..=90).contains(&share), "{tuning}");
    let cpus = tuning["cpus"].as_u64().expect("cpus");
    assert_eq!(
        tuning["readers"]["process_rate_milli"],
        limit_milli.min(cpus * 1000) * share / 100,
        "{tuning}"
    );

    // The peer reaches the Service's backend through the proxy: the handshake, then bytes.
    let proxy_public = String::from_utf8(data["public_key"].clone()).expect("utf-8");
    wg.add_peer(
        &common::Peer::new(proxy_public.trim(), &["100.64.0.1/32"]).endpoint("10.77.0.1:51820"),
    );
    peer.exec(&["ip", "route", "replace", "100.64.0.1/32", "dev", wg.name()]);
    let listen: SocketAddr = "10.96.0.10:80".parse().expect("addr");
    let connect: SocketAddr = "100.64.0.1:80".parse().expect("addr");
    let moved = common::tcp_transfer_via(
        &peer,
        &cluster,
        listen,
        connect,
        common::TransferDir::ClientToServer,
        1 << 20,
        Duration::from_secs(30),
    );
    assert!(moved.is_ok(), "{moved:?}; proxy log:\n{}", proxy_ref.logs());
    common::wait_handshake(wg.name(), proxy_public.trim(), Duration::from_secs(5));
    assert!(!pod.nft_tunnelgate_table().is_empty(), "rules installed");

    // `podman stop` (SIGTERM): the daemon removes its rules and exits 0.
    let proxy_name = proxy_ref.name.clone();
    podman_ok(&["stop", "-t", "20", &proxy_name]);
    let exit = podman_ok(&["inspect", "--format", "{{.State.ExitCode}}", &proxy_name]);
    let log = proxy.as_ref().map(Container::logs).unwrap_or_default();
    assert_eq!(exit.trim(), "0", "proxy exit code; log:\n{log}");
    assert_eq!(
        pod.nft_tunnelgate_table(),
        "",
        "a rule left behind; log:\n{log}"
    );
    assert!(!pod.link_exists(&iface), "TUN device left behind");
    drop(proxy.take());
    assert!(
        sidecar.running(),
        "the sidecar still runs: {}",
        sidecar.logs()
    );
    fake.stop();

    // The image: the layers it adds to the base are the binaries and the runtime packages.
    let size = |name: &str| -> u64 {
        podman_ok(&["image", "inspect", "--format", "{{.Size}}", name])
            .trim()
            .parse()
            .expect("size")
    };
    let base = BASE_IMAGES
        .into_iter()
        .find(|b| podman(&["image", "exists", b]).success())
        .expect("the image's base");
    let added = size(&image()) - size(base);
    eprintln!("image {}: {added} bytes added to {base}", image());
    assert!(
        added <= MAX_ADDED_BYTES,
        "the image adds {added} bytes to its base"
    );
}

/// containers/README.md's load step, `podman save -o tunnelgate.tar localhost/tunnelgate:latest`
/// run as written (in a temp dir): the archive is a docker-archive that names the image by its
/// fully qualified name, which is the name `kind load image-archive` and `ctr -n k8s.io images
/// import` register it under, so the manifests' `image:` finds it on the node.
#[test]
#[ignore = "needs root, podman and the image (scripts/image.sh)"]
fn podman_save_keeps_the_fully_qualified_name() {
    common::require_root();
    if let Some(why) = missing_prerequisite() {
        common::skip(why);
        return;
    }
    let readme = std::fs::read_to_string(repo().join("containers/README.md")).expect("README");
    let line = readme
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("podman save "))
        .expect("a podman save line")
        .split(" #")
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        words,
        [
            "podman",
            "save",
            "-o",
            "tunnelgate.tar",
            "localhost/tunnelgate:latest"
        ],
        "{line}"
    );
    let dir = common::TempDir::new("tx-save");
    let mut save = Command::new(words[0]);
    save.args(&words[1..]).current_dir(dir.path());
    let out = common::output_of(save, None);
    assert!(out.success(), "{line}: {}", out.stderr);
    let mut list = Command::new("tar");
    list.args(["-xOf", "tunnelgate.tar", "manifest.json"])
        .current_dir(dir.path());
    let manifest = common::output_of(list, None);
    assert!(manifest.success(), "{}", manifest.stderr);
    let manifest: Value = serde_json::from_str(&manifest.stdout).expect("manifest.json");
    assert_eq!(
        manifest[0]["RepoTags"],
        serde_json::json!(["localhost/tunnelgate:latest"]),
        "{manifest}"
    );
}
