//! A datagram -> wg::classify / packet::identify / packet::decapsulate with a fixed key.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tunnelgate::fuzzing::receive(data));
