//! End-to-end tests of the `tunnelgate-sidecar` binary against an in-repo fake Kubernetes API
//! server (plain HTTP, hyper) that serves Services in any namespace (get, list and watch, per
//! namespace or cluster-wide, with a name field selector), Secrets (get, apply; creating a missing
//! one only when allowed, as RBAC `create` does) and Event creation, and records every request.
//! No root needed.
//!
//! Single Service: the first run creates the key and writes the Secret; a second run with the same
//! inputs writes nothing; a Service change gives exactly one apply; a 409 conflict is retried; a
//! dropped watch is resumed; an expired one (410) lists again; an API-server restart is survived;
//! a base config change is rendered; bad input gives an Event and no write.
//!
//! Proxy group (two replicas, Services in two namespaces): each replica writes only its own
//! Secret, with its own key and pool address; other groups are ignored; Services joining, changing
//! and leaving are followed; a port clash gives an Event on the later Service and the rest keeps
//! working; a restart keeps the keys and writes nothing; an expired cluster-wide watch lists
//! again; a missing Secret without `create` is reported and written once it exists.

use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tunnelgate::config::{Config, SecretFiles, SecretKey};

const NS: &str = "tg";
const SERVICE: &str = "web";
const SECRET: &str = "proxy-0";
const WAIT: Duration = Duration::from_secs(20);

// ------------------------------------------------------------------------------------------------
// The fake API server
// ------------------------------------------------------------------------------------------------

type Body = UnsyncBoxBody<Bytes, Infallible>;

#[derive(Debug, Clone)]
struct Recorded {
    method: Method,
    path: String,
    query: String,
    body: String,
}

impl Recorded {
    fn is_secret_patch(&self) -> bool {
        self.method == Method::PATCH && self.path.ends_with(&format!("/secrets/{SECRET}"))
    }
    fn is_secret_get(&self) -> bool {
        self.method == Method::GET && self.path.ends_with(&format!("/secrets/{SECRET}"))
    }
    fn is_watch(&self) -> bool {
        self.path.ends_with("/services") && self.query.contains("watch=true")
    }
    fn is_event(&self) -> bool {
        self.method == Method::POST && self.path.ends_with("/events")
    }
}

type Key = (String, String);

fn key(ns: &str, name: &str) -> Key {
    (ns.to_string(), name.to_string())
}

/// An open watch: its namespace (`None`: cluster-wide) and field-selected name, if any.
struct Watcher {
    namespace: Option<String>,
    name: Option<String>,
    tx: mpsc::UnboundedSender<Bytes>,
}

impl Watcher {
    fn matches(&self, svc: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| svc["metadata"]["namespace"] == ns)
            && self
                .name
                .as_deref()
                .is_none_or(|n| svc["metadata"]["name"] == n)
    }
}

struct State {
    resource_version: u64,
    services: BTreeMap<Key, Value>,
    /// Absent: the Secret does not exist.
    secrets: BTreeMap<Key, BTreeMap<String, Vec<u8>>>,
    requests: Vec<Recorded>,
    /// How many more Secret patches answer 409 Conflict.
    conflicts: u32,
    /// Whether a patch may create a missing Secret (RBAC `create` on secrets).
    may_create_secrets: bool,
    watchers: Vec<Watcher>,
}

impl State {
    fn next_rv(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }

    fn notify(&mut self, kind: &str, svc: &Value) {
        let mut line = json!({"type": kind, "object": svc}).to_string();
        line.push('\n');
        let line = Bytes::from(line);
        self.watchers
            .retain(|w| !w.matches(svc) || w.tx.send(line.clone()).is_ok());
    }
}

struct Fake {
    state: Mutex<State>,
    port: u16,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Fake {
    async fn start(service: Value, secret: Option<BTreeMap<String, Vec<u8>>>) -> Arc<Fake> {
        let secrets = secret.map(|d| (key(NS, SECRET), d)).into_iter().collect();
        Fake::start_many(vec![service], secrets).await
    }

    async fn start_many(
        services: Vec<Value>,
        secrets: BTreeMap<Key, BTreeMap<String, Vec<u8>>>,
    ) -> Arc<Fake> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let mut state = State {
            resource_version: 1,
            services: BTreeMap::new(),
            secrets,
            requests: Vec::new(),
            conflicts: 0,
            may_create_secrets: true,
            watchers: Vec::new(),
        };
        for mut svc in services {
            svc["metadata"]["resourceVersion"] = json!(state.next_rv());
            state.services.insert(obj_key(&svc), svc);
        }
        let fake = Arc::new(Fake {
            state: Mutex::new(state),
            port,
            tasks: Mutex::new(Vec::new()),
        });
        fake.serve(listener);
        fake
    }

