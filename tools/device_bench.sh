#!/usr/bin/env bash
# One prepared benchmark of the device backend on a machine with a GPU (Vulkan driver installed):
# decode, verify of 2/4/8 rows in decode steps, the draft step, and the measured MTP speedup at
# forced acceptance (0.95, 0.86, 0.75), on synthesized 0.8B and 27B shapes (the 27B one with 16
# trunk layers, so that it is written in minutes; per-layer costs are the real model's), and the
# 35B-A3B shape at 8 layers with its routed experts on the CPU (--n-cpu-moe 4, --cpu-moe). Runs
# well within ten minutes on a current GPU machine.
#
#   tools/device_bench.sh [NEXTN_BINARY] [OUT_DIR]
#
# Writes OUT_DIR/device-*.json (bench --json) and prints the tables on stdout.
set -euo pipefail
bin="${1:-target/release/nextn}"
out="${2:-${OUT:-/tmp}}"
work="$(mktemp -d)"
"$bin" --list-devices
dev="$("$bin" --list-devices | awk -F: '/^  [A-Za-z]/ && !/software/ {gsub(/^ +/, "", $1); print $1; exit}')"
if [ -z "$dev" ]; then
    echo "no hardware GPU listed" >&2
    exit 1
fi
echo "device: $dev"
"$bin" synth --preset 0.8b --type Q4_K_M -o "$work/q08.gguf"
"$bin" synth --preset 27b --layers 16 --type Q4_K_M -o "$work/q27.gguf"
for m in q08 q27; do
    timeout 240 "$bin" bench -m "$work/$m.gguf" -dev "$dev" -n 64 --spec-draft-n-max 0,1,2,3 \
        --force-acceptance 0.95,0.86,0.75 --floor-verify-rows 8 --json "$out/device-$m.json" || true
    timeout 120 "$bin" bench -m "$work/$m.gguf" -dev "$dev" -d 4096 --depth-fill 512 \
        --floor-verify-rows 8 --json "$out/device-$m-depth.json" || true
done
# The 35B-A3B shape (8 trunk layers) with its routed experts in host memory, as the 8-24 GB cards run
# the real model: half of the layers' experts (--n-cpu-moe 4) and all of them (--cpu-moe), plain and
# MTP at forced acceptance.
"$bin" synth --preset 35b-a3b --layers 8 --type Q4_K_M -o "$work/moe8.gguf"
for experts in "--n-cpu-moe 4" "--cpu-moe"; do
    tag="$(echo "$experts" | tr -d ' -')"
    # shellcheck disable=SC2086
    timeout 150 "$bin" bench -m "$work/moe8.gguf" -dev "$dev" $experts -n 32 \
        --spec-draft-n-max 0,1,2,3 --force-acceptance 0.95,0.86,0.75 \
        --json "$out/device-moe8-$tag.json" || true
done
rm -rf "$work"
