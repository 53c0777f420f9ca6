//! A Service and base config -> the sidecar's renderer; its output must validate.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tunnelgate::fuzzing::sidecar(data));