    fn serve(self: &Arc<Self>, listener: TcpListener) {
        let fake = self.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let f = fake.clone();
                let conn = tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let f = f.clone();
                        async move { Ok::<_, Infallible>(f.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
                fake.tasks.lock().expect("tasks").push(conn);
            }
        });
        self.tasks.lock().expect("tasks").push(accept);
    }

    /// Like an API server going down: the listener and every connection close.
    fn stop(&self) {
        for t in self.tasks.lock().expect("tasks").drain(..) {
            t.abort();
        }
        self.lock().watchers.clear();
    }

    /// The API server comes back on the same port.
    async fn restart(self: &Arc<Self>) {
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .await
            .expect("rebind");
        self.serve(listener);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("fake state")
    }

    fn requests(&self) -> Vec<Recorded> {
        self.lock().requests.clone()
    }

    fn count(&self, f: impl Fn(&Recorded) -> bool) -> usize {
        self.lock().requests.iter().filter(|r| f(r)).count()
    }

    fn secret(&self) -> BTreeMap<String, Vec<u8>> {
        self.secret_of(NS, SECRET)
    }

    fn secret_of(&self, ns: &str, name: &str) -> BTreeMap<String, Vec<u8>> {
        self.lock()
            .secrets
            .get(&key(ns, name))
            .cloned()
            .unwrap_or_default()
    }

    /// Changes the Service and tells every open watch (a MODIFIED event), unless `quietly`.
    fn change_service(&self, f: impl FnOnce(&mut Value), quietly: bool) {
        self.change(NS, SERVICE, f, quietly);
    }

    fn change(&self, ns: &str, name: &str, f: impl FnOnce(&mut Value), quietly: bool) {
        let mut st = self.lock();
        let rv = st.next_rv();
        let Some(svc) = st.services.get_mut(&key(ns, name)) else {
            panic!("no Service {ns}/{name} in the fake");
        };
        f(svc);
        svc["metadata"]["resourceVersion"] = json!(rv);
        let svc = svc.clone();
        if !quietly {
            st.notify("MODIFIED", &svc);
        }
    }

    /// A new Service (an ADDED event), unless `quietly`.
    fn add(&self, mut svc: Value, quietly: bool) {
        let mut st = self.lock();
        svc["metadata"]["resourceVersion"] = json!(st.next_rv());
        st.services.insert(obj_key(&svc), svc.clone());
        if !quietly {
            st.notify("ADDED", &svc);
        }
    }

    fn delete(&self, ns: &str, name: &str) {
        let mut st = self.lock();
        let rv = st.next_rv();
        let mut svc = st
            .services
            .remove(&key(ns, name))
            .expect("Service to delete");
        svc["metadata"]["resourceVersion"] = json!(rv);
        st.notify("DELETED", &svc);
    }

    /// Ends every open watch response, as an API server does at its watch timeout.
    fn drop_watches(&self) {
        self.lock().watchers.clear();
    }

    /// Tells every open watch that its resourceVersion is too old (410 Gone), then ends it: the
    /// client must list again.
    fn expire_watches(&self) {
        let mut st = self.lock();
        let mut line = json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version", "reason": "Expired", "code": 410,
        }})
        .to_string();
        line.push('\n');
        for w in st.watchers.drain(..) {
            let _ = w.tx.send(Bytes::from(line.clone()));
        }
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or_default().to_string();
        let bytes = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => Bytes::new(),
        };
        let body = String::from_utf8_lossy(&bytes).to_string();
        let mut st = self.lock();
        st.requests.push(Recorded {
            method: method.clone(),
            path: path.clone(),
            query: query.clone(),
            body: body.clone(),
        });
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match (&method, segments.as_slice()) {
            (&Method::GET, ["api", "v1", "namespaces", ns, "services", name]) => {
                match st.services.get(&key(ns, name)) {
                    Some(svc) => reply(StatusCode::OK, svc),
                    None => status(StatusCode::NOT_FOUND, "NotFound", "no such Service"),
                }
            }
            (
                &Method::GET,
                ["api", "v1", "services"] | ["api", "v1", "namespaces", _, "services"],
            ) => {
                let namespace = match segments.as_slice() {
                    [_, _, "namespaces", ns, _] => Some(ns.to_string()),
                    _ => None,
                };
                let name = param(&query, "fieldSelector")
                    .map(|f| f.replace("%3D", "=").replace("%3d", "="))
                    .and_then(|f| f.strip_prefix("metadata.name=").map(str::to_string));
                let watcher = Watcher {
                    namespace,
                    name,
                    tx: mpsc::unbounded_channel().0,
                };
                let matching: Vec<Value> = st
                    .services
                    .values()
                    .filter(|s| watcher.matches(s))
                    .cloned()
                    .collect();
                if !query.contains("watch=true") {
                    let list = json!({
                        "kind": "ServiceList", "apiVersion": "v1",
                        "metadata": {"resourceVersion": st.resource_version.to_string()},
                        "items": matching,
                    });
                    return reply(StatusCode::OK, &list);
                }
                let (tx, rx) = mpsc::unbounded_channel();
                let since: u64 = param(&query, "resourceVersion")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                for svc in matching.iter().filter(|s| since < service_rv(s)) {
                    let _ = tx.send(watch_line(svc));
                }
                st.watchers.push(Watcher { tx, ..watcher });
                let stream = futures::stream::unfold(rx, |mut rx| async move {
                    rx.recv()
                        .await
                        .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
                });
                Response::builder()
                    .header("content-type", "application/json")
                    .body(StreamBody::new(stream).boxed_unsync())
                    .expect("response")
            }
            (&Method::GET, ["api", "v1", "namespaces", ns, "secrets", name]) => {
                match st.secrets.get(&key(ns, name)) {
                    Some(data) => reply(
                        StatusCode::OK,
                        &secret_json(ns, name, data, st.resource_version),
                    ),
                    None => status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("secrets \"{name}\" not found"),
                    ),
                }
            }
            (&Method::PATCH, ["api", "v1", "namespaces", ns, "secrets", name]) => {
                if st.conflicts > 0 {
                    st.conflicts -= 1;
                    return status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        "the object has been modified",
                    );
                }
                let k = key(ns, name);
                // Server-side apply that creates the object is authorized as create too.
                if !st.secrets.contains_key(&k) && !st.may_create_secrets {
                    return status(
                        StatusCode::FORBIDDEN,
                        "Forbidden",
                        &format!("secrets \"{name}\" is forbidden: User \"system:serviceaccount:{ns}:tgp\" cannot create resource \"secrets\" in API group \"\" in the namespace \"{ns}\""),
                    );
                }
                let Ok(patch) = serde_json::from_str::<Value>(&body) else {
                    return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
                };
                let data = st.secrets.entry(k).or_default();
                if let Some(map) = patch["data"].as_object() {
                    for (k, v) in map {
                        let v = v.as_str().and_then(|s| {
                            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, s)
                                .ok()
                        });
                        data.insert(k.clone(), v.unwrap_or_default());
                    }
                }
                let data = data.clone();
                let rv = st.next_rv();
                reply(
                    StatusCode::OK,
                    &secret_json(ns, name, &data, rv.parse().unwrap_or(0)),
                )
            }
            (&Method::POST, ["api", "v1", "namespaces", _, "events"]) => {
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                reply(StatusCode::CREATED, &v)
            }
            _ => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "no such path in the fake",
            ),
        }
    }
}

