//! The inputs of a sidecar run (base config, Service, Secret) and the `tunnelgate-sidecar` process under test.

use super::*;

pub(crate) fn peer_key() -> String {
    SecretKey([7; 32]).public_key().to_base64()
}

pub(crate) fn base_config(extra_peer: bool) -> String {
    let mut t = format!(
        "[interface]\nname = \"tg0\"\naddresses = [\"100.64.0.1/32\", \"fd7a:115c:a1e0::1/128\"]\n\n\
         [[peer]]\npublic_key = \"{}\"\nallowed_ips = [\"100.64.0.2/32\"]\n\n\
         [health]\nlisten = \"0.0.0.0:9002\"\n",
        peer_key()
    );
    if extra_peer {
        t.push_str(&format!(
            "\n[[peer]]\npublic_key = \"{}\"\nallowed_ips = [\"100.64.0.3/32\"]\n",
            SecretKey([8; 32]).public_key().to_base64()
        ));
    }
    t
}

pub(crate) fn service(annotations: Value) -> Value {
    json!({
        "kind": "Service", "apiVersion": "v1",
        "metadata": {"name": SERVICE, "namespace": NS, "uid": "0b7c5f3e-uid", "annotations": annotations},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "10.96.0.10",
            "clusterIPs": ["10.96.0.10"],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    })
}

pub(crate) fn exposed() -> Value {
    service(json!({"tunnelgate.dev/expose": "true"}))
}

/// A temp dir with the kubeconfig and the base config.
pub(crate) struct Inputs {
    pub(crate) dir: PathBuf,
}

impl Inputs {
    pub(crate) fn new(fake: &Fake, tag: &str) -> Inputs {
        let dir = std::env::temp_dir().join(format!("tg-sidecar-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             clusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {NS}\n\
             users:\n- name: fake\n  user: {{}}\n",
            fake.port
        );
        std::fs::write(dir.join("kubeconfig"), kubeconfig).expect("kubeconfig");
        std::fs::write(dir.join("base.toml"), base_config(false)).expect("base config");
        Inputs { dir }
    }

    pub(crate) fn base_path(&self) -> PathBuf {
        self.dir.join("base.toml")
    }
}

impl Drop for Inputs {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The sidecar binary; stopped (SIGTERM) on drop. Its stderr goes to a file in the inputs dir.
pub(crate) struct Sidecar {
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl Sidecar {
    pub(crate) fn start(inputs: &Inputs, run: u32) -> Sidecar {
        Sidecar::start_with(
            inputs,
            &format!("{run}"),
            &[
                "--secret",
                &format!("{NS}/{SECRET}"),
                "--service",
                &format!("{NS}/{SERVICE}"),
            ],
            &[],
        )
    }

    /// The sidecar with `args` (besides --base-config) and `env` (besides the kubeconfig); its
    /// log is `sidecar-TAG.log`.
    pub(crate) fn start_with(
        inputs: &Inputs,
        tag: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Sidecar {
        Sidecar::start_under(&[], inputs, tag, args, env)
    }

    /// [`Sidecar::start_with`], run by the command `under` (such as `setpriv` with a user).
    pub(crate) fn start_under(
        under: &[&str],
        inputs: &Inputs,
        tag: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Sidecar {
        let log = inputs.dir.join(format!("sidecar-{tag}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let binary = env!("CARGO_BIN_EXE_tunnelgate-sidecar");
        let (program, before) = match under.split_first() {
            Some((first, rest)) => (*first, [rest, &[binary]].concat()),
            None => (binary, Vec::new()),
        };
        let child = Command::new(program)
            .args(before)
            .args(args)
            .arg("--base-config")
            .arg(inputs.base_path())
            .env("KUBECONFIG", inputs.dir.join("kubeconfig"))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("POD_NAMESPACE")
            .env_remove("POD_NAME")
            .env_remove("TUNNELGATE_SECRET")
            .env_remove("TUNNELGATE_SERVICE")
            .env_remove("TUNNELGATE_PROXY_GROUP")
            .env_remove("TUNNELGATE_ADDRESS_POOLS")
            .env_remove("TUNNELGATE_NAMESPACES")
            .env_remove("TUNNELGATE_CONFIG_DIR")
            .env_remove("TUNNELGATE_GROUP_IDENTITY")
            .envs(env.iter().copied())
            .env("RUST_LOG", "info,tunnelgate=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start tunnelgate-sidecar");
        Sidecar { child, log }
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; the exit status must be 0.
    pub(crate) fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let status = wait_child(&mut self.child, Duration::from_secs(10));
        assert_eq!(status, Some(0), "sidecar exit status; log:\n{}", self.log());
    }
}

pub(crate) fn wait_child(child: &mut Child, timeout: Duration) -> Option<i32> {
    let deadline = clock::now() + timeout;
    while clock::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            return st.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Polls `f` until it holds; panics with the sidecar's log after [`WAIT`].
pub(crate) async fn wait_for(sidecar: &Sidecar, what: &str, f: impl Fn() -> bool) {
    let deadline = tunnelgate::shell::clock::tokio_now() + WAIT;
    while !f() {
        assert!(
            tunnelgate::shell::clock::tokio_now() < deadline,
            "timed out waiting for {what}; sidecar log:\n{}",
            sidecar.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) struct MapFiles(BTreeMap<String, String>);

impl SecretFiles for MapFiles {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0
            .get(&path.display().to_string())
            .cloned()
            .ok_or_else(|| "no such file".into())
    }
}

pub(crate) fn utf8(data: &BTreeMap<String, Vec<u8>>, key: &str) -> String {
    String::from_utf8(data.get(key).cloned().unwrap_or_default()).expect("utf-8")
}

/// What the daemon would load from the Secret as the fake holds it.
pub(crate) fn daemon_config(data: &BTreeMap<String, Vec<u8>>) -> Config {
    let files = MapFiles(BTreeMap::from([(
        "/etc/tunnelgate/private.key".to_string(),
        utf8(data, "private.key"),
    )]));
    Config::parse(&config_text(data), Path::new("/etc/tunnelgate"), &files)
        .expect("the daemon accepts the rendered config")
}

/// The rendered configuration as the daemon reads it: `tunnelgate.toml`, or when the sidecar
/// stored it compressed, `tunnelgate.toml.gz` gunzipped (never both).
pub(crate) fn config_text(data: &BTreeMap<String, Vec<u8>>) -> String {
    match data.get("tunnelgate.toml.gz") {
        Some(gz) => {
            assert!(!data.contains_key("tunnelgate.toml"), "both forms stored");
            let mut text = String::new();
            std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&gz[..]), &mut text)
                .expect("gzip");
            text
        }
        None => utf8(data, "tunnelgate.toml"),
    }
}

pub(crate) fn patches(fake: &Fake) -> usize {
    fake.count(Recorded::is_secret_patch)
}

/// Starts the sidecar and waits for its first write and an open watch.
pub(crate) async fn started(fake: &Arc<Fake>, inputs: &Inputs) -> Sidecar {
    let sidecar = Sidecar::start(inputs, 1);
    wait_for(&sidecar, "the first apply", || patches(fake) == 1).await;
    wait_for(&sidecar, "an open watch", || {
        !fake.lock().watchers.is_empty()
    })
    .await;
    sidecar
}
