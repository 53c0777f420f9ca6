//! The fake Kubernetes API server: its state, watches, and the request handler that records every request.

use super::*;

pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

#[derive(Debug, Clone)]
pub(crate) struct Recorded {
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) query: String,
    pub(crate) body: String,
}

impl Recorded {
    pub(crate) fn is_secret_patch(&self) -> bool {
        self.method == Method::PATCH && self.path.ends_with(&format!("/secrets/{SECRET}"))
    }
    pub(crate) fn is_secret_get(&self) -> bool {
        self.method == Method::GET && self.path.ends_with(&format!("/secrets/{SECRET}"))
    }
    pub(crate) fn is_watch(&self) -> bool {
        self.path.ends_with("/services") && self.query.contains("watch=true")
    }
    pub(crate) fn is_event(&self) -> bool {
        self.method == Method::POST && self.path.ends_with("/events")
    }
}

pub(crate) type Key = (String, String);

pub(crate) fn key(ns: &str, name: &str) -> Key {
    (ns.to_string(), name.to_string())
}

/// An open watch: its namespace (`None`: cluster-wide) and field-selected name, if any.
pub(crate) struct Watcher {
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) tx: mpsc::UnboundedSender<Bytes>,
}

impl Watcher {
    pub(crate) fn matches(&self, svc: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| svc["metadata"]["namespace"] == ns)
            && self
                .name
                .as_deref()
                .is_none_or(|n| svc["metadata"]["name"] == n)
    }
}

pub(crate) struct State {
    pub(crate) resource_version: u64,
    pub(crate) services: BTreeMap<Key, Value>,
    /// Absent: the Secret does not exist.
    pub(crate) secrets: BTreeMap<Key, BTreeMap<String, Vec<u8>>>,
    pub(crate) requests: Vec<Recorded>,
    /// How many more Secret patches answer 409 Conflict.
    pub(crate) conflicts: u32,
    /// Whether a patch may create a missing Secret (RBAC `create` on secrets).
    pub(crate) may_create_secrets: bool,
    pub(crate) watchers: Vec<Watcher>,
    /// Every other object (what `kubectl apply` creates, and Events), by collection path (such as
    /// `apis/apps/v1/statefulsets`), namespace (empty: cluster-scoped) and name.
    pub(crate) objects: BTreeMap<(String, String, String), Value>,
    /// The last octet of the next ClusterIP to allocate.
    pub(crate) next_cluster_ip: u8,
    /// The API server's Secret size limit (the decoded values): a larger one is refused with
    /// 422 "Too long", as the real one does.
    pub(crate) secret_limit: usize,
    /// Per Secret, the data keys the sidecar's server-side apply last sent: a key it stops
    /// sending is removed, as server-side apply does for a field its manager no longer applies.
    pub(crate) applied_keys: BTreeMap<Key, BTreeSet<String>>,
    /// Open watches of one Secret each (a `metadata.name` field selector).
    pub(crate) secret_watchers: Vec<(Key, mpsc::UnboundedSender<Bytes>)>,
    /// Per Secret: how many more GETs of it answer 404 though it exists, as a read made just
    /// before another writer's create would (two replicas racing to create it).
    pub(crate) absent_gets: BTreeMap<Key, u32>,
}

impl State {
    pub(crate) fn next_rv(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }

    /// Tells the watches of Secret `k` what became of it (`None`: deleted).
    pub(crate) fn notify_secret(&mut self, k: &Key, rv: u64) {
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

    pub(crate) fn notify(&mut self, kind: &str, svc: &Value) {
        let mut line = json!({"type": kind, "object": svc}).to_string();
        line.push('\n');
        let line = Bytes::from(line);
        self.watchers
            .retain(|w| !w.matches(svc) || w.tx.send(line.clone()).is_ok());
    }
}

pub(crate) struct Fake {
    pub(crate) state: Mutex<State>,
    pub(crate) port: u16,
    pub(crate) tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Fake {
    pub(crate) async fn start(
        service: Value,
        secret: Option<BTreeMap<String, Vec<u8>>>,
    ) -> Arc<Fake> {
        let secrets = secret.map(|d| (key(NS, SECRET), d)).into_iter().collect();
        Fake::start_many(vec![service], secrets).await
    }

    pub(crate) async fn start_many(
        services: Vec<Value>,
        secrets: BTreeMap<Key, BTreeMap<String, Vec<u8>>>,
    ) -> Arc<Fake> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Fake::start_on(listener, services, secrets)
    }

