//! Config TOML text -> Config::parse, and a valid config through the rule renderers.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tunnelgate::fuzzing::config(data));
