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
//!
//! Proxy groups at scale (the fake has the real 1 MiB Secret limit): at 10,000 Services a burst
//! of 50 costs at most 10 writes per replica and the sidecar stays under 64 MiB; 20 % port
//! clashes converge and their Events come after the Secret, rate-limited; 20,000 Services fit
//! (compressed); past the limit the oldest serve, the rest get Events and a change still
//! applies; a deleted or edited Secret is restored with its key; the group converges after a
//! 10 s API outage and the log does not blame RBAC. Time bounds are checked in release builds.
//!
//! containers/README.md: every `kubectl` command it shows is listed in [`README_KUBECTL`] with how
//! it is checked. Those that a fake API server can answer run verbatim with the real kubectl
//! against the fake (which answers discovery and just enough OpenAPI v3 for it): `apply -k` of
//! both examples, the sidecars started as the applied StatefulSet says, the `get -o jsonpath`
//! reads, `describe service` with its Warning Event, and the key rotation `patch`. The README's
//! peer config, filled in from those reads, is brought up by `wg-quick` (root).

mod common;
// The StatefulSet's pod run from the image with podman, against this file's fake (root).
#[path = "sidecar_fake_api/pod_image.rs"]
mod pod_image;

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
use tunnelgate::clock;
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
    /// Every other object (what `kubectl apply` creates, and Events), by collection path (such as
    /// `apis/apps/v1/statefulsets`), namespace (empty: cluster-scoped) and name.
    objects: BTreeMap<(String, String, String), Value>,
    /// The last octet of the next ClusterIP to allocate.
    next_cluster_ip: u8,
    /// The API server's Secret size limit (the decoded values): a larger one is refused with
    /// 422 "Too long", as the real one does.
    secret_limit: usize,
    /// Per Secret, the data keys the sidecar's server-side apply last sent: a key it stops
    /// sending is removed, as server-side apply does for a field its manager no longer applies.
    applied_keys: BTreeMap<Key, BTreeSet<String>>,
    /// Open watches of one Secret each (a `metadata.name` field selector).
    secret_watchers: Vec<(Key, mpsc::UnboundedSender<Bytes>)>,
}

impl State {
    fn next_rv(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }

    /// Tells the watches of Secret `k` what became of it (`None`: deleted).
    fn notify_secret(&mut self, k: &Key, rv: u64) {
        let (kind, data) = match self.secrets.get(k) {
            Some(d) => ("MODIFIED", d.clone()),
            None => ("DELETED", BTreeMap::new()),
        };
        let obj = secret_json(&k.0, &k.1, &data, rv);
        let mut line = json!({"type": kind, "object": obj}).to_string();
        line.push('\n');
        let line = Bytes::from(line);
        self.secret_watchers
            .retain(|(w, tx)| w != k || tx.send(line.clone()).is_ok());
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
        Fake::start_on(listener, services, secrets)
    }