    /// [`Fake::start_many`] on `listener` (one bound in a test's network namespace).
    pub(crate) fn start_on(
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
            absent_gets: BTreeMap::new(),
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

    pub(crate) fn serve(self: &Arc<Self>, listener: TcpListener) {
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
    pub(crate) fn stop(&self) {
        for t in self.tasks.lock().expect("tasks").drain(..) {
            t.abort();
        }
        self.lock().watchers.clear();
    }

    /// The API server comes back on the same port.
    pub(crate) async fn restart(self: &Arc<Self>) {
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .await
            .expect("rebind");
        self.serve(listener);
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("fake state")
    }

    pub(crate) fn requests(&self) -> Vec<Recorded> {
        self.lock().requests.clone()
    }

    pub(crate) fn count(&self, f: impl Fn(&Recorded) -> bool) -> usize {
        self.lock().requests.iter().filter(|r| f(r)).count()
    }

    pub(crate) fn secret(&self) -> BTreeMap<String, Vec<u8>> {
        self.secret_of(NS, SECRET)
    }

    pub(crate) fn secret_of(&self, ns: &str, name: &str) -> BTreeMap<String, Vec<u8>> {
        self.lock()
            .secrets
            .get(&key(ns, name))
            .cloned()
            .unwrap_or_default()
    }

    /// Changes the Service and tells every open watch (a MODIFIED event), unless `quietly`.
    pub(crate) fn change_service(&self, f: impl FnOnce(&mut Value), quietly: bool) {
        self.change(NS, SERVICE, f, quietly);
    }

    pub(crate) fn change(&self, ns: &str, name: &str, f: impl FnOnce(&mut Value), quietly: bool) {
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
    pub(crate) fn add(&self, mut svc: Value, quietly: bool) {
        let mut st = self.lock();
        svc["metadata"]["resourceVersion"] = json!(st.next_rv());
        st.services.insert(obj_key(&svc), svc.clone());
        if !quietly {
            st.notify("ADDED", &svc);
        }
    }

    pub(crate) fn delete(&self, ns: &str, name: &str) {
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
    pub(crate) fn drop_watches(&self) {
        self.lock().watchers.clear();
    }

    /// `kubectl delete secret NS/NAME`.
    pub(crate) fn delete_secret(&self, ns: &str, name: &str) {
        let mut st = self.lock();
        st.secrets.remove(&key(ns, name));
        st.applied_keys.remove(&key(ns, name));
        let rv = st.next_rv().parse().unwrap_or(0);
        st.notify_secret(&key(ns, name), rv);
    }

    /// Someone else changes a key of Secret NS/NAME (`kubectl edit`).
    pub(crate) fn edit_secret(&self, ns: &str, name: &str, k: &str, v: &[u8]) {
        let mut st = self.lock();
        st.secrets
            .get_mut(&key(ns, name))
            .expect("Secret to edit")
            .insert(k.to_string(), v.to_vec());
        let rv = st.next_rv().parse().unwrap_or(0);
        st.notify_secret(&key(ns, name), rv);
    }

    /// Someone else writes Secret NS/NAME whole (`kubectl create`, or `kubectl apply` over an
    /// existing one); its watches are told.
    pub(crate) fn put_secret(&self, ns: &str, name: &str, data: BTreeMap<String, Vec<u8>>) {
        let mut st = self.lock();
        st.secrets.insert(key(ns, name), data);
        let rv = st.next_rv().parse().unwrap_or(0);
        st.notify_secret(&key(ns, name), rv);
    }

    /// Tells every open watch that its resourceVersion is too old (410 Gone), then ends it: the
    /// client must list again.
    pub(crate) fn expire_watches(&self) {
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

    pub(crate) async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
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
                if let Some(n) = st.absent_gets.get_mut(&key(ns, name)).filter(|n| **n > 0) {
                    *n -= 1;
                    return status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("secrets \"{name}\" not found"),
                    );
                }
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
            (&Method::PATCH, ["api", "v1", "namespaces", ns, "secrets", name])
                if content_type == "application/merge-patch+json" =>
            {
                // A JSON merge patch of data keys: null removes a key (whoever wrote it), a
                // string sets it.
                let Some(data) = st.secrets.get_mut(&key(ns, name)) else {
                    return status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("secrets \"{name}\" not found"),
                    );
                };
                let Ok(patch) = serde_json::from_str::<Value>(&body) else {
                    return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
                };
                for (k, v) in patch["data"].as_object().into_iter().flatten() {
                    match v.as_str() {
                        None => {
                            data.remove(k);
                        }
                        Some(text) => {
                            let bytes = base64::Engine::decode(
                                &base64::engine::general_purpose::STANDARD,
                                text,
                            )
                            .unwrap_or_default();
                            data.insert(k.clone(), bytes);
                        }
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
