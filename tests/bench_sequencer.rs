//! The workers bench's sequencer (`benches/workers/sequencer.rs`, bench-only code kept with the
//! bench) under its tests (`benches/workers/sequencer/tests.rs`): a bench target runs none.

#[allow(unreachable_pub, dead_code)]
#[path = "../benches/workers/sequencer.rs"]
mod sequencer;

use sequencer::*;

#[path = "../benches/workers/sequencer/tests.rs"]
mod tests;