    /// [`Fake::start_many`] on `listener` (one bound in a test's network namespace).
    fn start_on(
        listener: TcpListener,
        services: Vec<Value>,
        secrets: BTreeMap<Key, BTreeMap<String, Vec<u8>>>,
    ) -> Arc<Fake> {
        let port = listener.local_addr().expect("addr").port();
        let mut state = State {
            resource_version: 1,
            services: BTreeMap::new(),
            secrets,
            requests: Vec::new(),
            conflicts: 0,
            may_create_secrets: true,
            watchers: Vec::new(),
            objects: BTreeMap::new(),
            next_cluster_ip: 100,
            secret_limit: SECRET_LIMIT,
            applied_keys: BTreeMap::new(),
            secret_watchers: Vec::new(),
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

    /// `kubectl delete secret NS/NAME`.
    fn delete_secret(&self, ns: &str, name: &str) {
        let mut st = self.lock();
        st.secrets.remove(&key(ns, name));
        st.applied_keys.remove(&key(ns, name));
        let rv = st.next_rv().parse().unwrap_or(0);
        st.notify_secret(&key(ns, name), rv);
    }

    /// Someone else changes a key of Secret NS/NAME (`kubectl edit`).
    fn edit_secret(&self, ns: &str, name: &str, k: &str, v: &[u8]) {
        let mut st = self.lock();
        st.secrets
            .get_mut(&key(ns, name))
            .expect("Secret to edit")
            .insert(k.to_string(), v.to_vec());
        let rv = st.next_rv().parse().unwrap_or(0);
        st.notify_secret(&key(ns, name), rv);
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
        let content_type = req
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
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
        if method == Method::GET {
            if let Some(v) = discovery(&path) {
                return reply(StatusCode::OK, &v);
            }
        }
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
                // References: a page clones only its own Services (cloning all 10,000 for each
                // page of 500 made this stand-in, not the sidecar, the slow part of a list).
                let matching: Vec<&Value> = st
                    .services
                    .values()
                    .filter(|s| watcher.matches(s))
                    .collect();
                if !query.contains("watch=true") {
                    // Pages of `limit`, as the API server gives them (kube asks for 500): the
                    // continue token is the offset of the next page.
                    let from: usize = param(&query, "continue")
                        .and_then(|c| c.parse().ok())
                        .unwrap_or(0);
                    let limit: usize = param(&query, "limit")
                        .and_then(|l| l.parse().ok())
                        .unwrap_or(usize::MAX);
                    let page: Vec<Value> = matching
                        .iter()
                        .skip(from)
                        .take(limit)
                        .map(|s| (*s).clone())
                        .collect();
                    let mut metadata = json!({"resourceVersion": st.resource_version.to_string()});
                    if from.saturating_add(limit) < matching.len() {
                        metadata["continue"] = json!((from + limit).to_string());
                    }
                    let list = json!({
                        "kind": "ServiceList", "apiVersion": "v1",
                        "metadata": metadata,
                        "items": page,
                    });
                    return reply(StatusCode::OK, &list);
                }
                let (tx, rx) = mpsc::unbounded_channel();
                let since: u64 = param(&query, "resourceVersion")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                for svc in matching.into_iter().filter(|s| since < service_rv(s)) {
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
            (&Method::GET, ["api", "v1", "namespaces", ns, "secrets"]) => {
                // Only what the sidecar asks: its own Secret, by a metadata.name field selector.
                let Some(name) = param(&query, "fieldSelector")
                    .map(|f| f.replace("%3D", "=").replace("%3d", "="))
                    .and_then(|f| f.strip_prefix("metadata.name=").map(str::to_string))
                else {
                    return status(
                        StatusCode::FORBIDDEN,
                        "Forbidden",
                        "list secrets needs a name",
                    );
                };
                let k = key(ns, &name);
                let rv = st.resource_version;
                if !query.contains("watch=true") {
                    let items: Vec<Value> = st
                        .secrets
                        .get(&k)
                        .map(|d| secret_json(ns, &name, d, rv))
                        .into_iter()
                        .collect();
                    let list = json!({
                        "kind": "SecretList", "apiVersion": "v1",
                        "metadata": {"resourceVersion": rv.to_string()},
                        "items": items,
                    });
                    return reply(StatusCode::OK, &list);
                }
                let (tx, rx) = mpsc::unbounded_channel();
                st.secret_watchers.push((k, tx));
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
            (&Method::PATCH, ["api", "v1", "namespaces", ns, "secrets", name])
                if content_type == "application/json-patch+json" =>
            {
                // `kubectl patch --type=json`: only `remove` of a data key is needed here.
                let Some(data) = st.secrets.get_mut(&key(ns, name)) else {
                    return status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("secrets \"{name}\" not found"),
                    );
                };
                let ops: Vec<Value> = serde_json::from_str(&body).unwrap_or_default();
                for op in &ops {
                    let path = op["path"].as_str().unwrap_or_default();
                    let Some(k) = path.strip_prefix("/data/") else {
                        return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", path);
                    };
                    let k = k.replace("~1", "/").replace("~0", "~");
                    if op["op"] != "remove" || data.remove(&k).is_none() {
                        return status(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "Invalid",
                            &format!("the fake cannot apply {op}"),
                        );
                    }
                }
                let data = data.clone();
                let rv = st.next_rv().parse().unwrap_or(0);
                st.notify_secret(&key(ns, name), rv);
                reply(StatusCode::OK, &secret_json(ns, name, &data, rv))
            }
            (&Method::POST, ["api", "v1", "namespaces", ns, "secrets"]) => {
                let Ok(v) = serde_json::from_str::<Value>(&body) else {
                    return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
                };
                let name = v["metadata"]["name"].as_str().unwrap_or_default();
                if st.secrets.contains_key(&key(ns, name)) {
                    return status(StatusCode::CONFLICT, "AlreadyExists", name);
                }
                let decode = |s: &Value| {
                    base64::Engine::decode(
                        &base64::engine::general_purpose::STANDARD,
                        s.as_str().unwrap_or_default(),
                    )
                    .unwrap_or_default()
                };
                let data: BTreeMap<String, Vec<u8>> = v["data"]
                    .as_object()
                    .map(|m| m.iter().map(|(k, s)| (k.clone(), decode(s))).collect())
                    .unwrap_or_default();
                st.secrets.insert(key(ns, name), data.clone());
                let rv = st.next_rv().parse().unwrap_or(0);
                st.notify_secret(&key(ns, name), rv);
                reply(StatusCode::CREATED, &secret_json(ns, name, &data, rv))
            }
            (&Method::POST, ["api", "v1", "namespaces", ns, "services"]) => {
                let Ok(mut svc) = serde_json::from_str::<Value>(&body) else {
                    return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
                };
                let name = svc["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                if st.services.contains_key(&key(ns, &name)) {
                    return status(StatusCode::CONFLICT, "AlreadyExists", &name);
                }
                // What the API server fills in: a ClusterIP (unless headless or ExternalName).
                if svc["spec"]["type"] != "ExternalName" && svc["spec"]["clusterIP"] != "None" {
                    let ip = format!("10.96.0.{}", st.next_cluster_ip);
                    st.next_cluster_ip += 1;
                    svc["spec"]["clusterIP"] = json!(ip);
                    svc["spec"]["clusterIPs"] = json!([ip]);
                }
                let rv = st.next_rv();
                created_metadata(&mut svc, ns, &name, &rv);
                st.services.insert(key(ns, &name), svc.clone());
                st.notify("ADDED", &svc);
                reply(StatusCode::CREATED, &svc)
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
                let mut data = st.secrets.get(&k).cloned().unwrap_or_default();
                let sent: BTreeMap<String, Vec<u8>> = patch["data"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| {
                        let v = v.as_str().and_then(|s| {
                            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, s)
                                .ok()
                        });
                        (k.clone(), v.unwrap_or_default())
                    })
                    .collect();
                // Server-side apply: a key this manager applied before and no longer sends goes.
                for old in st.applied_keys.get(&k).into_iter().flatten() {
                    if !sent.contains_key(old) {
                        data.remove(old);
                    }
                }
                data.extend(sent.clone());
                let size: usize = data.values().map(Vec::len).sum();
                if size > st.secret_limit {
                    return status(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        &format!("Secret \"{name}\" is invalid: data: Too long: may not be more than {} bytes", st.secret_limit),
                    );
                }
                st.applied_keys
                    .insert(k.clone(), sent.into_keys().collect());
                st.secrets.insert(k.clone(), data.clone());
                let rv = st.next_rv().parse().unwrap_or(0);
                st.notify_secret(&k, rv);
                reply(StatusCode::OK, &secret_json(ns, name, &data, rv))
            }
            _ => st.object(&method, &segments, &query, &body),
        }
    }
}

/// The real API server's Secret limit: 1 MiB of decoded data.
const SECRET_LIMIT: usize = 1_048_576;

/// The kinds the fake knows: (group/version path, resource, kind, namespaced). Enough for
/// `kubectl apply -k` of both examples, `get`, `describe service` and `patch secret`.
const RESOURCES: &[(&str, &str, &str, bool)] = &[
    ("api/v1", "namespaces", "Namespace", false),
    ("api/v1", "services", "Service", true),
    ("api/v1", "secrets", "Secret", true),
    ("api/v1", "configmaps", "ConfigMap", true),
    ("api/v1", "serviceaccounts", "ServiceAccount", true),
    ("api/v1", "events", "Event", true),
    ("api/v1", "endpoints", "Endpoints", true),
    ("api/v1", "pods", "Pod", true),
    ("apis/apps/v1", "statefulsets", "StatefulSet", true),
    ("apis/apps/v1", "deployments", "Deployment", true),
    ("apis/rbac.authorization.k8s.io/v1", "roles", "Role", true),
    (
        "apis/rbac.authorization.k8s.io/v1",
        "rolebindings",
        "RoleBinding",
        true,
    ),
    (
        "apis/rbac.authorization.k8s.io/v1",
        "clusterroles",
        "ClusterRole",
        false,
    ),
    (
        "apis/rbac.authorization.k8s.io/v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        false,
    ),
    (
        "apis/policy/v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        true,
    ),
    (
        "apis/networking.k8s.io/v1",
        "networkpolicies",
        "NetworkPolicy",
        true,
    ),
    (
        "apis/discovery.k8s.io/v1",
        "endpointslices",
        "EndpointSlice",
        true,
    ),
];

/// `group/version` as the API names it (`v1`, `apps/v1`).
fn group_version(gv_path: &str) -> &str {
    gv_path
        .strip_prefix("apis/")
        .unwrap_or_else(|| gv_path.trim_start_matches("api/"))
}

/// What kubectl asks before anything else: the version, the resource lists (the plain ones, as
/// an API server older than aggregated discovery answers), and the OpenAPI v3 documents, only as
/// far as kubectl reads them: that PATCH takes `fieldValidation`, so validation is left to the
/// server (which the fake does not do: the schemas are checked by `sidecar_manifests`).
fn discovery(path: &str) -> Option<Value> {
    let gv_paths: BTreeSet<&str> = RESOURCES.iter().map(|r| r.0).collect();
    let resources = |gv: &str| -> Vec<Value> {
        RESOURCES
            .iter()
            .filter(|r| r.0 == gv)
            .map(|(_, name, kind, namespaced)| {
                json!({
                    "name": name, "singularName": kind.to_lowercase(), "namespaced": namespaced,
                    "kind": kind, "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                })
            })
            .collect()
    };
    let path = path.trim_start_matches('/');
    match path {
        "version" => Some(json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake"})),
        "api" => Some(json!({"kind": "APIVersions", "versions": ["v1"]})),
        "apis" => Some(json!({
            "kind": "APIGroupList", "apiVersion": "v1",
            "groups": gv_paths.iter().filter(|g| g.starts_with("apis/")).map(|g| {
                let gv = group_version(g);
                let (group, version) = gv.split_once('/').unwrap_or_default();
                let v = json!({"groupVersion": gv, "version": version});
                json!({"name": group, "versions": [v], "preferredVersion": v})
            }).collect::<Vec<_>>(),
        })),
        "openapi/v3" => Some(json!({
            "paths": gv_paths.iter().map(|g| {
                (g.to_string(), json!({"serverRelativeURL": format!("/openapi/v3/{g}?hash=0")}))
            }).collect::<serde_json::Map<_, _>>(),
        })),
        _ if gv_paths.contains(path) => Some(json!({
            "kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": group_version(path), "resources": resources(path),
        })),
        _ => {
            let gv_path = path.strip_prefix("openapi/v3/")?;
            let gv = group_version(gv_path);
            let (group, version) = gv.split_once('/').unwrap_or(("", gv));
            let paths: serde_json::Map<String, Value> = RESOURCES
                .iter()
                .filter(|r| r.0 == gv_path)
                .map(|(_, name, kind, namespaced)| {
                    let ns = if *namespaced { "/namespaces/{namespace}" } else { "" };
                    let patch = json!({"patch": {
                        "x-kubernetes-group-version-kind": {"group": group, "version": version, "kind": kind},
                        "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                    }});
                    (format!("/{gv_path}{ns}/{name}/{{name}}"), patch)
                })
                .collect();
            (!paths.is_empty()).then(|| {
                json!({"openapi": "3.0.0", "info": {"title": "fake", "version": gv}, "paths": paths})
            })
        }
    }
}

/// `(collection, namespace, name)` of an object path such as `apis/apps/v1/namespaces/NS/
/// statefulsets/NAME`; the namespace is empty for a cluster-scoped object, the name `None` for the
/// collection.
fn object_path<'a>(segments: &[&'a str]) -> Option<(String, &'a str, Option<&'a str>)> {
    let (gv, rest) = match segments {
        ["api", "v1", rest @ ..] => ("api/v1".to_string(), rest),
        ["apis", g, v, rest @ ..] => (format!("apis/{g}/{v}"), rest),
        _ => return None,
    };
    let (ns, res, name) = match rest {
        ["namespaces", ns, res] => (*ns, *res, None),
        ["namespaces", ns, res, name] => (*ns, *res, Some(*name)),
        [res] => ("", *res, None),
        [res, name] => ("", *res, Some(*name)),
        _ => return None,
    };
    Some((format!("{gv}/{res}"), ns, name))
}

/// What the API server sets on a new object. The creation time follows the resourceVersion, so
/// that objects created later are newer.
fn created_metadata(obj: &mut Value, ns: &str, name: &str, rv: &str) {
    let n: u64 = rv.parse().unwrap_or(0);
    let meta = &mut obj["metadata"];
    meta["name"] = json!(name);
    if !ns.is_empty() {
        meta["namespace"] = json!(ns);
    }
    meta["uid"] = json!(format!("uid-{ns}-{name}"));
    meta["resourceVersion"] = json!(rv);
    meta["creationTimestamp"] = json!(format!(
        "2025-01-02T{:02}:{:02}:{:02}Z",
        n / 3600 % 24,
        n / 60 % 60,
        n % 60
    ));
}

/// Percent-decoding of a query value.
fn unescape(s: &str) -> String {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(c)) => {
                out.push(c);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `obj` matches a field selector such as `involvedObject.name=web,involvedObject.kind=
/// Service` (what `kubectl describe` asks for its Events).
fn field_selected(obj: &Value, selector: &str) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let Some((field, want)) = term.split_once('=') else {
            return false;
        };
        let got = field.split('.').fold(obj, |v, k| &v[k]);
        got.as_str().unwrap_or_default() == want
    })
}

impl State {
    /// Any other object: get, list (with a field selector) and create.
    fn object(
        &mut self,
        method: &Method,
        segments: &[&str],
        query: &str,
        body: &str,
    ) -> Response<Body> {
        let Some((coll, ns, name)) = object_path(segments) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "no such path in the fake",
            );
        };
        let Some(&(gv_path, resource, kind, _)) = RESOURCES
            .iter()
            .find(|r| format!("{}/{}", r.0, r.1) == coll)
        else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "no such resource in the fake",
            );
        };
        match (method, name) {
            (&Method::GET, Some(name)) => {
                match self.objects.get(&(coll, ns.to_string(), name.to_string())) {
                    Some(obj) => reply(StatusCode::OK, obj),
                    None => status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("{resource} \"{name}\" not found"),
                    ),
                }
            }
            (&Method::GET, None) => {
                let selector = param(query, "fieldSelector")
                    .map(unescape)
                    .unwrap_or_default();
                let items: Vec<Value> = self
                    .objects
                    .iter()
                    .filter(|((c, n, _), obj)| {
                        *c == coll && (ns.is_empty() || n == ns) && field_selected(obj, &selector)
                    })
                    .map(|(_, obj)| obj.clone())
                    .collect();
                reply(
                    StatusCode::OK,
                    &json!({
                        "kind": format!("{kind}List"), "apiVersion": group_version(gv_path),
                        "metadata": {"resourceVersion": self.resource_version.to_string()},
                        "items": items,
                    }),
                )
            }
            (&Method::POST, None) => {
                let Ok(mut obj) = serde_json::from_str::<Value>(body) else {
                    return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
                };
                let rv = self.next_rv();
                let name = match obj["metadata"]["name"].as_str() {
                    Some(n) => n.to_string(),
                    None => format!(
                        "{}{rv}",
                        obj["metadata"]["generateName"].as_str().unwrap_or_default()
                    ),
                };
                let k = (coll, ns.to_string(), name.clone());
                if self.objects.contains_key(&k) {
                    return status(
                        StatusCode::CONFLICT,
                        "AlreadyExists",
                        &format!("{resource} \"{name}\" already exists"),
                    );
                }
                created_metadata(&mut obj, ns, &name, &rv);
                self.objects.insert(k, obj.clone());
                reply(StatusCode::CREATED, &obj)
            }
            _ => status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "not in the fake",
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
        Sidecar::start_under(&[], inputs, tag, args, env)
    }

    /// [`Sidecar::start_with`], run by the command `under` (such as `setpriv` with a user).
    fn start_under(
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
    Config::parse(&config_text(data), Path::new("/etc/tunnelgate"), &files)
        .expect("the daemon accepts the rendered config")
}

