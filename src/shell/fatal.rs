//! The process's one record of why it must end before a stop was asked for
//! ([`core::liveness::Fatal`](crate::core::liveness::Fatal)): the first long-lived part to die,
//! or the interface deleted under it. Every long-lived part reports here (the packet threads
//! through the data plane, the tasks through [`guarded`], the reader spawner from its thread);
//! `/healthz` names what is recorded (through `Dataplane::liveness`), the event loop ends on it,
//! and the composition root (`shell::process`) stops on it and picks the exit code from it. A
//! leaf: it calls nothing of the process.

use crate::core::liveness::Fatal;
use futures::FutureExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tokio::sync::watch;

/// The long-lived parts of the process, by kind: how their deaths are named, and the words of
/// the test hook that makes one panic (`TUNNELGATE_TEST_PANIC`, `shell::test_hooks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// A worker's TUN reader, `tg-tun-rx-N`.
    TunReader,
    /// A worker's UDP reader, `tg-udp-rx-N`.
    UdpReader,
    /// A reader's relay partner, `tg-tun-hN-I` or `tg-udp-hN-I`.
    Partner,
    /// The timer thread, `tg-timers`.
    Timers,
    /// The thread that starts the packet readers where only they may hold `CAP_SYS_NICE`,
    /// `tg-spawner` (only then).
    Spawner,
    /// The UAPI server's task.
    Uapi,
    /// The status socket's task.
    Status,
    /// The health endpoint's task.
    Health,
    /// The task that drives the netlink connection.
    Netlink,
    /// The systemd watchdog's task (only under `WatchdogSec=`: `$WATCHDOG_USEC`).
    Watchdog,
    /// The event loop's task (the control core and its executor).
    EventLoop,
    /// The group's endpoint exchange task (only with `takeover.group_listen`).
    GroupExchange,
}

impl Part {
    /// Every kind of part.
    pub const ALL: [Part; 12] = [
        Part::TunReader,
        Part::UdpReader,
        Part::Partner,
        Part::Timers,
        Part::Spawner,
        Part::Uapi,
        Part::Status,
        Part::Health,
        Part::Netlink,
        Part::Watchdog,
        Part::EventLoop,
        Part::GroupExchange,
    ];

    /// How the log and `/healthz` name a task of this kind (a thread is named by its own
    /// name: `packet thread tg-udp-rx-0`, `reader spawner tg-spawner`).
    pub fn name(self) -> &'static str {
        match self {
            Part::TunReader | Part::UdpReader | Part::Partner | Part::Timers => "packet thread",
            Part::Spawner => "reader spawner tg-spawner",
            Part::Uapi => "UAPI server",
            Part::Status => "status server",
            Part::Health => "health server",
            Part::Netlink => "netlink connection driver",
            Part::Watchdog => "systemd watchdog",
            Part::EventLoop => "event loop",
            Part::GroupExchange => "group endpoint exchange",
        }
    }

    /// Its word in `TUNNELGATE_TEST_PANIC`.
    pub fn word(self) -> &'static str {
        match self {
            Part::TunReader => "tun-rx",
            Part::UdpReader => "udp-rx",
            Part::Partner => "partner",
            Part::Timers => "timers",
            Part::Spawner => "spawner",
            Part::Uapi => "uapi",
            Part::Status => "status",
            Part::Health => "health",
            Part::Netlink => "netlink",
            Part::Watchdog => "watchdog",
            Part::EventLoop => "event-loop",
            Part::GroupExchange => "group",
        }
    }
}

/// The record: empty until a part dies or the interface goes, then the first [`Fatal`] for
/// good. Clones share it.
#[derive(Clone)]
pub struct Fatals(Arc<watch::Sender<Option<Fatal>>>);

impl Default for Fatals {
    fn default() -> Fatals {
        Fatals::new()
    }
}

impl std::fmt::Debug for Fatals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Fatals").field(&self.get()).finish()
    }
}

impl Fatals {
    pub fn new() -> Fatals {
        Fatals(Arc::new(watch::Sender::new(None)))
    }

