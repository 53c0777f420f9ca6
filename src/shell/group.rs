//! The group's endpoint exchange on the wire (`core::group_exchange` seals, opens and decides):
//! a UDP socket on `takeover.group_listen`, the replicas found by resolving
//! `takeover.group_replicas` (a StatefulSet's headless Service name) every few seconds, the
//! news of this replica's peers sent to each of them, a hello to each replica that appears (it
//! answers with every endpoint it knows), and what the others tell handed to the data plane as
//! endpoints a takeover may go to. A task of the daemon's: its end is the daemon's fatal error.

use crate::config::{Endpoint, GroupExchange, PublicKey};
use crate::core::group_exchange::{Entry, Exchange, Kind, Refusal, MAX_DATAGRAM};
use crate::core::takeover::{Learned, Origin};
use crate::shell::dataplane::Dataplane;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How often the replicas' name is resolved again.
const RESOLVE_EVERY: Duration = Duration::from_secs(5);
/// A lookup that takes longer is given up (the next one comes at `RESOLVE_EVERY`).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Datagrams opened per second at most: a flood of garbage to the port costs a decryption each
/// (a replica group sends a few a second).
const OPENS_PER_SECOND: u64 = 20_000;

/// What the exchange counted, for status and metrics.
#[derive(Debug, Default)]
pub struct GroupStats {
    pub accepted: AtomicU64,
    pub endpoints_learned: AtomicU64,
    pub sent: AtomicU64,
    pub replicas: AtomicU64,
    refused: [AtomicU64; Refusal::ALL.len()],
    /// Datagrams dropped unopened past `OPENS_PER_SECOND`.
    pub over_rate: AtomicU64,
    /// Hellos from an address the group's name does not give: not answered.
    pub unknown_replica: AtomicU64,
}

impl GroupStats {
    fn refused(&self, why: Refusal) {
        let at = Refusal::ALL.iter().position(|r| *r == why).unwrap_or(0);
        self.refused[at].fetch_add(1, Ordering::Relaxed);
    }

    /// Refusals by reason.
    pub fn refusals(&self) -> Vec<(&'static str, u64)> {
        Refusal::ALL
            .iter()
            .zip(&self.refused)
            .map(|(r, n)| (r.name(), n.load(Ordering::Relaxed)))
            .collect()
    }
}

/// The exchange as the daemon holds it: where to tell news, and what it counted. Its task's
/// end (it never ends unless it fails) is recorded in the process's fatal record.
pub struct Group {
    news: mpsc::Sender<Vec<Entry>>,
    pub stats: Arc<GroupStats>,
    task: tokio::task::JoinHandle<()>,
}

impl Group {
    /// Binds `settings.listen` and starts the exchange for the identity the data plane has.
    pub async fn start(
        settings: &GroupExchange,
        dataplane: Arc<Dataplane>,
        fatals: crate::shell::fatal::Fatals,
    ) -> anyhow::Result<Group> {
        let identity = dataplane.identity();
        let Some(private) = identity.private_key else {
            anyhow::bail!("takeover.group_listen needs the interface's private key");
        };
        let socket = tokio::net::UdpSocket::bind(settings.listen)
            .await
            .map_err(|e| anyhow::anyhow!("takeover.group_listen {}: {e}", settings.listen))?;
        let sender = {
            use rand_core::RngCore as _;
            rand_core::OsRng.next_u64()
        };
        let exchange = Exchange::new(&private, sender);
        let stats = Arc::new(GroupStats::default());
        let (tx, rx) = mpsc::channel(64);
        tracing::info!(
            listen = %settings.listen,
            replicas = %settings.replicas,
            "Group endpoint exchange up: replicas of this identity tell each other where peers authenticated"
        );
        let run = run(
            socket,
            exchange,
            settings.replicas.clone(),
            dataplane,
            stats.clone(),
            rx,
        );
        let task = tokio::spawn(async move {
            let part = crate::shell::fatal::Part::GroupExchange;
            let ended = crate::shell::fatal::guarded(&fatals, part, run).await;
            match ended {
                // A panic is recorded by `guarded`.
                None => {}
                Some(Ok(())) => {
                    fatals.died(format!("{} ended", part.name()));
                }
                Some(Err(e)) => {
                    fatals.died(format!("{} failed: {e:#}", part.name()));
                }
            }
        });
        Ok(Group {
            news: tx,
            stats,
            task,
        })
    }