fn obj_key(v: &Value) -> Key {
    key(
        v["metadata"]["namespace"].as_str().unwrap_or_default(),
        v["metadata"]["name"].as_str().unwrap_or_default(),
    )
}

fn param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn service_rv(svc: &Value) -> u64 {
    svc["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn watch_line(svc: &Value) -> Bytes {
    let mut line = json!({"type": "MODIFIED", "object": svc}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn secret_json(ns: &str, name: &str, data: &BTreeMap<String, Vec<u8>>, rv: u64) -> Value {
    let data: serde_json::Map<String, Value> = data
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                json!(base64::Engine::encode(
                    &base64::engine::general_purpose::STANDARD,
                    v
                )),
            )
        })
        .collect();
    json!({
        "kind": "Secret", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": ns, "resourceVersion": rv.to_string()},
        "type": "Opaque",
        "data": data,
    })
}

fn reply(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed_unsync())
        .expect("response")
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let v = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    reply(code, &v)
}

// ------------------------------------------------------------------------------------------------
// Inputs and the sidecar process
// ------------------------------------------------------------------------------------------------

fn peer_key() -> String {
    SecretKey([7; 32]).public_key().to_base64()
}

fn base_config(extra_peer: bool) -> String {
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

fn service(annotations: Value) -> Value {
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

fn exposed() -> Value {
    service(json!({"tunnelgate.dev/expose": "true"}))
}

/// A temp dir with the kubeconfig and the base config.
struct Inputs {
    dir: PathBuf,
}

impl Inputs {
    fn new(fake: &Fake, tag: &str) -> Inputs {
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

    fn base_path(&self) -> PathBuf {
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
struct Sidecar {
    child: Child,
    log: PathBuf,
}

impl Sidecar {
    fn start(inputs: &Inputs, run: u32) -> Sidecar {
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
    fn start_with(inputs: &Inputs, tag: &str, args: &[&str], env: &[(&str, &str)]) -> Sidecar {
        let log = inputs.dir.join(format!("sidecar-{tag}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_tunnelgate-sidecar"))
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
            .envs(env.iter().copied())
            .env("RUST_LOG", "info,tunnelgate=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start tunnelgate-sidecar");
        Sidecar { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; the exit status must be 0.
    fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let status = wait_child(&mut self.child, Duration::from_secs(10));
        assert_eq!(status, Some(0), "sidecar exit status; log:\n{}", self.log());
    }
}

fn wait_child(child: &mut Child, timeout: Duration) -> Option<i32> {
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
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
async fn wait_for(sidecar: &Sidecar, what: &str, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; sidecar log:\n{}",
            sidecar.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct MapFiles(BTreeMap<String, String>);

impl SecretFiles for MapFiles {
    fn read_secret(&self, path: &Path) -> Result<String, String> {
        self.0
            .get(&path.display().to_string())
            .cloned()
            .ok_or_else(|| "no such file".into())
    }
}

fn utf8(data: &BTreeMap<String, Vec<u8>>, key: &str) -> String {
    String::from_utf8(data.get(key).cloned().unwrap_or_default()).expect("utf-8")
}

/// What the daemon would load from the Secret as the fake holds it.
fn daemon_config(data: &BTreeMap<String, Vec<u8>>) -> Config {
    let files = MapFiles(BTreeMap::from([(
        "/etc/tunnelgate/private.key".to_string(),
        utf8(data, "private.key"),
    )]));
    Config::parse(
        &utf8(data, "tunnelgate.toml"),
        Path::new("/etc/tunnelgate"),
        &files,
    )
    .expect("the daemon accepts the rendered config")
}

fn patches(fake: &Fake) -> usize {
    fake.count(Recorded::is_secret_patch)
}

/// Starts the sidecar and waits for its first write and an open watch.
async fn started(fake: &Arc<Fake>, inputs: &Inputs) -> Sidecar {
    let sidecar = Sidecar::start(inputs, 1);
    wait_for(&sidecar, "the first apply", || patches(fake) == 1).await;
    wait_for(&sidecar, "an open watch", || {
        !fake.lock().watchers.is_empty()
    })
    .await;
    sidecar
}

// ------------------------------------------------------------------------------------------------
// Tests
// ------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_run_creates_the_key_and_a_second_run_writes_nothing() {
    // The Secret exists, empty, as the manifests create it.
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "first");
    let sidecar = Sidecar::start(&inputs, 1);
    wait_for(&sidecar, "the first apply", || patches(&fake) == 1).await;

    let patch = fake
        .requests()
        .into_iter()
        .find(Recorded::is_secret_patch)
        .expect("patch");
    assert!(
        patch.query.contains("fieldManager=tunnelgate-sidecar"),
        "{}",
        patch.query
    );
    assert!(patch.query.contains("force=true"), "{}", patch.query);
    let body: Value = serde_json::from_str(&patch.body).expect("apply body is JSON");
    assert_eq!(body["kind"], "Secret");
    assert_eq!(body["metadata"]["name"], SECRET);

    let data = fake.secret();
    let keys: Vec<&str> = data.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        ["device_ips", "private.key", "public_key", "tunnelgate.toml"]
    );
    let config = daemon_config(&data);
    assert_eq!(
        utf8(&data, "public_key"),
        config.interface.private_key.public_key().to_base64()
    );
    assert_eq!(
        utf8(&data, "device_ips"),
        r#"["100.64.0.1","fd7a:115c:a1e0::1"]"#
    );
    assert_eq!(config.ingress.len(), 1);
    assert_eq!(config.ingress[0].ports[0].to_string(), "80/tcp");
    sidecar.stop();

    // Same inputs again: it reads the Secret, finds it up to date, and writes nothing.
    fake.lock().requests.clear();
    let second = Sidecar::start(&inputs, 2);
    wait_for(&second, "the Secret read", || {
        fake.count(Recorded::is_secret_get) >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        patches(&fake),
        0,
        "second run wrote; log:\n{}",
        second.log()
    );
    assert_eq!(fake.secret(), data, "the Secret is untouched");
    second.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_secret_is_created_by_apply() {
    let fake = Fake::start(exposed(), None).await;
    let inputs = Inputs::new(&fake, "create");
    let sidecar = started(&fake, &inputs).await;
    assert_eq!(fake.secret().len(), 4);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_change_gives_exactly_one_apply() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "change");
    let sidecar = started(&fake, &inputs).await;
    let key = utf8(&fake.secret(), "private.key");

    fake.change_service(
        |s| {
            s["spec"]["ports"]
                .as_array_mut()
                .expect("ports")
                .push(json!({"name": "https", "port": 443, "targetPort": 8443, "protocol": "TCP"}))
        },
        false,
    );
    wait_for(&sidecar, "the second apply", || patches(&fake) == 2).await;
    // A change that does not touch the rendered config writes nothing.
    fake.change_service(
        |s| s["metadata"]["annotations"]["other"] = json!("x"),
        false,
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(patches(&fake), 2, "log:\n{}", sidecar.log());

    let data = fake.secret();
    let ports: Vec<String> = daemon_config(&data).ingress[0]
        .ports
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ports, ["80/tcp", "443/tcp"]);
    assert_eq!(utf8(&data, "private.key"), key, "the key is never replaced");
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflict_is_retried_and_recovered() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    fake.lock().conflicts = 2;
    let inputs = Inputs::new(&fake, "conflict");
    let sidecar = Sidecar::start(&inputs, 1);
    wait_for(&sidecar, "the Secret written", || fake.secret().len() == 4).await;
    assert_eq!(patches(&fake), 3, "two 409s, then success");
    daemon_config(&fake.secret());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(patches(&fake), 3, "no more writes once it succeeded");
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_watch_is_resumed() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "dropped");
    let sidecar = started(&fake, &inputs).await;
    let watches = fake.count(Recorded::is_watch);

    fake.drop_watches();
    wait_for(&sidecar, "a new watch", || {
        fake.count(Recorded::is_watch) > watches && !fake.lock().watchers.is_empty()
    })
    .await;
    let resumed = fake
        .requests()
        .into_iter()
        .rfind(Recorded::is_watch)
        .expect("watch");
    assert!(
        resumed.query.contains("resourceVersion="),
        "{}",
        resumed.query
    );

    fake.change_service(|s| s["spec"]["ports"][0]["port"] = json!(81), false);
    wait_for(&sidecar, "the apply after the resumed watch", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).ingress[0].ports[0].listen, 81);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_watch_lists_again() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "expired");
    let sidecar = started(&fake, &inputs).await;
    let is_list =
        |r: &Recorded| r.method == Method::GET && r.path.ends_with("/services") && !r.is_watch();
    assert_eq!(fake.count(is_list), 1);

    // Changed while the watch was expiring: only the new list shows it.
    fake.change_service(|s| s["spec"]["ports"][0]["port"] = json!(83), true);
    fake.expire_watches();
    wait_for(&sidecar, "a new list", || fake.count(is_list) == 2).await;
    wait_for(&sidecar, "the apply after the relist", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).ingress[0].ports[0].listen, 83);
    wait_for(&sidecar, "a new watch", || !fake.lock().watchers.is_empty()).await;
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_restart_is_survived() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "restart");
    let sidecar = started(&fake, &inputs).await;

    fake.stop();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Changed while the sidecar could not see it.
    fake.change_service(|s| s["spec"]["ports"][0]["port"] = json!(82), true);
    fake.restart().await;
    wait_for(&sidecar, "the apply after the restart", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).ingress[0].ports[0].listen, 82);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn base_config_change_is_rendered() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "base");
    let sidecar = started(&fake, &inputs).await;
    // Atomically, as a ConfigMap mount changes.
    let tmp = inputs.dir.join("base.toml.new");
    std::fs::write(&tmp, base_config(true)).expect("write");
    std::fs::rename(&tmp, inputs.base_path()).expect("rename");
    wait_for(&sidecar, "the apply of the new base config", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).peers.len(), 2);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_annotation_records_an_event_and_keeps_the_secret() {
    let fake = Fake::start(exposed(), Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "bad");
    let sidecar = started(&fake, &inputs).await;
    let good = fake.secret();

    fake.change_service(
        |s| s["metadata"]["annotations"]["tunnelgate.dev/tunnel-ip"] = json!("100.64.0.300"),
        false,
    );
    wait_for(&sidecar, "an Event", || fake.count(Recorded::is_event) == 1).await;
    let event: Value = serde_json::from_str(
        &fake
            .requests()
            .into_iter()
            .find(Recorded::is_event)
            .expect("event")
            .body,
    )
    .expect("event JSON");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["involvedObject"]["kind"], "Service");
    assert_eq!(event["involvedObject"]["name"], SERVICE);
    assert_eq!(event["involvedObject"]["uid"], "0b7c5f3e-uid");
    let message = event["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("\"100.64.0.300\" is not an IP address"),
        "{message}"
    );

    // Conflicting annotations: a second, different problem, a second Event.
    fake.change_service(
        |s| s["metadata"]["annotations"]["tunnelgate.dev/tunnel-fqdn"] = json!("db.internal"),
        false,
    );
    wait_for(&sidecar, "a second Event", || {
        fake.count(Recorded::is_event) == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(patches(&fake), 1, "nothing written for bad input");
    assert_eq!(fake.secret(), good, "the last good Secret stays");

    // Fixed: written again, and no more Events.
    fake.change_service(
        |s| {
            let a = s["metadata"]["annotations"]
                .as_object_mut()
                .expect("annotations");
            a.remove("tunnelgate.dev/tunnel-fqdn");
            a.insert("tunnelgate.dev/tunnel-ip".into(), json!("100.64.0.2"));
        },
        false,
    );
    wait_for(&sidecar, "the apply of the fixed Service", || {
        patches(&fake) == 2
    })
    .await;
    assert_eq!(daemon_config(&fake.secret()).egress.len(), 1);
    assert_eq!(fake.count(Recorded::is_event), 2);
    sidecar.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_the_first_run_writes_nothing() {
    // Exposed, but headless: no ClusterIP to forward to.
    let mut svc = exposed();
    svc["spec"]["clusterIP"] = json!("None");
    svc["spec"]["clusterIPs"] = json!(["None"]);
    let fake = Fake::start(svc, Some(BTreeMap::new())).await;
    let inputs = Inputs::new(&fake, "headless");
    let sidecar = Sidecar::start(&inputs, 1);
    wait_for(&sidecar, "an Event", || fake.count(Recorded::is_event) == 1).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(patches(&fake), 0);
    assert!(fake.secret().is_empty(), "no key, no config written");
    assert_eq!(fake.count(Recorded::is_event), 1, "reported once");
    assert!(
        sidecar.log().contains("has no ClusterIP"),
        "{}",
        sidecar.log()
    );
    sidecar.stop();
}

#[test]
fn bad_usage_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_tunnelgate-sidecar"))
        .args([
            "--secret",
            "Bad/Name",
            "--service",
            "tg/web",
            "--base-config",
            "/x",
        ])
        .env_remove("TUNNELGATE_SECRET")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--secret"));
}

// ------------------------------------------------------------------------------------------------
// Proxy groups
// ------------------------------------------------------------------------------------------------

const GROUP: &str = "tgp";
const POOL: &str = "100.64.1.0/24";

/// A Service of `group` (or of none) in `ns`, created at `created` (seconds into the day).
fn group_service(
    ns: &str,
    name: &str,
    group: Option<&str>,
    created: u32,
    annotations: Value,
) -> Value {
    let mut annotations = annotations;
    if let Some(g) = group {
        annotations["tunnelgate.dev/proxy-group"] = json!(g);
    }
    json!({
        "kind": "Service", "apiVersion": "v1",
        "metadata": {
            "name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}"),
            "creationTimestamp": format!("2025-01-01T00:00:{created:02}Z"),
            "annotations": annotations,
        },
        "spec": {
            "type": "ClusterIP",
            "clusterIP": format!("10.96.0.{created}"),
            "clusterIPs": [format!("10.96.0.{created}")],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    })
}

fn group_ingress(ns: &str, name: &str, created: u32, port: u16) -> Value {
    let mut s = group_service(
        ns,
        name,
        Some(GROUP),
        created,
        json!({"tunnelgate.dev/expose": "true"}),
    );
    s["spec"]["ports"][0]["port"] = json!(port);
    s
}

fn group_egress(
    ns: &str,
    name: &str,
    created: u32,
    target: &str,
    port: u16,
    target_port: u16,
) -> Value {
    let mut s = group_service(
        ns,
        name,
        Some(GROUP),
        created,
        json!({"tunnelgate.dev/tunnel-ip": target}),
    );
    s["spec"]["ports"][0] =
        json!({"name": "db", "port": port, "targetPort": target_port, "protocol": "TCP"});
    s
}

/// Two namespaces: an ingress Service in `apps`, an egress one in `shop`, one of another group and
/// one of none (both on the same port as the ingress, so serving them would clash).
fn group_cluster() -> Vec<Value> {
    vec![
        group_ingress("apps", "web", 10, 80),
        group_egress("shop", "db", 11, "100.64.0.2", 5432, 15432),
        group_service(
            "apps",
            "other",
            Some("another"),
            12,
            json!({"tunnelgate.dev/expose": "true"}),
        ),
        group_service(
            "apps",
            "plain",
            None,
            13,
            json!({"tunnelgate.dev/expose": "true"}),
        ),
    ]
}

/// The replicas' Secrets, created empty beforehand as the manifests do.
fn replica_secrets(n: u32) -> BTreeMap<Key, BTreeMap<String, Vec<u8>>> {
    (0..n)
        .map(|i| (key(NS, &format!("{GROUP}-{i}")), BTreeMap::new()))
        .collect()
}

fn replica(inputs: &Inputs, ordinal: u32, tag: &str) -> Sidecar {
    let pod = format!("{GROUP}-{ordinal}");
    Sidecar::start_with(
        inputs,
        &format!("{pod}-{tag}"),
        &["--proxy-group", GROUP],
        &[
            ("POD_NAME", pod.as_str()),
            ("POD_NAMESPACE", NS),
            ("TUNNELGATE_ADDRESS_POOLS", POOL),
        ],
    )
}

fn is_patch_of(name: &str) -> impl Fn(&Recorded) -> bool + '_ {
    move |r| {
        r.method == Method::PATCH && r.path == format!("/api/v1/namespaces/{NS}/secrets/{name}")
    }
}

