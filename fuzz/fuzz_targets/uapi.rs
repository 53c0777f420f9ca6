//! A UAPI request -> uapi::parse_request.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tunnelgate::fuzzing::uapi(data));
