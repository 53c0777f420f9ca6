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
//! Proxy group with a shared identity: every replica hands the group's one key to its volume and
//! renders host 1 of the pool, a replica scaled in gets them, no replica's Secret holds the key
//! (an older copy is removed), two replicas racing to create the identity Secret end with one key
//! (the loser's create answered 409 AlreadyExists), a malformed identity Secret is reported on the
//! pod, never overwritten, and used once fixed, and a rotation (edited, or deleted and created)
//! reaches every volume within 2 s while a malformed new key keeps the old one.
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

#[path = "../common/mod.rs"]
mod common;
// The StatefulSet's pod run from the image with podman, against this file's fake (root).
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
use tunnelgate::config::{Config, SecretFiles, SecretKey};
use tunnelgate::shell::clock;

const NS: &str = "tg";
const SERVICE: &str = "web";
const SECRET: &str = "proxy-0";
const WAIT: Duration = Duration::from_secs(20);

mod fake_api;
mod fake_objects;
mod group;
mod group_identity;
mod group_kubectl_scale;
mod group_scale;
mod readme;
mod readme_commands;
mod sidecar;
mod single_service;

use common::kubectl_or_skip;
use fake_api::*;
use fake_objects::*;
use group::*;
use group_kubectl_scale::*;
use readme::*;
use sidecar::*;
