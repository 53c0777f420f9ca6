//! A TUN read -> offload split, or decrypted packets -> the coalescer and back.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tunnelgate::fuzzing::offload(data));