fn replica_patches(fake: &Fake, ordinal: u32) -> usize {
    fake.count(is_patch_of(&format!("{GROUP}-{ordinal}")))
}

fn replica_secret(fake: &Fake, ordinal: u32) -> BTreeMap<String, Vec<u8>> {
    fake.secret_of(NS, &format!("{GROUP}-{ordinal}"))
}

/// `target ports` of each rule, e.g. `10.96.0.10 80/tcp`.
fn rule_lines(fwds: &[tunnelgate::config::Forward]) -> Vec<String> {
    fwds.iter()
        .map(|f| {
            let target = match &f.target {
                tunnelgate::config::Target::Ip(ip) => ip.to_string(),
                tunnelgate::config::Target::Fqdn(n) => n.clone(),
            };
            let ports: Vec<String> = f.ports.iter().map(ToString::to_string).collect();
            format!("{target} {}", ports.join(","))
        })
        .collect()
}

fn events(fake: &Fake) -> Vec<Value> {
    fake.requests()
        .into_iter()
        .filter(Recorded::is_event)
        .map(|r| serde_json::from_str(&r.body).expect("event JSON"))
        .collect()
}

/// Waits until both replicas have written `n` times in all and opened their watch.
async fn both_written(fake: &Fake, sidecars: &[&Sidecar; 2], n: usize) {
    for (i, s) in sidecars.iter().enumerate() {
        wait_for(s, &format!("replica {i}'s write number {n}"), || {
            replica_patches(fake, i as u32) == n
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_of_two_replicas_serves_the_services_of_two_namespaces() {
    let fake = Fake::start_many(group_cluster(), replica_secrets(2)).await;
    let inputs = Inputs::new(&fake, "group");
    let r0 = replica(&inputs, 0, "a");
    let r1 = replica(&inputs, 1, "a");
    both_written(&fake, &[&r0, &r1], 1).await;
    wait_for(&r0, "two open watches", || fake.lock().watchers.len() == 2).await;

    // Cluster-wide list and watch: the group spans namespaces.
    assert!(fake
        .requests()
        .iter()
        .any(|r| r.path == "/api/v1/services" && r.query.contains("watch=true")));
    // Each replica wrote only its own Secret.
    let patched: BTreeSet<String> = fake
        .requests()
        .into_iter()
        .filter(|r| r.method == Method::PATCH)
        .map(|r| r.path)
        .collect();
    assert_eq!(
        patched,
        BTreeSet::from([
            format!("/api/v1/namespaces/{NS}/secrets/tgp-0"),
            format!("/api/v1/namespaces/{NS}/secrets/tgp-1"),
        ])
    );

    let (s0, s1) = (replica_secret(&fake, 0), replica_secret(&fake, 1));
    assert_eq!(utf8(&s0, "device_ips"), r#"["100.64.1.1"]"#);
    assert_eq!(utf8(&s1, "device_ips"), r#"["100.64.1.2"]"#);
    assert_ne!(utf8(&s0, "private.key"), utf8(&s1, "private.key"));
    assert_ne!(utf8(&s0, "public_key"), utf8(&s1, "public_key"));
    for s in [&s0, &s1] {
        let c = daemon_config(s);
        assert_eq!(
            utf8(s, "public_key"),
            c.interface.private_key.public_key().to_base64()
        );
        // apps/web only: apps/other (another group) and apps/plain (no group) are ignored.
        assert_eq!(rule_lines(&c.ingress), ["10.96.0.10 80/tcp"]);
        assert_eq!(rule_lines(&c.egress), ["100.64.0.2 15432:5432/tcp"]);
    }
    assert!(events(&fake).is_empty(), "{:?}", events(&fake));

    // A Service joins (in a third namespace): one write per replica.
    fake.add(group_ingress("blog", "api", 20, 443), false);
    both_written(&fake, &[&r0, &r1], 2).await;
    for i in 0..2 {
        let c = daemon_config(&replica_secret(&fake, i));
        assert_eq!(
            rule_lines(&c.ingress),
            ["10.96.0.10 80/tcp", "10.96.0.20 443/tcp"]
        );
    }

    // One changes: its new port is written.
    fake.change(
        "shop",
        "db",
        |s| s["spec"]["ports"][0]["targetPort"] = json!(15433),
        false,
    );
    both_written(&fake, &[&r0, &r1], 3).await;
    let c = daemon_config(&replica_secret(&fake, 1));
    assert_eq!(rule_lines(&c.egress), ["100.64.0.2 15433:5432/tcp"]);

    // A later Service on port 80: an Event from each replica on it, and no write; the others
    // keep working.
    fake.add(group_ingress("blog", "clash", 30, 80), false);
    wait_for(&r0, "an Event from each replica", || {
        events(&fake).len() == 2
    })
    .await;
    for e in events(&fake) {
        assert_eq!(e["type"], "Warning");
        assert_eq!(e["reason"], "TunnelgateServiceLeftOut");
        assert_eq!(e["involvedObject"]["kind"], "Service");
        assert_eq!(e["involvedObject"]["namespace"], "blog");
        assert_eq!(e["involvedObject"]["name"], "clash");
        assert_eq!(e["involvedObject"]["uid"], "uid-blog-clash");
        assert_eq!(e["metadata"]["namespace"], "blog");
        let m = e["message"].as_str().unwrap_or_default();
        assert!(
            m.contains("port 80/tcp on the tunnel addresses is already served by Service apps/web"),
            "{m}"
        );
    }
    // A bad annotation on another Service: its own Event, still no write.
    fake.add(
        group_service(
            "shop",
            "bad",
            Some(GROUP),
            31,
            json!({"tunnelgate.dev/tunnel-ip": "100.64.0.300"}),
        ),
        false,
    );
    wait_for(&r1, "Events on the bad Service", || {
        events(&fake).len() == 4
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        (replica_patches(&fake, 0), replica_patches(&fake, 1)),
        (3, 3)
    );
    assert_eq!(
        events(&fake).len(),
        4,
        "each problem reported once per replica"
    );

    // Leaving: deleted, and re-annotated to another group.
    fake.delete("blog", "api");
    both_written(&fake, &[&r0, &r1], 4).await;
    fake.change(
        "shop",
        "db",
        |s| s["metadata"]["annotations"]["tunnelgate.dev/proxy-group"] = json!("another"),
        false,
    );
    both_written(&fake, &[&r0, &r1], 5).await;
    let c = daemon_config(&replica_secret(&fake, 0));
    assert_eq!(rule_lines(&c.ingress), ["10.96.0.10 80/tcp"]);
    assert!(c.egress.is_empty());

    // The clashing Service's rival leaves: it is served now.
    fake.delete("apps", "web");
    both_written(&fake, &[&r0, &r1], 6).await;
    let c = daemon_config(&replica_secret(&fake, 0));
    assert_eq!(rule_lines(&c.ingress), ["10.96.0.30 80/tcp"]);

    let keys = [replica_secret(&fake, 0), replica_secret(&fake, 1)];
    r0.stop();
    r1.stop();

    // Restarted with nothing changed: both read, neither writes, the keys stay.
    let before = (replica_patches(&fake, 0), replica_patches(&fake, 1));
    let secret_get = |i: u32| {
        move |r: &Recorded| {
            r.method == Method::GET && r.path == format!("/api/v1/namespaces/{NS}/secrets/tgp-{i}")
        }
    };
    let gets = [fake.count(secret_get(0)), fake.count(secret_get(1))];
    let r0 = replica(&inputs, 0, "b");
    let r1 = replica(&inputs, 1, "b");
    for (i, s) in [&r0, &r1].iter().enumerate() {
        wait_for(s, "the Secret read", || {
            fake.count(secret_get(i as u32)) > gets[i]
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        (replica_patches(&fake, 0), replica_patches(&fake, 1)),
        before,
        "a restart with nothing changed writes nothing; logs:\n{}\n{}",
        r0.log(),
        r1.log()
    );
    assert_eq!([replica_secret(&fake, 0), replica_secret(&fake, 1)], keys);
    r0.stop();
    r1.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_expired_cluster_wide_watch_lists_again() {
    let fake = Fake::start_many(group_cluster(), replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "group-expired");
    let r0 = replica(&inputs, 0, "a");
    wait_for(&r0, "the first write", || replica_patches(&fake, 0) == 1).await;
    wait_for(&r0, "an open watch", || !fake.lock().watchers.is_empty()).await;
    let is_list =
        |r: &Recorded| r.method == Method::GET && r.path == "/api/v1/services" && !r.is_watch();
    assert_eq!(fake.count(is_list), 1);

    // Joined and left while the watch was expiring: only the new list shows it.
    fake.add(group_ingress("blog", "api", 20, 443), true);
    fake.lock().services.remove(&key("shop", "db"));
    fake.expire_watches();
    wait_for(&r0, "a new list", || fake.count(is_list) == 2).await;
    wait_for(&r0, "the write after the relist", || {
        replica_patches(&fake, 0) == 2
    })
    .await;
    let c = daemon_config(&replica_secret(&fake, 0));
    assert_eq!(
        rule_lines(&c.ingress),
        ["10.96.0.10 80/tcp", "10.96.0.20 443/tcp"]
    );
    assert!(c.egress.is_empty(), "the Service deleted unseen is gone");
    wait_for(&r0, "a new watch", || !fake.lock().watchers.is_empty()).await;
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_secret_that_does_not_exist_needs_create() {
    // No Secret, and (as with the example Role) no `create` on secrets.
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    fake.lock().may_create_secrets = false;
    let inputs = Inputs::new(&fake, "group-create");
    let r0 = replica(&inputs, 0, "a");
    wait_for(&r0, "a refused apply", || replica_patches(&fake, 0) >= 1).await;
    wait_for(&r0, "the log naming the fix", || {
        r0.log()
            .contains("a Secret that does not exist yet needs create too")
    })
    .await;
    assert!(replica_secret(&fake, 0).is_empty());

    // Granting create (or creating the Secret) is enough: the retry writes it.
    fake.lock().may_create_secrets = true;
    wait_for(&r0, "the Secret created by apply", || {
        replica_secret(&fake, 0).len() == 4
    })
    .await;
    daemon_config(&replica_secret(&fake, 0));
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_in_listed_namespaces_only_watches_those() {
    let fake = Fake::start_many(group_cluster(), replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "group-ns");
    let r0 = Sidecar::start_with(
        &inputs,
        "ns",
        &["--proxy-group", GROUP, "--namespace", "shop"],
        &[
            ("POD_NAME", "tgp-0"),
            ("POD_NAMESPACE", NS),
            ("TUNNELGATE_ADDRESS_POOLS", POOL),
        ],
    );
    wait_for(&r0, "the first write", || replica_patches(&fake, 0) == 1).await;
    assert!(fake.requests().iter().all(|r| r.path != "/api/v1/services"));
    let c = daemon_config(&replica_secret(&fake, 0));
    assert!(
        c.ingress.is_empty(),
        "apps/web is in a namespace not listed"
    );
    assert_eq!(rule_lines(&c.egress), ["100.64.0.2 15432:5432/tcp"]);
    r0.stop();
}

#[test]
fn group_bad_usage_exits_2() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tunnelgate-sidecar"))
            .args(args)
            .args(["--base-config", "/x"])
            .env_remove("POD_NAME")
            .env_remove("TUNNELGATE_SECRET")
            .env_remove("TUNNELGATE_SERVICE")
            .env_remove("TUNNELGATE_PROXY_GROUP")
            .env_remove("TUNNELGATE_ADDRESS_POOLS")
            .envs(env.iter().copied())
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // A pool needs an ordinal.
    let (code, err) = run(
        &["--proxy-group", "tgp", "--address-pool", POOL],
        &[("POD_NAME", "tgp")],
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("has no ordinal suffix"), "{err}");
    // Replica 300 does not fit a /24.
    let (code, err) = run(
        &["--proxy-group", "tgp"],
        &[("POD_NAME", "tgp-300"), ("TUNNELGATE_ADDRESS_POOLS", POOL)],
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("replica 300 needs host 301"), "{err}");
    // Both modes, or neither.
    let (code, _) = run(
        &["--proxy-group", "tgp", "--service", "tg/web"],
        &[("POD_NAME", "tgp-0")],
    );
    assert_eq!(code, Some(2));
    let (code, _) = run(&[], &[("POD_NAME", "tgp-0")]);
    assert_eq!(code, Some(2));
    // No Secret to write.
    let (code, err) = run(&["--proxy-group", "tgp"], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("POD_NAME"), "{err}");
}
