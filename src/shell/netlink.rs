//! rtnetlink I/O: bring the TUN link up with its MTU and addresses, and apply route and
//! policy-rule changes computed by `core::routes`. Thin: no decisions here.

use crate::core::routes::{PolicyRule, Route};
use crate::shell::fatal::{guarded, Fatals, Part};
use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleFlags, RuleMessage};
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};
use std::net::IpAddr;

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("cannot open a netlink socket: {0}")]
    Connect(#[source] std::io::Error),
    #[error("no network interface named {0}")]
    NoSuchLink(String),
    #[error("{what}: {source}")]
    Request {
        what: String,
        #[source]
        source: rtnetlink::Error,
    },
}

fn req(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetlinkError {
    let what = what.into();
    move |source| NetlinkError::Request { what, source }
}

/// Whether a netlink error is "already exists" / "not found", which an idempotent apply accepts.
fn errno_is(err: &rtnetlink::Error, code: i32) -> bool {
    match err {
        rtnetlink::Error::NetlinkError(msg) => msg.code.map(|c| c.get()) == Some(-code),
        _ => false,
    }
}

/// A netlink connection and its driver task: the task is owned here and ends with it (the
/// daemon's executor holds it, and the composition root's stop drops the daemon), never left
/// running detached. The driver must run as long as this lives: its panic, or its end before
/// this is dropped, is recorded as its death (`shell::fatal`), and the process stops, exit 1,
/// rather than run on with every later netlink request failing.
pub struct Netlink {
    handle: Handle,
    connection: tokio::task::JoinHandle<()>,
}

impl Drop for Netlink {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

impl Netlink {
    /// Opens a connection; its driver runs on the current tokio runtime until this is dropped
    /// (an abort, not a death), and reports its death to `fatals`.
    pub fn connect(fatals: &Fatals) -> Result<Netlink, NetlinkError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(NetlinkError::Connect)?;
        let fatals = fatals.clone();
        let connection = tokio::spawn(async move {
            if guarded(&fatals, Part::Netlink, conn).await.is_some() {
                fatals.died(format!(
                    "{} ended: the netlink connection closed",
                    Part::Netlink.name()
                ));
            }
        });
        Ok(Netlink { handle, connection })
    }

    pub async fn link_index(&self, name: &str) -> Result<u32, NetlinkError> {
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_string())
            .execute();
        match links.try_next().await {
            Ok(Some(link)) => Ok(link.header.index),
            Ok(None) => Err(NetlinkError::NoSuchLink(name.into())),
            Err(e) if errno_is(&e, libc::ENODEV) => Err(NetlinkError::NoSuchLink(name.into())),
            Err(e) => Err(req(format!("looking up {name}"))(e)),
        }
    }

    /// Sets the MTU and brings the link up.
    pub async fn link_up(&self, index: u32, mtu: u16) -> Result<(), NetlinkError> {
        self.handle
            .link()
            .set(
                LinkUnspec::new_with_index(index)
                    .mtu(mtu.into())
                    .up()
                    .build(),
            )
            .execute()
            .await
            .map_err(req("setting the link up"))
    }

    pub async fn add_address(&self, index: u32, net: IpNet) -> Result<(), NetlinkError> {
        match self
            .handle
            .address()
            .add(index, net.addr(), net.prefix_len())
            .execute()
            .await
        {
            Err(e) if errno_is(&e, libc::EEXIST) => Ok(()),
            r => r.map_err(req(format!("adding address {net}"))),
        }
    }

    /// Removes `net` from the link; an address that is already gone is fine, and so is one
    /// whose link is gone (`ip link del`: its addresses went with it).
    pub async fn del_address(&self, index: u32, net: IpNet) -> Result<(), NetlinkError> {
        let mut found = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .set_address_filter(net.addr())
            .set_prefix_length_filter(net.prefix_len())
            .execute();
        loop {
            let msg = match found.try_next().await {
                Ok(Some(msg)) => msg,
                Ok(None) => break,
                Err(e) if errno_is(&e, libc::ENODEV) => break,
                Err(e) => return Err(req(format!("looking up address {net}"))(e)),
            };
            match self.handle.address().del(msg).execute().await {
                Err(e) if errno_is(&e, libc::EADDRNOTAVAIL) || errno_is(&e, libc::ENODEV) => {}
                r => r.map_err(req(format!("removing address {net}")))?,
            }
        }
        Ok(())
    }

    pub async fn add_route(&self, index: u32, route: &Route) -> Result<(), NetlinkError> {
        let msg = route_message(index, route)?;
        match self.handle.route().add(msg).execute().await {
            // A connected route of the same network (an address with a shorter prefix) exists.
            Err(e) if errno_is(&e, libc::EEXIST) => Ok(()),
            r => r.map_err(req(format!("adding route {}", route.net))),
        }
    }

    /// Removes `route`; one already gone is fine, and so is one whose link is gone (`ip link
    /// del`: the kernel removed its routes with it).
    pub async fn del_route(&self, index: u32, route: &Route) -> Result<(), NetlinkError> {
        let msg = route_message(index, route)?;
        match self.handle.route().del(msg).execute().await {
            Err(e) if errno_is(&e, libc::ESRCH) || errno_is(&e, libc::ENODEV) => Ok(()),
            r => r.map_err(req(format!("removing route {}", route.net))),
        }
    }

    pub async fn add_rule(&self, rule: &PolicyRule) -> Result<(), NetlinkError> {
        let mut request = self.handle.rule().add();
        *request.message_mut() = rule_message(rule);
        match request.execute().await {
            Err(e) if errno_is(&e, libc::EEXIST) => Ok(()),
            r => r.map_err(req(format!("adding policy rule {rule:?}"))),
        }
    }

    pub async fn del_rule(&self, rule: &PolicyRule) -> Result<(), NetlinkError> {
        match self.handle.rule().del(rule_message(rule)).execute().await {
            Err(e) if errno_is(&e, libc::ENOENT) => Ok(()),
            r => r.map_err(req(format!("removing policy rule {rule:?}"))),
        }
    }
}

fn route_message(
    index: u32,
    route: &Route,
) -> Result<rtnetlink::packet_route::route::RouteMessage, NetlinkError> {
    let builder = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(route.net.addr(), route.net.prefix_len())
        .map_err(|e| NetlinkError::Request {
            what: format!("route {}: {e}", route.net),
            source: rtnetlink::Error::RequestFailed,
        })?;
    Ok(builder
        .output_interface(index)
        .table_id(route.table)
        .build())
}

fn rule_message(rule: &PolicyRule) -> RuleMessage {
    let mut msg = RuleMessage::default();
    msg.header.family = if rule.v6 {
        rtnetlink::packet_route::AddressFamily::Inet6
    } else {
        rtnetlink::packet_route::AddressFamily::Inet
    };
    msg.header.action = RuleAction::ToTable;
    msg.attributes.push(RuleAttribute::Priority(rule.priority));
    if rule.table < 256 {
        msg.header.table = rule.table as u8;
    }
    msg.attributes.push(RuleAttribute::Table(rule.table));
    match rule.kind {
        crate::core::routes::RuleKind::NotFwmark(mark) => {
            msg.header.flags = RuleFlags::Invert;
            msg.attributes.push(RuleAttribute::FwMark(mark));
        }
        crate::core::routes::RuleKind::SuppressDefault => {
            msg.attributes.push(RuleAttribute::SuppressPrefixLen(0));
        }
    }
    msg
}