    /// Records `fatal` if nothing was recorded before, or if it is a death and a deletion was:
    /// a death outranks a deletion (the exit must say it failed). True if it was recorded. A
    /// death is logged at error level, every one (each is a bug, or a failure a supervisor must
    /// hear of); a deletion once, at info (the mode decides at exit whether it was an error).
    pub fn raise(&self, fatal: Fatal) -> bool {
        if let Fatal::Died(why) = &fatal {
            tracing::error!("{why}; stopping");
        }
        self.0.send_if_modified(|slot| {
            let outranks = matches!((&*slot, &fatal), (Some(Fatal::Deleted(_)), Fatal::Died(_)));
            if slot.is_some() && !outranks {
                return false;
            }
            if let Fatal::Deleted(why) = &fatal {
                tracing::info!("{why}; stopping");
            }
            *slot = Some(fatal);
            true
        })
    }

    /// A part's death: `why` names it.
    pub fn died(&self, why: String) -> bool {
        self.raise(Fatal::Died(why))
    }

    /// What was recorded, if anything.
    pub fn get(&self) -> Option<Fatal> {
        self.0.borrow().clone()
    }

    /// Completes once something is recorded, with it.
    pub async fn wait(&self) -> Fatal {
        let mut rx = self.0.subscribe();
        let fatal = match rx.wait_for(Option::is_some).await {
            Ok(fatal) => fatal.clone(),
            // The sender lives in `self`, so it cannot be gone while we borrow it.
            Err(_) => None,
        };
        match fatal {
            Some(fatal) => fatal,
            None => std::future::pending().await,
        }
    }
}

/// What a panic said.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Runs `task`, the long-lived task `part`, to its end: `Some` of what it returned, or `None`
/// when it panicked, which is recorded in `fatals` as the part's death with the panic's
/// message. (Whether a task that returned has died is its caller's call: a server ends at a
/// stop, the netlink driver never should.) Built with the test hooks, `TUNNELGATE_TEST_PANIC`
/// can make it panic.
pub async fn guarded<F: Future>(fatals: &Fatals, part: Part, task: F) -> Option<F::Output> {
    #[cfg(feature = "test-hooks")]
    let task = async move {
        tokio::select! {
            out = task => out,
            never = crate::shell::test_hooks::panic_when_asked(part) => match never {},
        }
    };
    match AssertUnwindSafe(task).catch_unwind().await {
        Ok(out) => Some(out),
        Err(panic) => {
            fatals.died(format!(
                "{} panicked: {}",
                part.name(),
                panic_message(panic.as_ref())
            ));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first reason is kept (every TUN reader sees the device go; the first part to die
    /// is the one to name), except that a death outranks a deletion: a part that dies while
    /// the drop-in stops for its deleted interface still makes the exit a failure.
    #[test]
    fn the_first_is_kept_and_only_a_death_replaces_a_deletion() {
        let fatals = Fatals::new();
        assert_eq!(fatals.get(), None);
        let gone = Fatal::Deleted("TUN device is gone".into());
        assert!(fatals.raise(gone.clone()));
        assert!(!fatals.raise(Fatal::Deleted("TUN device is gone too".into())));
        assert_eq!(fatals.get(), Some(gone));
        assert!(fatals.died("UAPI server failed: x".into()));
        assert!(!fatals.died("status server failed: y".into()));
        assert!(!fatals.raise(Fatal::Deleted("the UAPI socket was removed".into())));
        assert_eq!(
            fatals.get(),
            Some(Fatal::Died("UAPI server failed: x".into()))
        );
        let clone = fatals.clone();
        assert_eq!(clone.get(), fatals.get(), "clones share the record");
    }

    #[test]
    fn every_part_has_its_own_word() {
        let mut words: Vec<_> = Part::ALL.iter().map(|p| p.word()).collect();
        words.sort_unstable();
        words.dedup();
        assert_eq!(words.len(), Part::ALL.len());
    }

    /// A task that panics is recorded as its part's death, with the panic's message, and
    /// `wait` hears of it; one that returns is not a death.
    #[tokio::test]
    async fn a_task_that_panics_is_its_parts_death() {
        let fatals = Fatals::new();
        assert_eq!(guarded(&fatals, Part::Status, async { 7 }).await, Some(7));
        assert_eq!(fatals.get(), None, "a task that returned did not die");
        let waiter = tokio::spawn({
            let fatals = fatals.clone();
            async move { fatals.wait().await }
        });
        let ran = guarded(&fatals, Part::Uapi, async {
            if fatals.get().is_none() {
                panic!("broken on purpose");
            }
        })
        .await;
        assert_eq!(ran, None);
        let heard = tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("wait heard of the death")
            .expect("waiter");
        assert_eq!(
            heard,
            Fatal::Died("UAPI server panicked: broken on purpose".into())
        );
    }
}
