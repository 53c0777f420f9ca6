//! Two-byte operations -> a transport session under hostile delivery (replays, reordering,
//! counters outside the window, forgeries, rekeys mid-batch, retired sessions).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tunnelgate::fuzzing::session(data));