    /// Tells the other replicas what this one authenticated (`news`: each peer's newest
    /// learned endpoint; those learned from others or a file are not told again).
    pub fn tell(&self, news: &[(PublicKey, Learned)]) {
        let entries: Vec<Entry> = news
            .iter()
            .filter(|(_, l)| l.origin == Origin::Authenticated)
            .map(|(peer, l)| Entry {
                peer: *peer,
                endpoint: l.addr,
            })
            .collect();
        if !entries.is_empty() && self.news.try_send(entries).is_err() {
            tracing::debug!("group exchange busy: news dropped (the next hello's dump has it)");
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn wall_ms() -> u64 {
    crate::shell::clock::wall_now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

async fn run(
    socket: tokio::net::UdpSocket,
    mut exchange: Exchange,
    replicas: Endpoint,
    dataplane: Arc<Dataplane>,
    stats: Arc<GroupStats>,
    mut news: mpsc::Receiver<Vec<Entry>>,
) -> anyhow::Result<()> {
    let mut known: BTreeSet<SocketAddr> = BTreeSet::new();
    let mut resolve = tokio::time::interval(RESOLVE_EVERY);
    resolve.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut identity_check = tokio::time::interval(Duration::from_secs(1));
    identity_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut keyed_for = dataplane.identity().public_key;
    let mut buf = vec![0u8; MAX_DATAGRAM + 1];
    let (mut window_start, mut opened) = (crate::shell::clock::now(), 0u64);
    let mut last_resolve_error = String::new();
    loop {
        tokio::select! {
            _ = identity_check.tick() => {
                // The group's key rotated (a reload, `wg set private-key`): the exchange's key
                // is derived from it, so messages sealed under the old one are refused from now
                // on, and the replicas that run the new key are heard. Say hello again.
                let identity = dataplane.identity();
                if identity.public_key != keyed_for {
                    if let Some(private) = identity.private_key {
                        keyed_for = identity.public_key;
                        let sender = {
                            use rand_core::RngCore as _;
                            rand_core::OsRng.next_u64()
                        };
                        exchange = Exchange::new(&private, sender);
                        tracing::info!("Group endpoint exchange keyed again for the interface's new key");
                        let hello = exchange.seal(Kind::Hello, &[], wall_ms());
                        let to: Vec<SocketAddr> = known.iter().copied().collect();
                        send_all(&socket, &hello, &to, &stats).await;
                    }
                }
            }
            _ = resolve.tick() => {
                match lookup(&replicas).await {
                    Ok(found) => {
                        last_resolve_error.clear();
                        let appeared: Vec<SocketAddr> = found.difference(&known).copied().collect();
                        known = found;
                        stats.replicas.store(known.len() as u64, Ordering::Relaxed);
                        if !appeared.is_empty() {
                            let hello = exchange.seal(Kind::Hello, &[], wall_ms());
                            send_all(&socket, &hello, &appeared, &stats).await;
                        }
                    }
                    Err(e) => {
                        if e != last_resolve_error {
                            tracing::warn!(replicas = %replicas, error = %e, "Group replicas not found; the exchange tells the ones found before");
                            last_resolve_error = e;
                        }
                    }
                }
            }
            Some(entries) = news.recv() => {
                let datagrams = exchange.seal(Kind::News, &entries, wall_ms());
                let to: Vec<SocketAddr> = known.iter().copied().collect();
                send_all(&socket, &datagrams, &to, &stats).await;
            }
            received = socket.recv_from(&mut buf) => {
                let (len, from) = received?;
                // An IPv6 socket hears IPv4 replicas as mapped addresses: compare as the name
                // resolved them.
                let from = SocketAddr::new(from.ip().to_canonical(), from.port());
                let now = crate::shell::clock::now();
                if now.saturating_duration_since(window_start) >= Duration::from_secs(1) {
                    (window_start, opened) = (now, 0);
                }
                if opened >= OPENS_PER_SECOND {
                    stats.over_rate.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                opened += 1;
                match exchange.open(&buf[..len], wall_ms(), now) {
                    Ok(message) => {
                        stats.accepted.fetch_add(1, Ordering::Relaxed);
                        match message.kind {
                            Kind::Hello => {
                                // A dump goes only to an address the group's name gives: a hello
                                // replayed from anywhere else (to a replica that never saw it,
                                // within its minute) must not reflect a dump at a victim.
                                if !known.contains(&from) {
                                    stats.unknown_replica.fetch_add(1, Ordering::Relaxed);
                                } else if exchange.dump_due(message.sender, now) {
                                    let all: Vec<Entry> = dataplane
                                        .learned_endpoints()
                                        .into_iter()
                                        .map(|(peer, endpoint)| Entry { peer, endpoint })
                                        .collect();
                                    let datagrams = exchange.seal(Kind::Dump, &all, wall_ms());
                                    send_all(&socket, &datagrams, &[from], &stats).await;
                                }
                            }
                            Kind::News | Kind::Dump => {
                                // One entry per peer: its newest (a later one for the same peer
                                // in one message wins).
                                let by_peer: BTreeMap<PublicKey, SocketAddr> = message
                                    .entries
                                    .iter()
                                    .map(|e| (e.peer, e.endpoint))
                                    .collect();
                                stats.endpoints_learned.fetch_add(message.entries.len() as u64, Ordering::Relaxed);
                                dataplane.learn_endpoints(by_peer, Origin::Group);
                            }
                        }
                    }
                    Err(why) => {
                        stats.refused(why);
                        if why != Refusal::Own {
                            tracing::debug!(from = %from, reason = why.name(), "Group exchange datagram refused");
                        }
                    }
                }
            }
        }
    }
}

/// Every address `replicas` resolves to, with its port.
async fn lookup(replicas: &Endpoint) -> Result<BTreeSet<SocketAddr>, String> {
    match replicas {
        Endpoint::Addr(a) => Ok(BTreeSet::from([*a])),
        Endpoint::Host { host, port } => {
            let name = format!("{host}:{port}");
            match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(name)).await {
                Ok(Ok(found)) => Ok(found.collect()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {RESOLVE_TIMEOUT:?}")),
            }
        }
    }
}

async fn send_all(
    socket: &tokio::net::UdpSocket,
    datagrams: &[Vec<u8>],
    to: &[SocketAddr],
    stats: &GroupStats,
) {
    for addr in to {
        for d in datagrams {
            match socket.send_to(d, addr).await {
                Ok(_) => {
                    stats.sent.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::debug!(to = %addr, error = %e, "Group exchange send failed");
                }
            }
        }
    }
}