/// The rendered configuration as the daemon reads it: `tunnelgate.toml`, or when the sidecar
/// stored it compressed, `tunnelgate.toml.gz` gunzipped (never both).
fn config_text(data: &BTreeMap<String, Vec<u8>>) -> String {
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

/// An exposed ExternalName Service of the group: ingress to `external_name` on `port`.
fn group_external(ns: &str, name: &str, created: u32, external_name: &str, port: u16) -> Value {
    let mut s = group_ingress(ns, name, created, port);
    s["spec"] = json!({
        "type": "ExternalName",
        "externalName": external_name,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    });
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_service_whose_name_does_not_resolve_gets_a_warning_event() {
    let services = vec![
        group_ingress("apps", "web", 10, 80),
        group_external("apps", "gone", 11, "gone.invalid", 81),
        group_external("apps", "local", 12, "localhost", 82),
    ];
    let fake = Fake::start_many(services, replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "group-dns");
    // The pod's DNS: /etc/hosts answers `localhost`; the name server (nothing listens on
    // 127.0.0.1:53) answers nothing else.
    let resolv = inputs.dir.join("resolv.conf");
    std::fs::write(&resolv, "nameserver 127.0.0.1\n").expect("resolv.conf");
    let resolv = resolv.display().to_string();
    let pod = format!("{GROUP}-0");
    let r0 = Sidecar::start_with(
        &inputs,
        "tgp-0-dns",
        &["--proxy-group", GROUP],
        &[
            ("POD_NAME", pod.as_str()),
            ("POD_NAMESPACE", NS),
            ("TUNNELGATE_ADDRESS_POOLS", POOL),
            ("TUNNELGATE_RESOLV_CONF", resolv.as_str()),
        ],
    );
    let name_events = || -> Vec<Value> {
        events(&fake)
            .into_iter()
            .filter(|e| e["reason"] == "TunnelgateNameUnresolved")
            .collect()
    };
    wait_for(&r0, "the Warning Event on apps/gone", || {
        !name_events().is_empty()
    })
    .await;

    // The Secret serves all three, and the daemon is told the name is that Service's problem.
    let c = daemon_config(&replica_secret(&fake, 0));
    assert_eq!(
        rule_lines(&c.ingress),
        [
            "10.96.0.10 80/tcp",
            "gone.invalid 81/tcp",
            "localhost 82/tcp"
        ]
    );
    let labels: Vec<Option<&str>> = c.ingress.iter().map(|f| f.service.as_deref()).collect();
    assert_eq!(
        labels,
        [Some("apps/web"), Some("apps/gone"), Some("apps/local")]
    );
    assert_eq!(
        c.health.readiness,
        tunnelgate::config::Readiness::PerService
    );

    let e = &name_events()[0];
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["involvedObject"]["kind"], "Service");
    assert_eq!(e["involvedObject"]["namespace"], "apps");
    assert_eq!(e["involvedObject"]["name"], "gone");
    assert_eq!(e["involvedObject"]["uid"], "uid-apps-gone");
    let m = e["message"].as_str().unwrap_or_default();
    assert!(
        m.contains("target name gone.invalid (") && m.contains("replica 0 of proxy group tgp"),
        "{m}"
    );
    // After the Secret write, never before it.
    let order: Vec<bool> = fake
        .requests()
        .into_iter()
        .filter(|r| is_patch_of(&pod)(r) || r.is_event())
        .map(|r| r.is_event())
        .collect();
    assert_eq!(
        order.first(),
        Some(&false),
        "the write comes first: {order:?}"
    );

    // Another Service joins, with a name of its own: a new write and a new check, and the
    // persisting problem is not reported again.
    let checks = || r0.log().matches("Services' names checked").count();
    let before = checks();
    fake.add(group_external("apps", "local2", 13, "localhost", 83), false);
    wait_for(&r0, "the second write", || replica_patches(&fake, 0) == 2).await;
    wait_for(&r0, "the next check", || checks() > before).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let all = events(&fake);
    assert_eq!(
        all.len(),
        1,
        "one Event, on apps/gone only (localhost resolves, apps/web has no name): {all:?}"
    );
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

/// `--secret NS/NAME` names the replica's Secret instead of `$POD_NAMESPACE/$POD_NAME`; a problem
/// of the replica itself (here a broken `private.key` in that Secret) is a Warning Event on its
/// Pod, said once, and nothing is written until it is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_secret_flag_and_a_replica_problem_warned_on_its_pod() {
    let mut secrets = BTreeMap::new();
    secrets.insert(
        key(NS, "custom-0"),
        BTreeMap::from([("private.key".to_string(), b"not a key".to_vec())]),
    );
    let fake = Fake::start_many(group_cluster(), secrets).await;
    let inputs = Inputs::new(&fake, "group-secret-flag");
    let secret_flag = format!("{NS}/custom-0");
    let r0 = Sidecar::start_with(
        &inputs,
        "secret-flag",
        &["--proxy-group", GROUP, "--secret", &secret_flag],
        &[
            ("POD_NAME", "tgp-0"),
            ("POD_NAMESPACE", NS),
            ("TUNNELGATE_ADDRESS_POOLS", POOL),
        ],
    );
    let pod_warning = |fake: &Fake| {
        events(fake).into_iter().find(|e| {
            e["involvedObject"]["kind"] == "Pod" && e["involvedObject"]["name"] == "tgp-0"
        })
    };
    wait_for(&r0, "a Warning Event on the pod", || {
        pod_warning(&fake).is_some()
    })
    .await;
    let e = pod_warning(&fake).expect("event");
    assert_eq!(e["type"], "Warning", "{e}");
    assert_eq!(e["involvedObject"]["namespace"], NS, "{e}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(message.contains("private.key"), "{message}");
    assert_eq!(fake.count(is_patch_of("custom-0")), 0, "nothing written");

    // Fixed (the key deleted, so one is generated): the named Secret is written, and never
    // the pod-named one.
    fake.lock()
        .secrets
        .insert(key(NS, "custom-0"), BTreeMap::new());
    // (The sidecar reads the Secret on its next pass: a Service event here, else its 5-minute
    // resync.)
    fake.add(group_ingress("blog", "api", 20, 443), false);
    wait_for(&r0, "the write to custom-0", || {
        fake.count(is_patch_of("custom-0")) == 1
    })
    .await;
    let written = fake.secret_of(NS, "custom-0");
    assert_eq!(daemon_config(&written).interface.addresses.len(), 1);
    assert_eq!(
        fake.count(is_patch_of("tgp-0")),
        0,
        "the pod-named Secret untouched"
    );
    let pod_events = events(&fake)
        .into_iter()
        .filter(|e| e["involvedObject"]["kind"] == "Pod")
        .count();
    assert_eq!(pod_events, 1, "the problem was said once");
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

// ------------------------------------------------------------------------------------------------
// Proxy groups at scale: size, coalescing, Events after the Secret, its own Secret, outages
// ------------------------------------------------------------------------------------------------

/// Services of the group as a cluster at scale has them: spread over 20 namespaces, 70 % ingress
/// and 30 % egress, 1 to 3 ports each. Service `i` is created at second `i` of the day. Every
/// port is its own (taken from `next_port`), except that with `clash_every` > 0 every such-th
/// Service takes the ports of the one before it: it clashes and is left out. `long_names`: a
/// name of 63 characters that do not compress, to fill the Secret with fewer Services.
fn scale_services(
    from: u32,
    n: u32,
    clash_every: u32,
    next_port: &mut u32,
    long_names: bool,
) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for i in from..from + n {
        let ns = format!("ns-{}", i % 20);
        let name = if long_names {
            // A cheap hash of i: hex digits with no pattern gzip can use.
            let mut h = u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xDEAD_BEEF;
            let mut name = format!("s{i:06}-");
            while name.len() < 63 {
                h ^= h << 13;
                h ^= h >> 7;
                h ^= h << 17;
                name.push_str(&format!("{h:016x}"));
            }
            name.truncate(63);
            name
        } else {
            format!("svc-{i}")
        };
        let clash = clash_every > 0 && i % clash_every == clash_every - 1 && !out.is_empty();
        let (ingress, ports): (bool, Vec<u32>) = match out.last() {
            Some(prev) if clash => {
                let ingress = prev["metadata"]["annotations"]["tunnelgate.dev/expose"] == "true";
                let field = if ingress { "port" } else { "targetPort" };
                let ports = prev["spec"]["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p[field].as_u64())
                    .map(|p| p as u32)
                    .collect();
                (ingress, ports)
            }
            _ => {
                let ports = (0..1 + i % 3)
                    .map(|_| {
                        // Never the health port (9002) or WireGuard's (51820): the daemon
                        // refuses an egress rule on those, and these Services are all valid.
                        while [9002, 51820].contains(next_port) {
                            *next_port += 1;
                        }
                        *next_port += 1;
                        *next_port - 1
                    })
                    .collect();
                (i % 10 < 7, ports)
            }
        };
        assert!(*next_port < 65_000, "out of ports");
        let annotations = if ingress {
            json!({"tunnelgate.dev/proxy-group": GROUP, "tunnelgate.dev/expose": "true"})
        } else {
            json!({"tunnelgate.dev/proxy-group": GROUP, "tunnelgate.dev/tunnel-ip": "100.64.0.2"})
        };
        let spec_ports: Vec<Value> = ports
            .iter()
            .enumerate()
            .map(|(k, p)| {
                if ingress {
                    json!({"name": format!("p{k}"), "port": p, "targetPort": p, "protocol": "TCP"})
                } else {
                    json!({"name": format!("p{k}"), "port": 5432 + k, "targetPort": p, "protocol": "TCP"})
                }
            })
            .collect();
        let ip = format!("10.{}.{}.{}", 96 + i / 65_536, (i / 256) % 256, i % 256);
        out.push(json!({
            "kind": "Service", "apiVersion": "v1",
            "metadata": {
                "name": name, "namespace": ns, "uid": format!("uid-{i}"),
                "creationTimestamp": format!(
                    "2025-01-0{}T{:02}:{:02}:{:02}Z", 1 + i / 86_400, (i / 3600) % 24, (i / 60) % 60, i % 60
                ),
                "annotations": annotations,
            },
            "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "ports": spec_ports},
        }));
    }
    out
}

/// The Services (`NS/NAME`) a replica's Secret serves, as the daemon would load it.
fn served_services(data: &BTreeMap<String, Vec<u8>>) -> BTreeSet<String> {
    if data.is_empty() {
        return BTreeSet::new();
    }
    let c = daemon_config(data);
    c.ingress
        .iter()
        .chain(&c.egress)
        .filter_map(|f| f.service.clone())
        .collect()
}

/// How long a test at scale waits: a debug build lists and renders 10,000 Services about ten
/// times slower than a release build.
const SCALE_WAIT: Duration = Duration::from_secs(180);

/// Whether the time and memory bounds of the tests at scale are checked: in a release build
/// (`cargo test --release`), where they are the figures the README gives. A debug build checks
/// everything else and prints its timings and memory.
const TIMED: bool = !cfg!(debug_assertions);

/// Polls `f` until it holds, for up to [`SCALE_WAIT`].
async fn wait_long(sidecar: &Sidecar, what: &str, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + SCALE_WAIT;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; sidecar log:\n{}",
            sidecar.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until replica `ordinal` has written at least `writes` times and serves `n` Services.
async fn serves(fake: &Fake, sidecar: &Sidecar, ordinal: u32, writes: usize, n: usize) {
    let what = format!("replica {ordinal} serving {n} Services");
    let deadline = tokio::time::Instant::now() + SCALE_WAIT;
    loop {
        if replica_patches(fake, ordinal) >= writes
            && served_services(&replica_secret(fake, ordinal)).len() == n
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; sidecar log:\n{}",
            sidecar.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The peak resident memory of a process (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM")
        * 1024
}

fn secret_size(data: &BTreeMap<String, Vec<u8>>) -> usize {
    data.values().map(Vec::len).sum()
}

/// Where in the fake's log of requests the first one matching `f` is.
fn first_request(fake: &Fake, f: impl Fn(&Recorded) -> bool) -> Option<usize> {
    fake.requests().iter().position(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_at_10000_services_a_burst_is_coalesced_and_memory_stays_under_64_mib() {
    let mut next_port = 1024;
    let services = scale_services(0, 10_000, 0, &mut next_port, false);
    let fake = Fake::start_many(services, replica_secrets(2)).await;
    let inputs = Inputs::new(&fake, "scale-burst");
    let r0 = replica(&inputs, 0, "a");
    let r1 = replica(&inputs, 1, "a");
    serves(&fake, &r0, 0, 1, 10_000).await;
    serves(&fake, &r1, 1, 1, 10_000).await;
    let before = [replica_patches(&fake, 0), replica_patches(&fake, 1)];

    // 50 new Services, one every 20 ms.
    for svc in scale_services(10_000, 50, 0, &mut next_port, false) {
        fake.add(svc, false);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    serves(&fake, &r0, 0, before[0] + 1, 10_050).await;
    serves(&fake, &r1, 1, before[1] + 1, 10_050).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (i, r) in [&r0, &r1].into_iter().enumerate() {
        let writes = replica_patches(&fake, i as u32) - before[i];
        let rss = peak_rss(r.child.id());
        eprintln!(
            "replica {i}: {writes} writes for 50 Services, peak RSS {} MiB",
            rss >> 20
        );
        assert!(
            writes <= 10,
            "replica {i}: {writes} writes for a burst of 50 Services"
        );
        // A debug build takes more memory; the bound is the release build's.
        assert!(
            !TIMED || rss <= 64 << 20,
            "replica {i}: peak RSS {} MiB",
            rss >> 20
        );
    }
    r0.stop();
    r1.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_at_10000_services_with_20_percent_clashes_converges_and_events_follow() {
    let mut next_port = 1024;
    let services = scale_services(0, 10_000, 5, &mut next_port, false);
    let fake = Fake::start_many(services, replica_secrets(2)).await;
    let inputs = Inputs::new(&fake, "scale-clash");
    let started = tokio::time::Instant::now();
    let r0 = replica(&inputs, 0, "a");
    let r1 = replica(&inputs, 1, "a");
    wait_long(&r0, "both Secrets written", || {
        replica_patches(&fake, 0) >= 1 && replica_patches(&fake, 1) >= 1
    })
    .await;
    let converged = started.elapsed();
    for (i, r) in [&r0, &r1].into_iter().enumerate() {
        serves(&fake, r, i as u32, 1, 8_000).await;
        // The Secret went out before any Event about a Service left out.
        let patch = first_request(&fake, is_patch_of(&format!("{GROUP}-{i}"))).expect("patch");
        let event = first_request(&fake, |r| {
            r.is_event() && r.body.contains(&format!("replica {i} of proxy group"))
        });
        assert!(
            event.is_none_or(|e| e > patch),
            "replica {i}: Event before the Secret"
        );
    }
    eprintln!("10,000 Services, 2,000 clashes: both replicas written {converged:?} after start");
    assert!(
        !TIMED || converged <= Duration::from_secs(2),
        "converged after {converged:?}"
    );
    // The Events follow, at a bounded rate: a burst, then about 10 a second per replica.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = events(&fake).len();
    let elapsed = started.elapsed().as_secs_f64();
    assert!(sent >= 20, "only {sent} Events");
    assert!(
        (sent as f64) <= 2.0 * (25.0 + 10.0 * elapsed) + 2.0,
        "{sent} Events in {elapsed:.1} s: not rate-limited"
    );
    let reasons: BTreeSet<String> = events(&fake)
        .iter()
        .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        reasons,
        BTreeSet::from(["TunnelgateServiceLeftOut".to_string()])
    );
    r0.stop();
    r1.stop();
}

/// `services` with every egress Service's `tunnel-ip` replaced by a `tunnel-fqdn` that does not
/// resolve (`NAME.NS.invalid`): each gets a Warning Event, queued behind the others.
fn with_unresolvable_names(mut services: Vec<Value>) -> Vec<Value> {
    for svc in &mut services {
        let meta = &mut svc["metadata"];
        let name = format!(
            "{}.{}.invalid",
            meta["name"].as_str().unwrap_or_default(),
            meta["namespace"].as_str().unwrap_or_default()
        );
        if let Some(a) = meta["annotations"].as_object_mut() {
            if a.remove("tunnelgate.dev/tunnel-ip").is_some() {
                a.insert("tunnelgate.dev/tunnel-fqdn".into(), json!(name));
            }
        }
    }
    services
}

/// 20,000 Services over the sidecar's whole life within the manifests' 64 MiB limit: the list
/// at start, the Secret (gzip-compressed), a check of 6,000 names that do not resolve and their
/// queued Events, a burst of 50 new Services, then three single adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_at_20000_services_fits_the_secret_and_memory_stays_under_64_mib() {
    let mut next_port = 1024;
    let services = with_unresolvable_names(scale_services(0, 20_000, 0, &mut next_port, false));
    let fqdn_services = services
        .iter()
        .filter(|s| s["metadata"]["annotations"]["tunnelgate.dev/tunnel-fqdn"].is_string())
        .count();
    let fake = Fake::start_many(services, replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "scale-20k");
    // The pod's DNS: nothing listens on 127.0.0.1:53, so no name resolves.
    let resolv = inputs.dir.join("resolv.conf");
    std::fs::write(&resolv, "nameserver 127.0.0.1\n").expect("resolv.conf");
    let resolv = resolv.display().to_string();
    let pod = format!("{GROUP}-0");
    let r0 = Sidecar::start_with(
        &inputs,
        "tgp-0-20k",
        &["--proxy-group", GROUP],
        &[
            ("POD_NAME", pod.as_str()),
            ("POD_NAMESPACE", NS),
            ("TUNNELGATE_ADDRESS_POOLS", POOL),
            ("TUNNELGATE_RESOLV_CONF", resolv.as_str()),
        ],
    );
    let started = tokio::time::Instant::now();
    serves(&fake, &r0, 0, 1, 20_000).await;
    let converged = started.elapsed();
    let converged_rss = peak_rss(r0.child.id());
    let data = replica_secret(&fake, 0);
    assert!(data.contains_key("tunnelgate.toml.gz"), "{:?}", data.keys());
    let size = secret_size(&data);
    assert!(size <= SECRET_LIMIT);
    // The names were checked and their Events queued (sent at about 10 a second).
    let unresolved = || {
        events(&fake)
            .iter()
            .filter(|e| e["reason"] == "TunnelgateNameUnresolved")
            .count()
    };
    wait_long(&r0, "the first Events on names that do not resolve", || {
        unresolved() >= 20
    })
    .await;

    // A burst of 50, then three single adds (each one a pass and a check of every name). Only
    // in a release build, whose bound this is: a debug build takes a minute per pass here.
    if !TIMED {
        eprintln!(
            "20,000 Services: written {converged:?} after start, Secret {size} bytes, peak RSS {} MiB (debug build: no burst, no adds)",
            converged_rss >> 20
        );
        r0.stop();
        return;
    }
    let before = replica_patches(&fake, 0);
    for svc in with_unresolvable_names(scale_services(20_000, 50, 0, &mut next_port, false)) {
        fake.add(svc, false);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    serves(&fake, &r0, 0, before + 1, 20_050).await;
    for k in 0..3 {
        let writes = replica_patches(&fake, 0);
        let svc = with_unresolvable_names(scale_services(20_050 + k, 1, 0, &mut next_port, false));
        fake.add(svc.into_iter().next().expect("one Service"), false);
        serves(&fake, &r0, 0, writes + 1, 20_051 + k as usize).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss = peak_rss(r0.child.id());
    eprintln!(
        "20,000 Services: written {converged:?} after start, Secret {size} bytes ({} bytes of TOML), peak RSS {} MiB converged, {} MiB after {fqdn_services} names checked, a burst of 50 and 3 adds",
        config_text(&data).len(),
        converged_rss >> 20,
        rss >> 20
    );
    let reasons: BTreeSet<String> = events(&fake)
        .iter()
        .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        reasons,
        BTreeSet::from(["TunnelgateNameUnresolved".to_string()])
    );
    // A debug build takes more memory; the bound is the release build's (the manifests' limit).
    assert!(!TIMED || rss <= 64 << 20, "peak RSS {} MiB", rss >> 20);
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_past_the_size_limit_serves_the_oldest_and_still_applies_changes() {
    let mut next_port = 1024;
    let n = 20_000;
    let services = scale_services(0, n, 0, &mut next_port, true);
    let names: Vec<String> = services
        .iter()
        .map(|s| {
            format!(
                "{}/{}",
                s["metadata"]["namespace"].as_str().unwrap_or_default(),
                s["metadata"]["name"].as_str().unwrap_or_default()
            )
        })
        .collect();
    let fake = Fake::start_many(services, replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "scale-over");
    let r0 = replica(&inputs, 0, "a");
    wait_long(&r0, "the first write", || replica_patches(&fake, 0) >= 1).await;
    let data = replica_secret(&fake, 0);
    assert!(secret_size(&data) <= SECRET_LIMIT);
    let served = served_services(&data);
    let k = served.len();
    assert!(k > 1_000 && k < n as usize, "{k} of {n} served");
    // Exactly the k oldest.
    assert_eq!(served, names[..k].iter().cloned().collect::<BTreeSet<_>>());
    eprintln!(
        "past the limit: the {k} oldest of {n} Services served, Secret {} bytes",
        secret_size(&data)
    );
    // A Warning on the pod, then on the Services left out (rate-limited: the first ones).
    wait_long(&r0, "Events", || events(&fake).len() >= 5).await;
    let ev = events(&fake);
    assert_eq!(ev[0]["involvedObject"]["kind"], "Pod");
    assert_eq!(ev[0]["reason"], "TunnelgateConfigOverLimit");
    for e in &ev[1..] {
        assert_eq!(e["reason"], "TunnelgateServiceLeftOut");
        let who = format!(
            "{}/{}",
            e["involvedObject"]["namespace"]
                .as_str()
                .unwrap_or_default(),
            e["involvedObject"]["name"].as_str().unwrap_or_default()
        );
        assert!(!served.contains(&who), "{who} is served and got an Event");
        assert!(
            e["message"].as_str().unwrap_or_default().contains("limit"),
            "{e}"
        );
    }
    // An unrelated change of a served Service is applied.
    let (ns, name) = names[3].split_once('/').expect("NS/NAME");
    let writes = replica_patches(&fake, 0);
    fake.change(
        ns,
        name,
        |s| s["spec"]["clusterIPs"] = json!(["10.99.99.99"]),
        false,
    );
    wait_long(&r0, "the change applied", || {
        replica_patches(&fake, 0) > writes
            && config_text(&replica_secret(&fake, 0)).contains("10.99.99.99")
    })
    .await;
    assert!(secret_size(&replica_secret(&fake, 0)) <= SECRET_LIMIT);
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_secret_deleted_or_edited_is_restored_with_its_key() {
    let fake = Fake::start_many(group_cluster(), replica_secrets(1)).await;
    let inputs = Inputs::new(&fake, "own-secret");
    let r0 = replica(&inputs, 0, "a");
    wait_for(&r0, "the first write", || replica_patches(&fake, 0) == 1).await;
    wait_for(&r0, "the Secret's watch", || {
        !fake.lock().secret_watchers.is_empty()
    })
    .await;
    let first = replica_secret(&fake, 0);

    let deleted = tokio::time::Instant::now();
    fake.delete_secret(NS, "tgp-0");
    wait_for(&r0, "the Secret restored", || {
        replica_secret(&fake, 0) == first
    })
    .await;
    let restored = deleted.elapsed();
    assert!(
        restored <= Duration::from_secs(3),
        "restored after {restored:?}"
    );

    fake.edit_secret(NS, "tgp-0", "public_key", b"edited");
    wait_for(&r0, "the edit repaired", || {
        replica_secret(&fake, 0) == first
    })
    .await;
    assert_eq!(replica_patches(&fake, 0), 3, "one write per repair");
    r0.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_converges_within_5_s_after_a_10_s_api_outage() {
    let mut next_port = 1024;
    let services = scale_services(0, 1_000, 0, &mut next_port, false);
    let fake = Fake::start_many(services, replica_secrets(2)).await;
    let inputs = Inputs::new(&fake, "outage");
    let r0 = replica(&inputs, 0, "a");
    let r1 = replica(&inputs, 1, "a");
    serves(&fake, &r0, 0, 1, 1_000).await;
    serves(&fake, &r1, 1, 1, 1_000).await;

    fake.stop();
    // While it is down, a Service changes and one is added (no watch sees them).
    fake.change(
        "ns-3",
        "svc-3",
        |s| s["spec"]["clusterIPs"] = json!(["10.99.99.99"]),
        true,
    );
    for svc in scale_services(1_000, 1, 0, &mut next_port, false) {
        fake.add(svc, true);
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    fake.restart().await;
    let back = tokio::time::Instant::now();
    for (i, r) in [&r0, &r1].into_iter().enumerate() {
        serves(&fake, r, i as u32, 2, 1_001).await;
        assert!(config_text(&replica_secret(&fake, i as u32)).contains("10.99.99.99"));
    }
    let converged = back.elapsed();
    eprintln!("converged {converged:?} after the API server came back");
    assert!(
        !TIMED || converged <= Duration::from_secs(5),
        "converged {converged:?} after the outage"
    );
    for r in [&r0, &r1] {
        let log = r.log();
        assert!(log.contains("cannot be reached"), "{log}");
        assert!(
            !log.contains("RBAC") && !log.contains("check the Role"),
            "blames RBAC:\n{log}"
        );
    }
    r0.stop();
    r1.stop();
}

// ------------------------------------------------------------------------------------------------
// kubectl scale: the group's manifests, unchanged, at 2, 3, 1 and 2 replicas
// ------------------------------------------------------------------------------------------------

/// The object of `kind` named `name` in containers/k8s/group's files.
fn group_manifest(kind: &str, name: &str) -> Value {
    let dir = repo().join("containers/k8s/group");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("containers/k8s/group")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("manifest");
            serde_saphyr::from_multiple::<Value>(&text).expect("YAML")
        })
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in containers/k8s/group"))
}

/// What the group's Role lets a sidecar do to Secrets.
fn group_role_secret_verbs() -> BTreeSet<String> {
    let role = group_manifest("Role", "tgp");
    role["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter(|r| r["resources"] == json!(["secrets"]))
        .flat_map(|r| r["verbs"].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

/// One pod of the StatefulSet: its sidecar, and its volume (a fresh one per pod).
struct ScaledPod {
    sidecar: Sidecar,
    volume: PathBuf,
}

/// What a pod's proxy container would run: the config in its volume, loaded as the daemon loads
/// it (key file modes checked).
fn handed_over(volume: &Path) -> Config {
    tunnelgate::shell::config_file::load_config(&volume.join("tunnelgate.toml"))
        .unwrap_or_else(|e| panic!("{}: {e}", volume.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_scales_2_3_1_2_from_unchanged_manifests() {
    // No Secret exists: the sidecars create their own, as the Role allows.
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let verbs = group_role_secret_verbs();
    fake.lock().may_create_secrets = verbs.contains("create");
    for verb in ["get", "patch", "list", "watch"] {
        assert!(verbs.contains(verb), "the Role grants {verb}: {verbs:?}");
    }
    let inputs = Inputs::new(&fake, "scale");
    let set = group_manifest("StatefulSet", "tgp");
    let cm = group_manifest("ConfigMap", "tgp-base");
    let base = cm["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .to_string();
    let mut generation = 0;
    let mut start = |ordinal: u32| {
        generation += 1;
        let pod = format!("{GROUP}-{ordinal}");
        // A new pod: a new, empty volume.
        let volume = inputs.dir.join(format!("{pod}-volume-{generation}"));
        let tag = format!("{pod}-{generation}");
        let sidecar = sidecar_of_set(&set, &base, &inputs, &pod, &volume, &tag, &[]);
        ScaledPod { sidecar, volume }
    };
    let secret = |ordinal: u32| fake.secret_of("tunnelgate", &format!("{GROUP}-{ordinal}"));
    // A replica is up when its Secret is written and its volume holds what the Secret holds.
    async fn up(fake: &Fake, p: &ScaledPod, ordinal: u32) -> Config {
        let name = format!("{GROUP}-{ordinal}");
        wait_for(&p.sidecar, &format!("{name}'s Secret and volume"), || {
            fake.secret_of("tunnelgate", &name).len() == 4
                && p.volume.join("tunnelgate.toml").exists()
        })
        .await;
        let data = fake.secret_of("tunnelgate", &name);
        let config = handed_over(&p.volume);
        assert_eq!(
            config.interface.private_key.public_key().to_base64(),
            utf8(&data, "public_key"),
            "{name}: the volume's key is the Secret's"
        );
        assert_eq!(
            config,
            daemon_config(&data),
            "{name}: the volume runs the Secret's config"
        );
        assert_eq!(
            utf8(&data, "device_ips"),
            format!("[\"100.64.1.{}\"]", ordinal + 1),
            "{name}: host N+1 of the pool"
        );
        config
    }
    let public_key = |ordinal: u32| utf8(&secret(ordinal), "public_key");

    // 2 replicas.
    let mut pods: BTreeMap<u32, ScaledPod> = BTreeMap::new();
    for i in 0..2 {
        pods.insert(i, start(i));
    }
    for i in 0..2 {
        let c = up(&fake, &pods[&i], i).await;
        assert_eq!(rule_lines(&c.ingress), ["10.96.0.10 80/tcp"]);
    }
    let first_keys: Vec<String> = (0..2).map(public_key).collect();
    assert_ne!(first_keys[0], first_keys[1], "each replica its own key");

    // kubectl scale --replicas=3: a third pod, nothing else.
    pods.insert(2, start(2));
    up(&fake, &pods[&2], 2).await;
    let key_2 = public_key(2);
    assert!(!first_keys.contains(&key_2));

    // --replicas=1: the StatefulSet stops the highest ordinals; their Secrets stay.
    for i in [2, 1] {
        pods.remove(&i).expect("pod").sidecar.stop();
    }
    assert_eq!(public_key(1), first_keys[1]);
    assert_eq!(public_key(2), key_2);
    // The remaining replica goes on serving: a new Service reaches it.
    fake.add(group_ingress("apps", "api", 20, 8080), false);
    wait_for(&pods[&0].sidecar, "tgp-0 serves apps/api", || {
        handed_over(&pods[&0].volume).ingress.len() == 2
    })
    .await;

    // --replicas=2: ordinal 1 comes back in a new pod (an empty volume) with its key and
    // address, and finds its Secret behind by the change made while it was away.
    let patches_of_1 = || {
        fake.count(|r| {
            r.method == Method::PATCH
                && r.path == format!("/api/v1/namespaces/tunnelgate/secrets/{GROUP}-1")
        })
    };
    let patches_before = patches_of_1();
    pods.insert(1, start(1));
    let c = up(&fake, &pods[&1], 1).await;
    assert_eq!(
        public_key(1),
        first_keys[1],
        "a returning ordinal keeps its key"
    );
    assert_eq!(
        rule_lines(&c.ingress).len(),
        2,
        "it serves the group as it is now"
    );
    assert!(patches_of_1() > patches_before);
    for p in pods.into_values() {
        p.sidecar.stop();
    }
}

/// The pod's users as the group's StatefulSet file sets them, on the real kernel: the sidecar runs
/// as its non-root user and group; the proxy runs as root with only its capabilities (no
/// `CAP_DAC_OVERRIDE`) and the pod's supplementary groups, and loads what the sidecar handed over.
/// Without the supplementary group it could not: the files are the sidecar's, mode 0440.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn group_proxy_without_dac_override_reads_what_its_sidecar_hands_over() {
    common::require_root();
    let fake = Fake::start_many(group_cluster(), BTreeMap::new()).await;
    let inputs = Inputs::new(&fake, "pod-users");
    let set = group_manifest("StatefulSet", "tgp");
    let base = group_manifest("ConfigMap", "tgp-base")["data"]["base.toml"]
        .as_str()
        .expect("base.toml")
        .to_string();
    let pod = &set["spec"]["template"]["spec"];
    let container = |name: &str| {
        pod["containers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == name).cloned())
            .unwrap_or_else(|| panic!("container {name}"))
    };
    let (sidecar, proxy) = (container("sidecar"), container("proxy"));
    let id = |v: &Value| v.as_u64().expect("a numeric id").to_string();
    let (uid, gid) = (
        id(&sidecar["securityContext"]["runAsUser"]),
        id(&sidecar["securityContext"]["runAsGroup"]),
    );
    let groups: Vec<String> = pod["securityContext"]["supplementalGroups"]
        .as_array()
        .expect("supplementalGroups")
        .iter()
        .map(id)
        .collect();
    assert_eq!(id(&proxy["securityContext"]["runAsUser"]), "0");
    assert_eq!(
        proxy["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );
    let proxy_caps: Vec<String> = proxy["securityContext"]["capabilities"]["add"]
        .as_array()
        .expect("capabilities")
        .iter()
        .map(|c| format!("+{}", c.as_str().expect("cap").to_lowercase()))
        .collect();

    // An emptyDir is mode 0777; the base config and kubeconfig are readable by anyone.
    let volume = inputs.dir.join("tgp-0-volume");
    std::fs::create_dir_all(&volume).expect("volume");
    for dir in [&inputs.dir, &volume] {
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .expect("chmod");
    }
    let as_sidecar = [
        "setpriv",
        &format!("--reuid={uid}"),
        &format!("--regid={gid}"),
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ];
    let r0 = sidecar_of_set(&set, &base, &inputs, "tgp-0", &volume, "tgp-0", &as_sidecar);
    wait_for(&r0, "the handed-over config", || {
        volume.join("tunnelgate.toml").exists()
    })
    .await;
    for file in ["tunnelgate.toml", "private.key"] {
        let meta = std::fs::metadata(volume.join(file)).expect("stat");
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        assert_eq!(meta.uid().to_string(), uid, "{file} is the sidecar's");
        assert_eq!(meta.gid().to_string(), gid, "{file}");
        assert_eq!(meta.permissions().mode() & 0o777, 0o440, "{file}");
    }
    let config = volume.join("tunnelgate.toml").display().to_string();
    let check_as_proxy = |groups: &str| {
        Command::new("setpriv")
            .args([
                "--reuid=0",
                "--regid=0",
                groups,
                "--inh-caps=-all",
                "--no-new-privs",
            ])
            .arg(format!("--bounding-set=-all,{}", proxy_caps.join(",")))
            .args([
                env!("CARGO_BIN_EXE_tunnelgate"),
                "check",
                "--config",
                &config,
            ])
            .output()
            .expect("setpriv")
    };
    let out = check_as_proxy(&format!("--groups={}", groups.join(",")));
    assert!(
        out.status.success(),
        "the proxy loads the config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = check_as_proxy("--clear-groups");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("Permission denied"),
        "without the group the files are closed to it: {err}"
    );
    r0.stop();
}

// ------------------------------------------------------------------------------------------------
// The kubectl commands of containers/README.md, run as shown against the fake
// ------------------------------------------------------------------------------------------------

/// How each `kubectl` command that containers/README.md shows is checked. A command the README
/// gains must be added here (`readme_kubectl_commands_are_all_accounted_for`).
const README_KUBECTL: &[(&str, &str)] = &[
    (
        "kubectl apply -k containers/k8s",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl apply -k containers/k8s/group",
        "run against the fake: readme_proxy_group_commands",
    ),
    (
        "kubectl -n tunnelgate rollout status statefulset/tunnelgate-proxy",
        "not run: needs a StatefulSet controller and a kubelet",
    ),
    (
        "kubectl -n tunnelgate rollout status statefulset/tgp",
        "not run: needs a StatefulSet controller and a kubelet",
    ),
    (
        "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.public_key}' | base64 -d",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.device_ips}' | base64 -d",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate get service tunnelgate-proxy-wireguard -o jsonpath='{.status.loadBalancer.ingress[0].ip}'",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate logs tunnelgate-proxy-0 -c sidecar",
        "not run: needs a kubelet",
    ),
    (
        "kubectl -n tunnelgate exec tunnelgate-proxy-0 -c proxy -- tunnelgate status",
        "not run: needs a kubelet",
    ),
    (
        "kubectl -n tunnelgate exec tunnelgate-proxy-0 -c proxy -- wg show tg0",
        "not run: needs a kubelet",
    ),
    (
        "kubectl -n tunnelgate describe service web",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate patch secret tunnelgate-proxy --type=json -p '[{\"op\":\"remove\",\"path\":\"/data/private.key\"}]'",
        "run against the fake: readme_single_service_commands",
    ),
    (
        "kubectl -n tunnelgate get secret tgp-$i -o jsonpath='{.data.public_key}' | base64 -d; echo",
        "run against the fake: readme_proxy_group_commands",
    ),
    (
        "kubectl -n tunnelgate get secret tgp-$i -o jsonpath='{.data.device_ips}' | base64 -d; echo",
        "run against the fake: readme_proxy_group_commands",
    ),
    (
        "kubectl -n tunnelgate scale statefulset/tgp --replicas=3",
        "not run: the fake has no StatefulSet controller; group_scales_2_3_1_2_from_unchanged_manifests starts and stops the pods it would",
    ),
    (
        "kubectl -n apps describe service web2",
        "run against the fake: readme_proxy_group_commands",
    ),
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn readme() -> String {
    std::fs::read_to_string(repo().join("containers/README.md")).expect("containers/README.md")
}

/// The fenced blocks of containers/README.md in `lang`, as shown (indentation removed).
fn readme_blocks(lang: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for line in readme().lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim();
        match &mut current {
            None if t == format!("```{lang}") => current = Some((indent, String::new())),
            Some(_) if t == "```" => blocks.push(current.take().expect("block").1),
            Some((ind, text)) => {
                text.push_str(line.get(*ind..).unwrap_or(t));
                text.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// A `sh` line of the README starting with `start`, as shown (its comment removed).
/// A line equal to `start` wins over longer ones.
fn readme_line(start: &str) -> String {
    let mut found: Vec<String> = readme_blocks("sh")
        .iter()
        .flat_map(|b| b.lines().map(without_comment).collect::<Vec<_>>())
        .filter(|l| l.starts_with(start))
        .collect();
    if found.iter().any(|l| l == start) {
        found.retain(|l| l == start);
    }
    assert_eq!(
        found.len(),
        1,
        "README lines starting with {start:?}: {found:?}"
    );
    found.remove(0)
}

/// A `sh` line without its indentation and a comment after the command (`cmd     # what it
/// shows`).
fn without_comment(line: &str) -> String {
    let line = line.trim();
    match line.find("  #") {
        Some(i) => line[..i].trim_end().to_string(),
        None => line.to_string(),
    }
}

/// Every `kubectl` command in the README's `sh` blocks (inside the `for` loop too).
fn readme_kubectl_lines() -> Vec<String> {
    readme_blocks("sh")
        .iter()
        .flat_map(|b| b.lines().map(str::to_string).collect::<Vec<_>>())
        .map(|l| without_comment(&l))
        .filter(|l| l.starts_with("kubectl "))
        .collect()
}

#[test]
fn readme_kubectl_commands_are_all_accounted_for() {
    let shown: BTreeSet<String> = readme_kubectl_lines().into_iter().collect();
    let known: BTreeSet<String> = README_KUBECTL.iter().map(|c| c.0.to_string()).collect();
    assert_eq!(
        shown.difference(&known).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "kubectl commands in containers/README.md that no test accounts for"
    );
    assert_eq!(
        known.difference(&shown).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "commands accounted for that containers/README.md no longer shows"
    );
    // Each one the README's "What was checked here" names as run is run by the test named.
    let this = include_str!("sidecar_fake_api.rs");
    for (cmd, how) in README_KUBECTL {
        if let Some(test) = how.strip_prefix("run against the fake: ") {
            assert!(
                this.contains(&format!("async fn {test}()")),
                "{cmd}: no test {test}"
            );
        }
    }
}

/// Whether kubectl can be run: without it the test is skipped with a note, except in CI.
fn kubectl_present() -> bool {
    let found = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "kubectl is not installed"
        );
        eprintln!("SKIPPED: kubectl is not installed");
    }
    found
}

/// Runs README commands with `sh` in a copy of the repository's `containers/` (so `apply -k
/// containers/k8s` works as shown), with the fake's kubeconfig, a `HOME` of its own and nothing
/// else of the environment: a real cluster's config is never read. `kubectl` on the PATH is a
/// wrapper adding `--request-timeout`.
struct Shell {
    root: PathBuf,
    env: Vec<(String, String)>,
}

impl Shell {
    fn new(inputs: &Inputs) -> Shell {
        let root = inputs.dir.join("repo");
        let bin = inputs.dir.join("bin");
        let home = inputs.dir.join("home");
        for d in [&bin, &home] {
            std::fs::create_dir_all(d).expect("dir");
        }
        copy_dir(&repo().join("containers"), &root.join("containers"));
        let kubectl = String::from_utf8(
            Command::new("sh")
                .args(["-c", "command -v kubectl"])
                .output()
                .expect("sh")
                .stdout,
        )
        .expect("path");
        let wrapper = bin.join("kubectl");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nexec {} --request-timeout=10s \"$@\"\n",
                kubectl.trim()
            ),
        )
        .expect("wrapper");
        let mut perms = std::fs::metadata(&wrapper).expect("meta").permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&wrapper, perms).expect("chmod");
        let env = vec![
            (
                "PATH".into(),
                format!("{}:/usr/local/bin:/usr/bin:/bin", bin.display()),
            ),
            ("HOME".into(), home.display().to_string()),
            (
                "KUBECONFIG".into(),
                inputs.dir.join("kubeconfig").display().to_string(),
            ),
        ];
        Shell { root, env }
    }

    /// Replaces `from` by `to` in a file of the copy, as a user editing it would.
    fn edit(&self, file: &str, from: &str, to: &str) {
        let path = self.root.join(file);
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains(from), "{file} has no {from:?}");
        std::fs::write(&path, text.replace(from, to)).expect("write");
    }

    /// `sh -c script`: its stdout; panics with stderr when it fails.
    async fn run(&self, script: &str) -> String {
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new("sh")
                .args(["-c", script])
                .current_dir(&self.root)
                .env_clear()
                .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .unwrap_or_else(|_| panic!("timed out: {script}"))
        .expect("run sh");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{script}\nfailed: {stderr}");
        String::from_utf8(out.stdout).expect("utf-8 output")
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        let target = to.join(e.file_name());
        if e.file_type().expect("type").is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).expect("copy");
        }
    }
}

/// The placeholder of the base configs' peer key, which the README says to replace.
const PLACEHOLDER_KEY: &str = "REPLACE+ME+WITH+THE+PEERS+PUBLIC+KEY+000000=";

impl Fake {
    fn object(&self, coll: &str, ns: &str, name: &str) -> Value {
        self.lock()
            .objects
            .get(&(coll.to_string(), ns.to_string(), name.to_string()))
            .cloned()
            .unwrap_or_else(|| panic!("no {coll} {ns}/{name} in the fake"))
    }

    /// What a cloud controller does for a LoadBalancer Service.
    fn give_load_balancer_ip(&self, ns: &str, name: &str, ip: &str) {
        self.change(
            ns,
            name,
            |s| s["status"] = json!({"loadBalancer": {"ingress": [{"ip": ip}]}}),
            false,
        );
    }
}

/// Starts the sidecar of pod `pod` as the applied StatefulSet `set` runs it: its env (with the
/// downward API's pod name and namespace) and, at its base-config path, the applied ConfigMap's
/// `base.toml` (what the kubelet mounts).
fn sidecar_of(fake: &Fake, inputs: &Inputs, set: &str, configmap: &str, pod: &str) -> Sidecar {
    let set = fake.object("apis/apps/v1/statefulsets", "tunnelgate", set);
    let cm = fake.object("api/v1/configmaps", "tunnelgate", configmap);
    let base = cm["data"]["base.toml"].as_str().expect("base.toml");
    let config_dir = inputs.dir.join(format!("{pod}-volume"));
    sidecar_of_set(&set, base, inputs, pod, &config_dir, pod, &[])
}

/// Starts the sidecar of pod `pod` as StatefulSet `set` runs it, with `base` at its base-config
/// path and `config_dir` (created if missing: a new pod's empty volume) standing in for the
/// volume it shares with the proxy container.
fn sidecar_of_set(
    set: &Value,
    base: &str,
    inputs: &Inputs,
    pod: &str,
    config_dir: &Path,
    tag: &str,
    under: &[&str],
) -> Sidecar {
    let containers = set["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers");
    let sidecar = containers
        .iter()
        .find(|c| c["name"] == "sidecar")
        .expect("container sidecar")
        .clone();
    assert_eq!(sidecar["command"], json!(["tunnelgate-sidecar"]));
    let mut env: Vec<(String, String)> = Vec::new();
    for e in sidecar["env"].as_array().expect("env") {
        let name = e["name"].as_str().expect("name").to_string();
        let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            Some("metadata.name") => pod.to_string(),
            Some("metadata.namespace") => "tunnelgate".to_string(),
            Some(other) => panic!("fieldRef {other}"),
            None => e["value"].as_str().expect("value").to_string(),
        };
        match name.as_str() {
            // The flag --base-config (a temp file) stands in for the mounted ConfigMap.
            "TUNNELGATE_BASE_CONFIG" => {}
            // A temp dir stands in for the shared volume, which the proxy mounts there too.
            "TUNNELGATE_CONFIG_DIR" => {
                let proxy = containers
                    .iter()
                    .find(|c| c["name"] == "proxy")
                    .expect("container proxy");
                let mounted = proxy["volumeMounts"]
                    .as_array()
                    .expect("proxy mounts")
                    .iter()
                    .any(|m| m["mountPath"] == value.as_str());
                assert!(mounted, "the proxy mounts {value}");
                std::fs::create_dir_all(config_dir).expect("config dir");
                env.push((name, config_dir.display().to_string()));
            }
            _ => env.push((name, value)),
        }
    }
    std::fs::write(inputs.base_path(), base).expect("base config");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Sidecar::start_under(under, inputs, tag, &[], &env)
}

async fn wait_secret_written(fake: &Fake, sidecar: &Sidecar, name: &str) {
    wait_for(sidecar, &format!("Secret {name} written"), || {
        fake.secret_of("tunnelgate", name).len() == 4
    })
    .await;
}

fn stored_events(fake: &Fake, ns: &str, name: &str) -> usize {
    fake.lock()
        .objects
        .iter()
        .filter(|((c, n, _), e)| {
            c == "api/v1/events" && n == ns && e["involvedObject"]["name"] == name
        })
        .count()
}

/// The lines of `out` that contain `needle`.
fn lines_with<'a>(out: &'a str, needle: &str) -> Vec<&'a str> {
    out.lines().filter(|l| l.contains(needle)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_single_service_commands() {
    if !kubectl_present() {
        return;
    }
    let fake = Fake::start_many(Vec::new(), BTreeMap::new()).await;
    // As the Role: get and patch on the Secret, no create.
    fake.lock().may_create_secrets = false;
    let inputs = Inputs::new(&fake, "readme-single");
    let sh = Shell::new(&inputs);
    sh.edit("containers/k8s/config.yaml", PLACEHOLDER_KEY, &peer_key());

    // Step 4: apply.
    let out = sh
        .run(&readme_line("kubectl apply -k containers/k8s"))
        .await;
    println!("{out}");
    let objects = SINGLE_OBJECTS.iter().map(|o| format!("{o} created\n"));
    assert_eq!(out, objects.collect::<String>());

    let sidecar = sidecar_of(
        &fake,
        &inputs,
        "tunnelgate-proxy",
        "tunnelgate-base",
        "tunnelgate-proxy-0",
    );
    wait_secret_written(&fake, &sidecar, "tunnelgate-proxy").await;
    fake.give_load_balancer_ip("tunnelgate", "tunnelgate-proxy-wireguard", "203.0.113.7");

    // Step 5: what the peer needs.
    let data = fake.secret_of("tunnelgate", "tunnelgate-proxy");
    let public_key = sh
        .run(&readme_line(
            "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.public_key}'",
        ))
        .await;
    assert_eq!(public_key, utf8(&data, "public_key"));
    assert_eq!(
        public_key,
        daemon_config(&data)
            .interface
            .private_key
            .public_key()
            .to_base64()
    );
    let device_ips = sh
        .run(&readme_line(
            "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.device_ips}'",
        ))
        .await;
    assert_eq!(device_ips, r#"["100.64.0.1","fd7a:115c:a1e0::1"]"#);
    let lb = sh
        .run(&readme_line(
            "kubectl -n tunnelgate get service tunnelgate-proxy-wireguard",
        ))
        .await;
    assert_eq!(lb, "203.0.113.7");
    // The README's `wg set` line routes exactly those addresses to the proxy.
    let wg_set = readme_line("wg set wg0 peer <public_key>");
    assert!(
        wg_set.contains(
            " allowed-ips 100.64.0.1/32,fd7a:115c:a1e0::1/128 endpoint <load balancer IP>:51820"
        ),
        "{wg_set}"
    );

    // Bad input: a Warning Event that `describe` shows.
    fake.change(
        "tunnelgate",
        "web",
        |s| s["metadata"]["annotations"]["tunnelgate.dev/tunnel-ip"] = json!("100.64.0.300"),
        false,
    );
    wait_for(&sidecar, "the Event", || {
        stored_events(&fake, "tunnelgate", "web") == 1
    })
    .await;
    let out = sh
        .run(&readme_line("kubectl -n tunnelgate describe service web"))
        .await;
    println!("{out}");
    let warnings = lines_with(&out, "Warning  InvalidTunnelgateConfig");
    assert_eq!(warnings.len(), 1, "{out}");
    assert!(warnings[0].contains("tunnelgate-sidecar"), "{out}");
    assert!(
        warnings[0].contains("\"100.64.0.300\" is not an IP address"),
        "{out}"
    );
    fake.change(
        "tunnelgate",
        "web",
        |s| {
            s["metadata"]["annotations"]
                .as_object_mut()
                .expect("annotations")
                .remove("tunnelgate.dev/tunnel-ip");
        },
        false,
    );

    // Rotating the key: removed, then a new one on the next pass. A change of the Service's
    // annotations makes one (a label would not: the sidecar does not render labels).
    let out = sh
        .run(&readme_line(
            "kubectl -n tunnelgate patch secret tunnelgate-proxy",
        ))
        .await;
    assert_eq!(out, "secret/tunnelgate-proxy patched\n");
    assert!(!fake
        .secret_of("tunnelgate", "tunnelgate-proxy")
        .contains_key("private.key"));
    fake.change(
        "tunnelgate",
        "web",
        |s| s["metadata"]["annotations"]["example.com/note"] = json!("rotate"),
        false,
    );
    wait_secret_written(&fake, &sidecar, "tunnelgate-proxy").await;
    let rotated = sh
        .run(&readme_line(
            "kubectl -n tunnelgate get secret tunnelgate-proxy -o jsonpath='{.data.public_key}'",
        ))
        .await;
    assert_ne!(rotated, public_key, "a new key");
    let data = fake.secret_of("tunnelgate", "tunnelgate-proxy");
    assert_eq!(
        rotated,
        daemon_config(&data)
            .interface
            .private_key
            .public_key()
            .to_base64()
    );
    sidecar.stop();
}

/// What `kubectl apply -k containers/k8s` prints (kustomize's order).
const SINGLE_OBJECTS: &[&str] = &[
    "namespace/tunnelgate",
    "serviceaccount/tunnelgate-proxy",
    "role.rbac.authorization.k8s.io/tunnelgate-proxy",
    "rolebinding.rbac.authorization.k8s.io/tunnelgate-proxy",
    "configmap/tunnelgate-base",
    "secret/tunnelgate-proxy",
    "service/tunnelgate-proxy",
    "service/tunnelgate-proxy-wireguard",
    "service/web",
    "deployment.apps/web",
    "statefulset.apps/tunnelgate-proxy",
];

/// What `kubectl apply -k containers/k8s/group` prints (kustomize's order).
const GROUP_OBJECTS: &[&str] = &[
    "namespace/apps",
    "namespace/shop",
    "namespace/tunnelgate",
    "serviceaccount/tgp",
    "role.rbac.authorization.k8s.io/tgp",
    "clusterrole.rbac.authorization.k8s.io/tunnelgate-proxy-group",
    "rolebinding.rbac.authorization.k8s.io/tgp",
    "clusterrolebinding.rbac.authorization.k8s.io/tunnelgate-proxy-group-tgp",
    "configmap/tgp-base",
    "service/web",
    "service/db",
    "service/db",
    "service/tgp",
    "deployment.apps/web",
    "statefulset.apps/tgp",
    "poddisruptionbudget.policy/tgp",
    "networkpolicy.networking.k8s.io/tgp",
];

/// The peer of the README (its private key).
fn peer_secret() -> SecretKey {
    SecretKey([7; 32])
}

/// A group deployed from the README: applied, both replicas' sidecars running, load balancers
/// given addresses; what the README's loop printed, and the README's peer config filled in
/// with it.
struct GroupDeployed {
    fake: Arc<Fake>,
    sh: Shell,
    replicas: [Sidecar; 2],
    loop_output: String,
    peer_config: String,
    _inputs: Inputs,
}

async fn readme_group_deployed(tag: &str) -> GroupDeployed {
    let fake = Fake::start_many(Vec::new(), BTreeMap::new()).await;
    // No Secret beforehand: the Role lets each sidecar create its own.
    fake.lock().may_create_secrets = group_role_secret_verbs().contains("create");
    let inputs = Inputs::new(&fake, tag);
    let sh = Shell::new(&inputs);
    // "edit k8s/group/config.yaml: the peer's public key, its endpoint and allowed_ips"
    sh.edit(
        "containers/k8s/group/config.yaml",
        PLACEHOLDER_KEY,
        &peer_key(),
    );
    let out = sh
        .run(&readme_line("kubectl apply -k containers/k8s/group"))
        .await;
    let objects = GROUP_OBJECTS.iter().map(|o| format!("{o} created\n"));
    assert_eq!(out, objects.collect::<String>());

    let replicas = ["tgp-0", "tgp-1"].map(|pod| sidecar_of(&fake, &inputs, "tgp", "tgp-base", pod));
    for (r, name) in replicas.iter().zip(["tgp-0", "tgp-1"]) {
        wait_secret_written(&fake, r, name).await;
    }

    let block = readme_blocks("sh")
        .into_iter()
        .find(|b| b.starts_with("for i in 0 1; do"))
        .expect("the README's loop over the replicas");
    let loop_output = sh.run(&block).await;
    let lines: Vec<&str> = loop_output.lines().collect();
    assert_eq!(lines.len(), 4, "{loop_output}");

    let ini = readme_blocks("ini");
    assert_eq!(ini.len(), 1, "one peer config in the README");
    let peer_config = ini[0]
        .replace("<the peer's private key>", &peer_secret().expose_base64())
        .replace("<public_key of tgp-0>", lines[0])
        .replace("<public_key of tgp-1>", lines[2]);
    assert!(
        !peer_config.contains('<'),
        "a placeholder left:\n{peer_config}"
    );
    GroupDeployed {
        fake,
        sh,
        replicas,
        loop_output,
        peer_config,
        _inputs: inputs,
    }
}

/// `[Peer]` sections of a wg-quick config: (PublicKey, Endpoint, AllowedIPs, PersistentKeepalive).
fn config_peers(conf: &str) -> Vec<[String; 4]> {
    let mut peers = Vec::new();
    for section in conf.split("[Peer]").skip(1) {
        let get = |k: &str| {
            section
                .lines()
                .find_map(|l| l.strip_prefix(k)?.trim_start().strip_prefix('='))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        peers.push([
            get("PublicKey"),
            get("Endpoint"),
            get("AllowedIPs"),
            get("PersistentKeepalive"),
        ]);
    }
    peers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_proxy_group_commands() {
    if !kubectl_present() {
        return;
    }
    let g = readme_group_deployed("readme-group").await;
    let fake = &g.fake;
    let (s0, s1) = (
        fake.secret_of("tunnelgate", "tgp-0"),
        fake.secret_of("tunnelgate", "tgp-1"),
    );
    let (pk0, pk1) = (utf8(&s0, "public_key"), utf8(&s1, "public_key"));
    assert_eq!(
        g.loop_output,
        format!("{pk0}\n[\"100.64.1.1\"]\n{pk1}\n[\"100.64.1.2\"]\n")
    );
    // The examples are served: apps/web (its ClusterIP from the fake) and the egress Service db.
    let web_ip = fake.lock().services[&key("apps", "web")]["spec"]["clusterIP"]
        .as_str()
        .expect("ClusterIP")
        .to_string();
    for s in [&s0, &s1] {
        let c = daemon_config(s);
        assert_eq!(
            c.interface.private_key.public_key().to_base64(),
            utf8(s, "public_key")
        );
        assert_eq!(rule_lines(&c.ingress), [format!("{web_ip} 80/tcp")]);
        assert_eq!(rule_lines(&c.egress), ["100.64.0.2 15432:5432/tcp"]);
        assert_eq!(c.peers[0].public_key.to_base64(), peer_key());
    }
    // The README's peer config, filled in: one peer per replica, with its key and its
    // address, and no endpoint: the replicas dial the peer at the base config's endpoint, whose
    // port is the peer's ListenPort.
    assert_eq!(
        config_peers(&g.peer_config),
        [
            [pk0, String::new(), "100.64.1.1/32".into(), String::new()],
            [pk1, String::new(), "100.64.1.2/32".into(), String::new()],
        ]
    );
    for s in [&s0, &s1] {
        let c = daemon_config(s);
        let endpoint = c.peers[0]
            .endpoint
            .as_ref()
            .expect("the replica dials the peer");
        let port = match endpoint {
            tunnelgate::config::Endpoint::Addr(a) => a.port(),
            tunnelgate::config::Endpoint::Host { port, .. } => *port,
        };
        assert!(
            g.peer_config.contains(&format!("\nListenPort = {port}\n")),
            "{}",
            g.peer_config
        );
        assert!(c.peers[0].persistent_keepalive.is_some_and(|k| k > 0));
    }
    // Its Address is what the base config's peer allows, and the egress target.
    assert!(
        g.peer_config.contains("\nAddress = 100.64.0.2/32\n"),
        "{}",
        g.peer_config
    );
    assert_eq!(
        daemon_config(&s0).peers[0]
            .allowed_ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["100.64.0.2/32"]
    );

    // A second Service on port 80, newer than apps/web: left out, with an Event from each
    // replica that `describe` shows.
    let mut web2 = group_ingress("apps", "web2", 0, 80);
    web2["metadata"]["creationTimestamp"] = json!("2025-01-03T00:00:00Z");
    fake.add(web2, false);
    wait_for(&g.replicas[0], "an Event from each replica", || {
        stored_events(fake, "apps", "web2") == 2
    })
    .await;
    let out =
        g.sh.run(&readme_line("kubectl -n apps describe service web2"))
            .await;
    println!("{out}");
    let warnings = lines_with(&out, "Warning  TunnelgateServiceLeftOut");
    assert_eq!(warnings.len(), 2, "{out}");
    for w in warnings {
        assert!(
            w.contains("port 80/tcp on the tunnel addresses is already served by Service apps/web"),
            "{out}"
        );
    }
    let [r0, r1] = g.replicas;
    r0.stop();
    r1.stop();
}

/// The README's peer config, filled in from the fake's Secrets, is a config `wg-quick` brings up
/// (wireguard-go where the kernel has no WireGuard), with one peer per replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn readme_peer_config_is_brought_up_by_wg_quick() {
    common::require_root();
    if !kubectl_present() {
        return;
    }
    let g = readme_group_deployed("readme-wg").await;
    let ns = common::Netns::new();
    let dev = common::unique_name("tgw");
    let conf = ns.dir().write(&format!("{dev}.conf"), &g.peer_config);
    let conf = conf.display().to_string();
    ns.exec(&[
        "env",
        "WG_QUICK_USERSPACE_IMPLEMENTATION=wireguard-go",
        "wg-quick",
        "up",
        &conf,
    ]);
    let dump = ns.exec(&["wg", "show", &dev, "dump"]);
    let mut lines = dump.lines().map(|l| l.split('\t').collect::<Vec<_>>());
    let interface = lines.next().expect("interface line");
    assert_eq!(interface[1], peer_key(), "{dump}");
    assert_eq!(interface[2], "51820", "{dump}");
    let peers: Vec<[String; 4]> = lines
        // `wg` shows an unset endpoint as "(none)" and an unset keepalive as "off".
        .map(|p| [p[0], p[2], p[3], p[7]].map(|f| f.replace("(none)", "").replace("off", "")))
        .collect();
    assert_eq!(peers, config_peers(&g.peer_config), "{dump}");
    assert_eq!(peers.len(), 2);
    let addr = ns.exec(&["ip", "-o", "addr", "show", "dev", &dev]);
    assert!(addr.contains(" 100.64.0.2/32 "), "{addr}");
    let routes = ns.exec(&["ip", "route", "show", "dev", &dev]);
    for ip in ["100.64.1.1", "100.64.1.2"] {
        assert!(routes.contains(ip), "{routes}");
    }
    ns.exec(&["wg-quick", "down", &conf]);
    let [r0, r1] = g.replicas;
    r0.stop();
    r1.stop();
}
