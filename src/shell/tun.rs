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
    #[error("cannot create TUN device {name}: {source} (is /dev/net/tun present and CAP_NET_ADMIN held?)")]
    Create {
        name: String,
        #[source]
        source: io::Error,
    },
}

/// Packets the kernel queues for us before dropping (Linux's TUN default is 500). A 1 Gbit/s
/// burst of small UDP packets outruns the reader for a moment while it shares the CPU; 500
/// lost up to 10 % of iperf3's datagrams at 1 Gbit/s offered, 4096 none in the same runs.
/// Senders' socket buffers still bound what can pile up here.
const TX_QUEUE_PACKETS: u32 = 4096;

/// Creates `name`. Refuses to take over an existing interface: a second daemon with the same
/// name must not silently share (and on exit delete) the first one's device.
pub fn create(name: &str, mtu: u16) -> Result<SyncDevice, TunError> {
    if Path::new("/sys/class/net").join(name).exists() {
        return Err(TunError::Exists(name.into()));
    }
    DeviceBuilder::new()
        .name(name)
        .mtu(mtu)
        .offload(true)
        .tx_queue_len(TX_QUEUE_PACKETS)
        .build_sync()
        .map_err(|source| TunError::Create {
            name: name.into(),
            source,
        })
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
