//! The sidecar's I/O: the kube client, watches, Secret writes and Events ([`api`], [`run`],
//! [`run_group`]) and the proxy's mounted config folder ([`config_dir`]). What to write is
//! decided by the pure [`crate::sidecar`] and [`crate::sidecar::group`].

pub mod api;
pub mod config_dir;
pub mod run;
pub mod run_group;
