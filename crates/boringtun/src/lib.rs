// Copyright (c) 2019 Cloudflare, Inc. All rights reserved.
// SPDX-License-Identifier: BSD-3-Clause

//! Simple implementation of the client-side of the WireGuard protocol.
//!
//! <code>git clone https://github.com/cloudflare/boringtun.git</code>
//!
//! tunnelgate's fork: the Noise handshake, its timers and the transport sessions, with the
//! sessions shared (`Arc`) so that data messages are sealed and opened outside `Tunn`'s
//! `&mut self`. See FORK.md for every change from upstream 0.7.1.

pub mod noise;

pub(crate) mod sleepyinstant;

/// Re-export of the x25519 types
pub mod x25519 {
    pub use x25519_dalek::{
        EphemeralSecret, PublicKey, ReusableSecret, SharedSecret, StaticSecret,
    };
}

/// The random number generator the handshake draws its ephemeral keys and the rate limiter its
/// cookie secrets from: the caller's (tunnelgate's shell passes the OS's).
pub type Rng = Box<dyn rand_core::CryptoRngCore + Send>;
