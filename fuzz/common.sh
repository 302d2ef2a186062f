# Sourced by fuzz/run.sh and scripts/fuzz-long.sh: cargo-fuzz on PATH (installed if
# missing), sanitizer flags unlocked on stable, the target list, and each target's
# -max_len (the largest input worth trying: bigger ones only slow the search).

if [[ -n "${CARGO_HOME:-}" ]]; then
    export PATH="$CARGO_HOME/bin:$PATH"
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz (about a minute)" >&2
    cargo install --locked cargo-fuzz@0.13.2
fi
# Sanitizer flags (-Zsanitizer) are nightly-only; RUSTC_BOOTSTRAP lets stable accept them.
export RUSTC_BOOTSTRAP=1

fuzz_sanitizer="${FUZZ_SANITIZER:-address}"

# Targets named on the command line, or every target of the crate.
fuzz_targets() {
    if [[ $# -gt 0 ]]; then
        printf '%s\n' "$@"
    else
        cargo fuzz list
    fi
}

max_len_for() {
    case "$1" in
        desc_decode) echo 512 ;;       # one 400-byte descriptor + steering bytes
        ring_ops) echo 1024 ;;         # ~340 three-byte operations
        lease_table) echo 1024 ;;      # a script of up to 256 operations
        rpc_tagged) echo 2048 ;;
        cuda_setup) echo 4096 ;;       # a ring setup of up to 62 slots
        conn_hello | peer_setup) echo 8192 ;;  # several messages with payloads
        rpc_frame_decode | rpc_value_decode | rpc_json_diff) echo 8192 ;;
        *) echo 4096 ;;
    esac
}
