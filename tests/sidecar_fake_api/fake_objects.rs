//! What the fake API server serves: discovery, object paths, metadata, watch lines, Secrets and replies.

use super::*;

/// The real API server's Secret limit: 1 MiB of decoded data.
pub(crate) const SECRET_LIMIT: usize = 1_048_576;

/// The kinds the fake knows: (group/version path, resource, kind, namespaced). Enough for
/// `kubectl apply -k` of both examples, `get`, `describe service` and `patch secret`.
pub(crate) const RESOURCES: &[(&str, &str, &str, bool)] = &[
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
pub(crate) fn group_version(gv_path: &str) -> &str {
    gv_path
        .strip_prefix("apis/")
        .unwrap_or_else(|| gv_path.trim_start_matches("api/"))
}

/// What kubectl asks before anything else: the version, the resource lists (the plain ones, as
/// an API server older than aggregated discovery answers), and the OpenAPI v3 documents, only as
/// far as kubectl reads them: that PATCH takes `fieldValidation`, so validation is left to the
/// server (which the fake does not do: the schemas are checked by `sidecar_manifests`).
pub(crate) fn discovery(path: &str) -> Option<Value> {
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
pub(crate) fn object_path<'a>(segments: &[&'a str]) -> Option<(String, &'a str, Option<&'a str>)> {
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
pub(crate) fn created_metadata(obj: &mut Value, ns: &str, name: &str, rv: &str) {
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
pub(crate) fn unescape(s: &str) -> String {
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
pub(crate) fn field_selected(obj: &Value, selector: &str) -> bool {
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
    pub(crate) fn object(
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

pub(crate) fn obj_key(v: &Value) -> Key {
    key(
        v["metadata"]["namespace"].as_str().unwrap_or_default(),
        v["metadata"]["name"].as_str().unwrap_or_default(),
    )
}

pub(crate) fn param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

pub(crate) fn service_rv(svc: &Value) -> u64 {
    svc["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

pub(crate) fn watch_line(svc: &Value) -> Bytes {
    let mut line = json!({"type": "MODIFIED", "object": svc}).to_string();
    line.push('\n');
    Bytes::from(line)
}

pub(crate) fn secret_json(
    ns: &str,
    name: &str,
    data: &BTreeMap<String, Vec<u8>>,
    rv: u64,
) -> Value {
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

pub(crate) fn reply(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed_unsync())
        .expect("response")
}

pub(crate) fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let v = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    reply(code, &v)
}
