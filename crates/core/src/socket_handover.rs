//! Whether a starting instance may take over the local socket path of an interface (its UAPI
//! or status socket) that another process holds: claim it, remove a dead process's stale file,
//! wait for a holder that is going away, or refuse a live one. Pure: the shell probes the path
//! and the interface and passes in how long it has waited.
//!
//! Why waiting is needed: `ip link del wg1` followed at once by a new `tunnelgate-wg wg1` (as
//! WireGuard's own netns test and wg-quick restarts do) can run before the old instance has
//! noticed its device is gone and closed its socket. A holder whose interface no longer exists
//! in this network namespace is on its way out (or serves a namespace of its own, and is still
//! there after the wait, so it is refused then).

use std::time::Duration;

/// How long a starting instance waits for a holder that is going away.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(1);
/// How often the path is probed again while waiting.
pub const HANDOVER_POLL: Duration = Duration::from_millis(10);

/// What a `connect(2)` to the socket path found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketState {
    /// No file at the path.
    Absent,
    /// A socket file nothing listens on: its process died or has closed it.
    Refused,
    /// A process accepted the connection: it still serves the path.
    Answers,
}

/// Whether the interface the socket is named after exists in this network namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterfaceHere {
    Present,
    Absent,
    /// The path belongs to no interface (nothing to check): no sign the holder is going away.
    NotApplicable,
}

/// Why a holder is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It answers and its interface exists here: a live instance.
    LiveHere,
    /// It still answers after [`HANDOVER_WAIT`] although its interface is not here: it serves
    /// another network namespace (the socket folder is shared by all of them).
    LiveElsewhere,
    /// It answers and there is no interface to tell whether it is going away.
    Live,
}

/// The next step of a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The path is free: publish our socket.
    Claim,
    /// Remove the stale file, then publish.
    RemoveStale,
    /// Probe again after [`HANDOVER_POLL`].
    Wait,
    Refuse(Refusal),
}

/// Decides from one probe of the path, the interface check, and how long this claim has
/// waited so far (`waited`, out of `limit`, normally [`HANDOVER_WAIT`]).
pub fn decide(
    state: SocketState,
    interface: InterfaceHere,
    waited: Duration,
    limit: Duration,
) -> Step {
    match (state, interface) {
        (SocketState::Absent, _) => Step::Claim,
        (SocketState::Refused, _) => Step::RemoveStale,
        (SocketState::Answers, InterfaceHere::Present) => Step::Refuse(Refusal::LiveHere),
        (SocketState::Answers, InterfaceHere::NotApplicable) => Step::Refuse(Refusal::Live),
        (SocketState::Answers, InterfaceHere::Absent) if waited < limit => Step::Wait,
        (SocketState::Answers, InterfaceHere::Absent) => Step::Refuse(Refusal::LiveElsewhere),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_free_path_is_claimed_at_once_whatever_the_interface() {
        for iface in [
            InterfaceHere::Present,
            InterfaceHere::Absent,
            InterfaceHere::NotApplicable,
        ] {
            assert_eq!(
                decide(SocketState::Absent, iface, Duration::ZERO, HANDOVER_WAIT),
                Step::Claim
            );
        }
    }

    #[test]
    fn a_socket_nothing_listens_on_is_stale_and_removed() {
        // A dead process's file, or one whose holder has closed but not yet unlinked it.
        for iface in [
            InterfaceHere::Present,
            InterfaceHere::Absent,
            InterfaceHere::NotApplicable,
        ] {
            assert_eq!(
                decide(SocketState::Refused, iface, Duration::ZERO, HANDOVER_WAIT),
                Step::RemoveStale
            );
        }
    }

    #[test]
    fn a_live_holder_with_its_interface_here_is_refused_without_waiting() {
        assert_eq!(
            decide(
                SocketState::Answers,
                InterfaceHere::Present,
                Duration::ZERO,
                HANDOVER_WAIT
            ),
            Step::Refuse(Refusal::LiveHere)
        );
    }

    #[test]
    fn a_holder_whose_interface_is_gone_is_waited_for_up_to_the_limit() {
        assert_eq!(
            decide(
                SocketState::Answers,
                InterfaceHere::Absent,
                Duration::ZERO,
                HANDOVER_WAIT
            ),
            Step::Wait
        );
        assert_eq!(
            decide(
                SocketState::Answers,
                InterfaceHere::Absent,
                999 * MS,
                HANDOVER_WAIT
            ),
            Step::Wait
        );
        assert_eq!(
            decide(
                SocketState::Answers,
                InterfaceHere::Absent,
                HANDOVER_WAIT,
                HANDOVER_WAIT
            ),
            Step::Refuse(Refusal::LiveElsewhere)
        );
    }

    #[test]
    fn a_holder_of_a_path_without_an_interface_is_refused_at_once() {
        assert_eq!(
            decide(
                SocketState::Answers,
                InterfaceHere::NotApplicable,
                Duration::ZERO,
                HANDOVER_WAIT
            ),
            Step::Refuse(Refusal::Live)
        );
    }

    #[test]
    fn the_wait_is_about_a_second_and_polled_often() {
        assert!(
            HANDOVER_WAIT >= Duration::from_millis(500) && HANDOVER_WAIT <= Duration::from_secs(2)
        );
        assert!(HANDOVER_POLL * 20 <= HANDOVER_WAIT);
    }

    fn any_state() -> impl Strategy<Value = SocketState> {
        prop_oneof![
            Just(SocketState::Absent),
            Just(SocketState::Refused),
            Just(SocketState::Answers)
        ]
    }

    fn any_interface() -> impl Strategy<Value = InterfaceHere> {
        prop_oneof![
            Just(InterfaceHere::Present),
            Just(InterfaceHere::Absent),
            Just(InterfaceHere::NotApplicable)
        ]
    }

    proptest! {
        /// Nothing that still answers is ever taken over, and waiting always ends by the limit.
        #[test]
        fn never_takes_a_live_socket_and_never_waits_past_the_limit(
            state in any_state(),
            iface in any_interface(),
            waited_ms in 0u64..5000,
            limit_ms in 0u64..5000,
        ) {
            let (waited, limit) = (Duration::from_millis(waited_ms), Duration::from_millis(limit_ms));
            let step = decide(state, iface, waited, limit);
            if state == SocketState::Answers {
                prop_assert!(matches!(step, Step::Wait | Step::Refuse(_)), "{step:?}");
            }
            if waited >= limit {
                prop_assert_ne!(step, Step::Wait);
            }
            if step == Step::Wait {
                prop_assert_eq!(iface, InterfaceHere::Absent);
            }
        }
    }
}
