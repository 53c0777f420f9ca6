//! [`NotifySocket`]: receives sd_notify datagrams the way systemd does.

use std::path::PathBuf;
use std::time::Duration;
use tunnelgate::shell::clock;

use super::*;

/// Receives sd_notify datagrams on a socket the test binds, like systemd does.
pub struct NotifySocket {
    sock: std::os::unix::net::UnixDatagram,
    pub path: PathBuf,
    /// Every datagram received so far, in order.
    pub log: Vec<String>,
}

impl NotifySocket {
    pub fn bind(dir: &TempDir) -> NotifySocket {
        let path = dir.path().join("notify.sock");
        let sock = std::os::unix::net::UnixDatagram::bind(&path).expect("bind the notify socket");
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("read timeout");
        NotifySocket {
            sock,
            path,
            log: vec![],
        }
    }

    /// Waits for a datagram with the line `want` (e.g. `READY=1`); returns the datagram.
    pub fn expect(&mut self, want: &str, timeout: Duration, stderr: impl Fn() -> String) -> String {
        self.wait_for(want, timeout).unwrap_or_else(|| {
            panic!(
                "no {want} within {timeout:?}; received {:?}; daemon stderr:\n{}",
                self.log,
                stderr()
            )
        })
    }

    /// The first datagram with the line `want` within `window`, logging every one read.
    fn wait_for(&mut self, want: &str, window: Duration) -> Option<String> {
        let deadline = clock::now() + window;
        let mut buf = [0u8; 4096];
        while clock::now() < deadline {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                self.log.push(msg.clone());
                if msg.lines().any(|l| l == want) {
                    return Some(msg);
                }
            }
        }
        None
    }
}

impl NotifySocket {
    /// Reads (and logs) what has queued up so far, so what follows is only what comes next.
    pub fn drain(&mut self) {
        let mut buf = [0u8; 4096];
        // Nothing for one read timeout (200 ms): the queue is empty.
        while let Ok(n) = self.sock.recv(&mut buf) {
            self.log
                .push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }

    /// Whether no datagram with the line `want` arrives during `window` (others are logged).
    pub fn quiet(&mut self, want: &str, window: Duration) -> bool {
        self.wait_for(want, window).is_none()
    }
}

impl NotifySocket {
    /// How many datagrams with the line `want` arrive during `window` (all are logged).
    pub fn count(&mut self, want: &str, window: Duration) -> usize {
        let deadline = clock::now() + window;
        let mut buf = [0u8; 4096];
        let mut seen = 0;
        while clock::now() < deadline {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                if msg.lines().any(|l| l == want) {
                    seen += 1;
                }
                self.log.push(msg);
            }
        }
        seen
    }
}
