//! What the control core holds for each of 100,000 configured peers, counted by the allocator
//! (a binary of its own, so that no other test allocates meanwhile).

#![allow(unsafe_code)] // a counting global allocator

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use tunnelgate_core::config::{Config, Peer, PublicKey, SecretFiles};
use tunnelgate_core::control::{Action, Control};

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

struct NoFiles;

impl SecretFiles for NoFiles {
    fn read_secret(&self, _: &Path) -> Result<String, String> {
        Err("no files here".into())
    }
}

const PEERS: u32 = 100_000;

/// A concentrator's configuration: `PEERS` peers of one /32 each, random keys.
fn concentrator() -> Config {
    let text = "[interface]\nname = \"tgmem\"\nprivate_key = \
                \"YMa0LSRzrYzKnAVxMMYQvTnJl/zq4DXw1hGcVPpTFm4=\"\naddresses = [\"10.0.0.1/32\"]\n";
    let mut config = match Config::parse(text, Path::new("/etc/tg"), &NoFiles) {
        Ok(config) => config,
        Err(e) => panic!("test config: {e}"),
    };
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    config.peers = (0..PEERS)
        .map(|i| {
            let mut key = [0u8; 32];
            for chunk in key.chunks_mut(8) {
                state = tunnelgate_core::pmap::mix64(state.wrapping_add(0x9e37_79b9_7f4a_7c15));
                chunk.copy_from_slice(&state.to_le_bytes());
            }
            let addr = std::net::Ipv4Addr::from(0x0a40_0000 + i + 2);
            Peer {
                name: None,
                public_key: PublicKey(key),
                preshared_key: None,
                endpoint: None,
                allowed_ips: vec![ipnet::IpNet::V4(ipnet::Ipv4Net::from(addr))],
                persistent_keepalive: None,
            }
        })
        .collect();
    config
}

/// The core's own bytes for each peer once it started and its routes are in: its spec,
/// which the data plane shares, its allowed IP, and the core's indices (by key, by prefix,
/// the routes wanted and applied). It is 266; a second copy of the file's peers (about 180
/// bytes a peer more) fails it, and so do index nodes left half full (362).
#[test]
fn the_control_core_holds_under_320_bytes_a_peer() {
    let before = LIVE.load(Relaxed);
    let config = concentrator();
    #[allow(clippy::disallowed_methods)] // a test's clock: the core only compares it
    let now = std::time::Instant::now();
    let mut control = Control::new(config, 51820, None, now);
    let mut routes = 0;
    while let Some(action) = control.poll_action() {
        if let Action::ApplyRoutes(diff) = action {
            routes += diff.add_routes.len();
            control.handle_routes_applied(Ok(()), now);
        }
    }
    assert_eq!(control.peer_count(), PEERS as usize);
    assert_eq!(routes, PEERS as usize, "a route for each peer");
    let per_peer = (LIVE.load(Relaxed) - before) / PEERS as isize;
    println!("the control core: {per_peer} bytes a peer");
    assert!(per_peer <= 320, "{per_peer} bytes a peer");
}
