//! A port spec -> PortMap, and its round trip through Display.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tunnelgate::fuzzing::ports(data));
