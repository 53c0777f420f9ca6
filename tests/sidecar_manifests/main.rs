//! Checks the example Kubernetes manifests in containers/k8s (one Service) and
//! containers/k8s/group (a proxy group of 2 replicas): every document parses and is valid against
//! the Kubernetes 1.33 OpenAPI schemas (`kubernetes-validate --strict`); the Role grants only what
//! the sidecar needs (the one Secret by name; for the group, each replica's Secret by name and
//! Services cluster-wide); the proxy container has NET_ADMIN, the Secret read-only with mode 0400
//! and probes on the health port the base config listens on; images are not pulled when present;
//! the sidecar has no extra privileges and holds the only API token; the group has a PDB,
//! anti-affinity over nodes, a UDP LoadBalancer per replica and a NetworkPolicy keeping the health
//! port to the nodes and the monitoring namespace; and the base config in the ConfigMap renders,
//! with the example Services, into a configuration the daemon accepts (for each replica);
//! `kubectl kustomize` of each example (what `apply -k` sends) holds exactly the files' objects;
//! one fully qualified image name everywhere, and a registry is one edit of a kustomization;
//! the shared-identity overlay (containers/k8s/group-shared) builds, is valid, puts one UDP
//! balancer with client affinity in front of the ready replicas and renders one key and address;
//! its replicas tell each other where peers authenticated (the base config's group exchange, the
//! headless Service listing starting replicas, the port open to the group's pods only); every
//! proxy keeps its endpoints file on a volume that outlives a container restart; and the UDP
//! balancers keep the peer's own address (externalTrafficPolicy Local).

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use tunnelgate::config::{Config, SecretFiles, SecretKey};
use tunnelgate::sidecar::{api::service_info, render};

const NS: &str = "tunnelgate";

#[path = "../common/mod.rs"]
mod common;
mod group;
mod group_shared;
mod images;
mod kustomize;
mod manifests;
mod schemas;
mod single_service;
mod state;

use common::kubectl_or_skip;
use group::*;
use images::IMAGE_NAME;
use manifests::*;
use schemas::validator_or_skip;
use single_service::*;
