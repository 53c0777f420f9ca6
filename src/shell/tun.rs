//! Creates the TUN device with virtio-net offloads (TSO/USO in, GRO coalescing out), so one
//! read can carry a 64 KB TCP super-packet and one write can deliver many decrypted segments.

use std::io;
use std::path::Path;
use std::time::Duration;
use tun_rs::{DeviceBuilder, SyncDevice};

#[derive(Debug, thiserror::Error)]
pub enum TunError {
    #[error("interface {0} already exists: choose another interface.name, or stop what owns it")]
    Exists(String),
    /// The cause is in the message and deliberately not a `source`: the daemon prints the
    /// whole error chain, which would say it twice.
    #[error("cannot create TUN device {name}: {cause} (is /dev/net/tun present and CAP_NET_ADMIN held?)")]
    Create { name: String, cause: io::Error },
}

/// Creates `name` with one queue. Refuses to take over an existing interface: a second daemon
/// with the same name must not silently share (and on exit delete) the first one's device.
pub fn create(name: &str, mtu: u16, txqueuelen: u32) -> Result<SyncDevice, TunError> {
    let mut queues = create_queues(name, mtu, 1, txqueuelen)?;
    queues.pop().ok_or_else(|| TunError::Create {
        name: name.into(),
        cause: io::Error::other("no queue"),
    })
}

/// Creates `name` with `queues` queues (`IFF_MULTI_QUEUE` when more than one): one per packet
/// worker, with a transmit queue of `txqueuelen` packets (`Tuning::tun_txqueuelen`). The kernel
/// keeps each flow on one queue, and moves a flow to the queue that last wrote its other
/// direction, so a flow's packets stay in order.
pub fn create_queues(
    name: &str,
    mtu: u16,
    queues: usize,
    txqueuelen: u32,
) -> Result<Vec<SyncDevice>, TunError> {
    if Path::new("/sys/class/net").join(name).exists() {
        return Err(TunError::Exists(name.into()));
    }
    let failed = |cause| TunError::Create {
        name: name.into(),
        cause,
    };
    let first = DeviceBuilder::new()
        .name(name)
        .mtu(mtu)
        .offload(true)
        .multi_queue(queues > 1)
        .tx_queue_len(txqueuelen)
        .build_sync()
        .map_err(failed)?;
    let mut all = Vec::with_capacity(queues);
    for _ in 1..queues {
        all.push(first.try_clone().map_err(failed)?);
    }
    all.insert(0, first);
    Ok(all)
}

/// Waits until the (non-blocking) device has a packet to read, or an error to report, or
/// `timeout` has passed: the reader wakes at least that often, so it can stamp its heartbeat
/// and notice a stop request on an idle tunnel.
#[allow(unsafe_code)]
pub fn wait_readable(device: &SyncDevice, timeout: Duration) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut fds = libc::pollfd {
        fd: device.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let timeout_ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd that outlives the call; the descriptor stays open as long as
    // `device` is borrowed.
    if unsafe { libc::poll(&mut fds, 1, timeout_ms) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_create_error_says_its_cause_once() {
        let e = anyhow::Error::new(TunError::Create {
            name: "tg0".into(),
            cause: io::Error::from_raw_os_error(libc::EPERM),
        })
        .context("starting");
        let text = format!("{e:#}");
        assert_eq!(text.matches("Operation not permitted").count(), 1, "{text}");
        assert!(text.contains("cannot create TUN device tg0"), "{text}");
    }
}
