#!/bin/sh
# The long run of crates/nextn/tests/serve_soak.rs: the same clients and the same assertions
# (no failed request, answers equal to the same request alone, /metrics equal to what the clients
# counted, the server's memory flat) for ten minutes instead of one.
#
#   tools/soak.sh [SECONDS] [CLIENTS] [MODEL.gguf]
#
# SECONDS defaults to 600, CLIENTS to 16, MODEL to the bundled tiny model. The summary line
# (answers, dropped streams, tokens, server memory after the warm-up, at the end and at its peak)
# is printed on stderr; the exit status is cargo's.
set -eu
cd "$(dirname "$0")/.."
export NEXTN_SOAK_SECS="${1:-600}"
export NEXTN_SOAK_CLIENTS="${2:-16}"
if [ -n "${3:-}" ]; then
    NEXTN_SOAK_MODEL="$(cd "$(dirname "$3")" && pwd)/$(basename "$3")"
    export NEXTN_SOAK_MODEL
fi
exec cargo test --release -p nextn --test serve_soak -- --nocapture
