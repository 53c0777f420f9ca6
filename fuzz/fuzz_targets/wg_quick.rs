//! wg-quick INI text -> parse_ini and the import to TOML, which must pass Config::parse.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tunnelgate::fuzzing::wg_quick(data));
