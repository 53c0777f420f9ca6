#!/usr/bin/env bash
# Builds every cargo-fuzz target in fuzz/ with libFuzzer's coverage instrumentation and runs each
# for a few seconds, from the committed seeds (fuzz/corpus/<target>/) with its dictionary
# (fuzz/dict/<target>.dict): scripts/fuzz-smoke.sh [--build-only] [SECONDS per target, default 5].
# TUNNELGATE_FUZZ_TARGETS="uapi ports" runs only those. --build-only stops after the build
# (scripts/test.sh runs it in the background beside the netns suites, which mostly wait).
#
# It runs on the stable toolchain. cargo-fuzz itself needs nightly only for -Zsanitizer; the
# coverage that guides libFuzzer (SanitizerCoverage: inline 8-bit counters, PC table, compare
# tracing) is plain `-C passes`/`-C llvm-args`, so this script passes the same flags cargo-fuzz does,
# minus AddressSanitizer. Safe Rust gains little from ASan; the panics, overflows (debug
# assertions are on) and aborts a fuzzer finds here are the ones that matter. For an ASan run:
#   cargo +nightly fuzz run <target> -- -max_total_time=60     (see fuzz/README.md)
# --target is explicit so RUSTFLAGS skip build scripts and proc-macros, as cargo-fuzz does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../fuzz"

build_only=0
if [[ "${1:-}" == "--build-only" ]]; then
    build_only=1
    shift
fi
secs="${1:-${TUNNELGATE_FUZZ_SECS:-5}}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
cargo build --release --target "$triple" --features sidecar --bins
if ((build_only)); then
    exit 0
fi

read -r -a targets <<<"${TUNNELGATE_FUZZ_TARGETS:-config uapi ports receive session offload wg_quick sidecar}"
corpus_root="$(mktemp -d "${TMPDIR:-/tmp}/tunnelgate-fuzz.XXXXXX")"
trap 'rm -rf "$corpus_root"' EXIT
for t in "${targets[@]}"; do
    echo "--- fuzz $t (${secs}s)"
    mkdir -p "$corpus_root/$t"
    # A crash leaves its input in fuzz/artifacts/<target>/ (kept: that is what to replay).
    mkdir -p "artifacts/$t"
    rc=0
    # The committed seeds (corpus/<target>/seed-*) are read but never written: libFuzzer adds
    # what it finds to the first directory only, the temporary one.
    seeds=()
    if [[ -d "corpus/$t" ]]; then seeds=("corpus/$t"); fi
    dict=()
    if [[ -f "dict/$t.dict" ]]; then dict=(-dict="dict/$t.dict"); fi
    "target/$triple/release/$t" "$corpus_root/$t" "${seeds[@]}" "${dict[@]}" \
        -max_total_time="$secs" -rss_limit_mb=2048 \
        -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$corpus_root/$t.log" 2>&1 || rc=$?
    # INITED: the coverage of the seeds alone; DONE: at the end (cov = edges, ft = features).
    grep -E '(INITED|DONE) +cov' "$corpus_root/$t.log" | sed -E 's/^#[0-9]+\t//; s/ +(exec|rss).*//' || true
    grep -E '^(Done|stat::number_of_executed_units|stat::new_units_added)' "$corpus_root/$t.log" || true
    if ((rc != 0)); then
        tail -n 40 "$corpus_root/$t.log" >&2
        echo "fuzz target $t failed (exit $rc): its input is in fuzz/artifacts/$t/" >&2
        exit 1
    fi
done
echo "fuzz smoke: ${#targets[@]} targets ran ${secs}s each without a crash"
