#!/usr/bin/env bash
# One prepared benchmark of the device backend on a machine with a GPU (Vulkan driver installed),
# beside llama.cpp's CUDA build on the same synthesized GGUF files: the 0.8B shape (q08), the 27B
# shape with 16 of its 64 trunk layers (q27) and the 35B-A3B shape with 8 of its 40 layers (moe8),
# all Q4_K_M, each synthesized once (per-layer costs are the real models'; minutes to write).
#
#   [LLAMA_CUDA_DIR=DIR|FILE.tar.xz] tools/device_bench.sh [NEXTN_BINARY] [OUT_DIR]
#
# On a GPU machine nothing is built: llama.cpp's package is made beforehand by
# tools/build_llama_cuda.sh. When what is copied to the machine is limited (64 MiB in all, the
# repository's tracked files, about 21 MB, included), nextn's binary (33 MB) goes xz-compressed
# beside the llama.cpp package (about 22 MB); a NEXTN_BINARY ending in .xz is unpacked first:
#   before:  xz -T0 -kf target/release/nextn          (writes target/release/nextn.xz, 8 MB)
#   copy:    target/release/nextn.xz, target/llama-cuda.tar.xz
#   run:     LLAMA_CUDA_DIR=target/llama-cuda.tar.xz tools/device_bench.sh \
#              target/release/nextn.xz "$OUT"
#   within 600 s (the script starts no step after NEXTN_BENCH_BUDGET_S, 480 s by default)
#
# Steps, in this order (the most valuable first; each under `timeout`, and none is started once the
# time budget, NEXTN_BENCH_BUDGET_S, is spent: on a slow machine the last ones are skipped, and
# the summary says which ran):
#  1. synthesis of q08, q27, moe8 (about a minute each for q27 and moe8 on 16 cores).
#  2. head to head, per file: llama-bench -m F -ngl 99 -p 512 -n 128 -r 3 beside nextn's warm
#     prefill of 512 tokens (bench -d 512,512, the better of the two) and its plain decode of 128
#     tokens on one prompt (bench -n 128 -r 3 --spec-draft-n-max 0); moe8 also with the routed
#     experts of 4 layers on the CPU (llama-bench -ncmoe 4 / nextn --n-cpu-moe 4) and of all
#     layers (-ncmoe 99 / --cpu-moe). Same thread count (-t) for both. Then q08's prefill and
#     decode again with the int8 products cut a block a thread (NEXTN_GPU_ROW_THREADS=1), and its
#     decode with the reductions in workgroup memory alone (NEXTN_GPU_SUBGROUPS=0): the A/B of
#     both settings on the same card.
#  3. the per-kernel profile of plain decoding (bench --device-profile) on q08 and q27: each
#     kernel's device time and achieved bandwidth beside the card's copy bandwidth; then
#     q08: MTP at the random weights' own acceptance (near zero, so this shows what drafting
#     costs): nextn bench --spec-draft-n-max 0,1,2,3 -n 128 beside llama-speculative-simple
#     --spec-type draft-mtp --spec-draft-n-max 1..3 -n 128, greedy, on the same prompt.
#  4. nextn alone, as this script ran before llama.cpp was added: MTP at forced acceptance
#     0.95/0.86/0.75 on q08, then q27.
#  5. moe8: the MTP pair of step 3, then nextn's forced-acceptance runs with --n-cpu-moe 4 and
#     --cpu-moe.
#  6. the vision tower of the released shape (synthesized with q08, F16) encoding one picture of
#     NEXTN_BENCH_IMAGE_SIDE pixels a side: on the device, then on the CPU (bench --image).
#  7. nextn's passes at depth 4096 (q08, q27): the lowest value, the first to be skipped.
#
# Output: OUT_DIR/device-bench-raw.tar.gz (every step's stdout and stderr and bench --json files;
# refreshed after each step, so a cut-off run still leaves what it measured) and
# OUT_DIR/device-bench-summary.txt; stdout gets one line per step and, last, the summary table
# (shape, test, nextn tok/s, llama.cpp tok/s, nextn/llama.cpp).
#
# Environment:
#   LLAMA_CUDA_DIR          llama.cpp binaries: a folder holding llama-bench (and
#                           llama-speculative-simple), or the .tar.xz of build_llama_cuda.sh.
#                           Absent: nextn alone. Its CUDA libraries come from the GPU machine:
#                           LD_LIBRARY_PATH gets python3's (and /opt/torch/.venv's) nvidia/*/lib
#                           folders and /usr/local/cuda/lib64, for the llama.cpp commands only.
#   NEXTN_BENCH_ALLOW_SOFTWARE=1  accept a software Vulkan device (lavapipe) to try the flow.
#   NEXTN_BENCH_MODELS      "tag=FILE ..." (tags q08, q27, moe8) instead of synthesizing.
#   NEXTN_BENCH_MMPROJ      with NEXTN_BENCH_MODELS: the mmproj for step 6 (none: step 6 skipped).
#   NEXTN_BENCH_IMAGE_SIDE  the picture's side in pixels (1024).
#   NEXTN_BENCH_PP, _TG, _REPS, _MTP_N (forced MTP runs; half of it on moe8), _THREADS, _BUDGET_S:
#                           512, 128, 3, 64, nproc, 480.
set -uo pipefail
bin="${1:-target/release/nextn}"
out="${2:-${OUT:-/tmp}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
budget="${NEXTN_BENCH_BUDGET_S:-480}"
image_side="${NEXTN_BENCH_IMAGE_SIDE:-1024}"
pp="${NEXTN_BENCH_PP:-512}"
tg="${NEXTN_BENCH_TG:-128}"
reps="${NEXTN_BENCH_REPS:-3}"
mtp_n="${NEXTN_BENCH_MTP_N:-64}"
threads="${NEXTN_BENCH_THREADS:-$(nproc)}"
t0=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
raw="$work/raw"
mkdir -p "$raw"
# xz without the xz program if need be (python3's lzma).
unxz_to() {
    xz -dc "$1" >"$2" 2>/dev/null || python3 -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
}
untar_xz() {
    tar -xJf "$1" -C "$2" 2>/dev/null || python3 -c 'import sys, tarfile
tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"
}
if [ "${bin%.xz}" != "$bin" ]; then
    if ! unxz_to "$bin" "$work/nextn"; then
        echo "cannot unpack $bin" >&2
        exit 1
    fi
    chmod +x "$work/nextn"
    bin="$work/nextn"
fi
bin="$(realpath "$bin")"
skipped=""
failed=""
pack() { tar -czf "$out/device-bench-raw.tar.gz" -C "$work" raw 2>/dev/null || true; }

# step NAME LIMIT_S MIN_S CMD...: CMD's stdout to raw/NAME.out, stderr to raw/NAME.err, under
# `timeout` capped at the budget left; not started with less than MIN_S left.
step() {
    local name="$1" limit="$2" min="$3"
    shift 3
    local left=$((budget - (SECONDS - t0)))
    if ((left < min)); then
        printf '%-26s skipped (%ss of the budget left)\n' "$name" "$left"
        echo "skipped: ${left}s left" >"$raw/$name.skipped"
        skipped="$skipped $name"
        return 1
    fi
    ((limit > left)) && limit=$left
    local s=$SECONDS rc
    timeout -k 5 "$limit" "$@" >"$raw/$name.out" 2>"$raw/$name.err"
    rc=$?
    ((rc == 0)) || failed="$failed $name($rc)"
    printf '%-26s rc %3d  %4ds%s\n' "$name" "$rc" $((SECONDS - s)) \
        "$( ((rc == 124)) && echo '  (timed out)')"
    pack
    return $rc
}

# The nextn device: the first hardware GPU listed, else (when allowed) a software one.
"$bin" --list-devices | tee "$raw/list-devices.txt"
dev="$(awk -F: '/^  [A-Za-z]/ && !/software/ {gsub(/^ +/, "", $1); print $1; exit}' \
    "$raw/list-devices.txt")"
if [ -z "$dev" ] && [ "${NEXTN_BENCH_ALLOW_SOFTWARE:-0}" = 1 ]; then
    dev="$(awk -F: '/^  [A-Za-z]/ {gsub(/^ +/, "", $1); print $1; exit}' "$raw/list-devices.txt")"
fi
if [ -z "$dev" ]; then
    echo "no hardware GPU listed (NEXTN_BENCH_ALLOW_SOFTWARE=1 accepts a software one)" >&2
    exit 1
fi
echo "nextn device: $dev; $(nproc) cores; threads $threads; budget ${budget}s"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    | tee "$raw/nvidia-smi.txt"
# The compute units the profile's workgroups per dispatch are set against.
for py in python3 /opt/torch/.venv/bin/python3; do
    "$py" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}: {p.multi_processor_count} multiprocessors, {p.L2_cache_size >> 20} MiB L2")' \
        2>/dev/null | tee "$raw/gpu-properties.txt" && break
done

# llama.cpp: unpack, and the CUDA libraries the GPU machine has.
llama=""
if [ -n "${LLAMA_CUDA_DIR:-}" ]; then
    src="$LLAMA_CUDA_DIR"
    if [ -f "$src" ]; then
        mkdir -p "$work/llama"
        untar_xz "$src" "$work/llama" && src="$work/llama"
    fi
    lb="$(find "$src" -maxdepth 3 -name llama-bench -type f -perm -u+x 2>/dev/null | head -1)"
    if [ -n "$lb" ]; then
        llama="$(dirname "$lb")"
        libs=""
        site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)"
        torch=/opt/torch/.venv/lib/python3*/site-packages
        for d in ${site:+$site/nvidia/cu13/lib} $torch/nvidia/cu13/lib \
            ${site:+$site/nvidia/*/lib} $torch/nvidia/*/lib /usr/local/cuda/lib64 \
            /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
            for e in $d; do
                [ -d "$e" ] && case ":$libs:" in *":$e:"*) ;; *) libs="${libs:+$libs:}$e" ;; esac
            done
        done
        llama_env=(env "LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
        cp "$llama/BUILD-INFO" "$raw/llama-BUILD-INFO.txt" 2>/dev/null
        echo "llama.cpp: $llama ($(grep -m1 '^commit' "$llama/BUILD-INFO" 2>/dev/null))"
        "${llama_env[@]}" ldd "$llama/llama-bench" >"$raw/llama-ldd.txt" 2>&1
        grep -E 'cudart|cublas|libcuda\.|not found' "$raw/llama-ldd.txt" | sed 's/^\s*/  ldd: /'
    else
        echo "LLAMA_CUDA_DIR=$LLAMA_CUDA_DIR holds no llama-bench: nextn alone" >&2
    fi
fi

# 1. The files, each synthesized once.
declare -A model
mmproj="${NEXTN_BENCH_MMPROJ:-}"
if [ -n "${NEXTN_BENCH_MODELS:-}" ]; then
    for kv in $NEXTN_BENCH_MODELS; do model[${kv%%=*}]="${kv#*=}"; done
else
    step synth-q08 120 30 "$bin" synth --preset 0.8b --type Q4_K_M -o "$work/q08.gguf" \
        --mmproj "$work/mmproj.gguf" && model[q08]="$work/q08.gguf" \
        && mmproj="$work/mmproj.gguf"
    step synth-q27 240 60 "$bin" synth --preset 27b --layers 16 --type Q4_K_M -o "$work/q27.gguf" \
        && model[q27]="$work/q27.gguf"
    step synth-moe8 240 60 "$bin" synth --preset 35b-a3b --layers 8 --type Q4_K_M \
        -o "$work/moe8.gguf" && model[moe8]="$work/moe8.gguf"
fi
shapes=""
for m in q08 q27 moe8; do [ -n "${model[$m]:-}" ] && shapes="$shapes $m"; done
prompt="Write a short story about a lighthouse keeper who finds a message in a bottle."
printf '{"name": "story", "prompt": "%s"}\n' "$prompt" >"$work/prompt.jsonl"

# tag_of "--n-cpu-moe 4" -> -ncmoe4; "--cpu-moe" -> -cpumoe; "" -> ""
tag_of() { local t; t="$(echo "$1" | tr -d ' -' | sed 's/ncpumoe/ncmoe/')"; echo "${t:+-$t}"; }

# 2. Head to head: prefill of $pp tokens and plain decode of $tg tokens; moe8 also with the routed
# experts of 4 layers, then of all layers (the NextN block's too: -ncmoe 99), on the CPU.
for m in $shapes; do
    f="${model[$m]}"
    placements=("")
    [ "$m" = moe8 ] && placements=("" "--n-cpu-moe 4" "--cpu-moe")
    for p in "${placements[@]}"; do
        tag="$(tag_of "$p")"
        if [ -n "$llama" ]; then
            ncmoe=0
            [ "$p" = "--n-cpu-moe 4" ] && ncmoe=4
            [ "$p" = "--cpu-moe" ] && ncmoe=99
            step "llama-bench-$m$tag" 120 20 "${llama_env[@]}" "$llama/llama-bench" -m "$f" \
                -ngl 99 -ncmoe "$ncmoe" -p "$pp" -n "$tg" -r "$reps" -t "$threads" -o json
        fi
        # shellcheck disable=SC2086
        step "nextn-pp-$m$tag" 120 20 "$bin" bench -m "$f" -dev "$dev" $p -t "$threads" -c 4096 \
            -d "$pp,$pp" --reps 3 -o json
        # shellcheck disable=SC2086
        step "nextn-tg-$m$tag" 120 20 "$bin" bench -m "$f" -dev "$dev" $p -t "$threads" -c 4096 \
            -n "$tg" -r "$reps" --reps 3 --prompts "$work/prompt.jsonl" --spec-draft-n-max 0 -o json
    done
done

# 2b. The products' cut and reductions, A/B on the same card: q08's prefill and decode with a
# block a thread (NEXTN_GPU_ROW_THREADS=1, as lavapipe runs them) beside the default of step 2 (a
# row over 32 threads, blocks shared by narrow rows), and its decode with the reductions in
# workgroup memory alone (NEXTN_GPU_SUBGROUPS=0; the same bits): rows "pp512 rt1", "tg128 rt1"
# and "tg128 sg0" of the summary.
if [ -n "${model[q08]:-}" ]; then
    step nextn-tg-q08-sg0 120 20 env NEXTN_GPU_SUBGROUPS=0 "$bin" bench -m "${model[q08]}" \
        -dev "$dev" -t "$threads" -c 4096 -n "$tg" -r "$reps" --reps 3 \
        --prompts "$work/prompt.jsonl" --spec-draft-n-max 0 -o json
    step nextn-pp-q08-rt1 120 20 env NEXTN_GPU_ROW_THREADS=1 "$bin" bench -m "${model[q08]}" \
        -dev "$dev" -t "$threads" -c 4096 -d "$pp,$pp" --reps 3 -o json
    step nextn-tg-q08-rt1 120 20 env NEXTN_GPU_ROW_THREADS=1 "$bin" bench -m "${model[q08]}" \
        -dev "$dev" -t "$threads" -c 4096 -n "$tg" -r "$reps" --reps 3 \
        --prompts "$work/prompt.jsonl" --spec-draft-n-max 0 -o json
fi

# Steps 3 and 5: MTP at the random weights' own acceptance (near zero): nextn bench at n_max 1..3
# (one run each) beside llama-speculative-simple --spec-type draft-mtp, same prompt, greedy, $tg
# tokens.
mtp_pair() {
    local m="$1" d
    step "nextn-mtp-$m" 120 30 "$bin" bench -m "${model[$m]}" -dev "$dev" -t "$threads" -c 4096 \
        -n "$tg" --reps 3 --prompts "$work/prompt.jsonl" --spec-draft-n-max 0,1,2,3 -o json
    [ -n "$llama" ] && [ -x "$llama/llama-speculative-simple" ] || return 0
    for d in 1 2 3; do
        step "llama-mtp$d-$m" 60 15 "${llama_env[@]}" "$llama/llama-speculative-simple" \
            -m "${model[$m]}" -ngl 99 -c 4096 -t "$threads" --spec-type draft-mtp \
            --spec-draft-n-max "$d" -n "$tg" --temp 0 --ignore-eos -p "$prompt"
    done
}
# Steps 4 and 5: nextn alone, as before: MTP at forced acceptance (bench --json files).
forced() {
    local m="$1" p tag
    if [ "$m" = moe8 ]; then
        for p in "--n-cpu-moe 4" "--cpu-moe"; do
            tag="$(tag_of "$p")"
            # shellcheck disable=SC2086
            step "nextn-forced-$m$tag" 150 40 "$bin" bench -m "${model[$m]}" -dev "$dev" $p \
                -n $((mtp_n / 2)) --spec-draft-n-max 0,1,2,3 --force-acceptance 0.95,0.86,0.75 \
                -o json --json "$raw/device-$m$tag.json"
        done
    else
        step "nextn-forced-$m" 240 60 "$bin" bench -m "${model[$m]}" -dev "$dev" -n "$mtp_n" \
            --spec-draft-n-max 0,1,2,3 --force-acceptance 0.95,0.86,0.75 --floor-verify-rows 8 \
            -o json --json "$raw/device-$m.json"
    fi
}
has() { [ -n "${model[$1]:-}" ]; }
# Steps 3 to 6, in falling value; first the per-kernel profile of plain decoding on the 0.8B and
# 27B shapes (each kernel's device time and achieved bandwidth beside the card's copy bandwidth).
for m in q08 q27; do
    has "$m" || continue
    step "nextn-profile-$m" 90 20 "$bin" bench -m "${model[$m]}" -dev "$dev" -t "$threads" \
        -c 4096 -n 32 --prompts "$work/prompt.jsonl" --spec-draft-n-max 0 --device-profile -o json
done
has q08 && mtp_pair q08
has q08 && forced q08
has q27 && forced q27
has moe8 && mtp_pair moe8
has moe8 && forced moe8
# The vision tower (the released shape, projecting to q08's width) on one picture of
# $image_side x $image_side pixels (1024 tokens at 1024): on the device, then on the CPU with the
# same threads.
if has q08 && [ -n "$mmproj" ]; then
    python3 - "$work/picture.png" "$image_side" <<'PY'
import struct, sys, zlib
path, side = sys.argv[1], int(sys.argv[2])
rows = b"".join(b"\0" + bytes((x * 7 + y * 3 + c * 50) % 256 for x in range(side) for c in range(3))
                for y in range(side))
chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
open(path, "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
                       + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
PY
    step nextn-image-device 90 20 "$bin" bench -m "${model[q08]}" -dev "$dev" -t "$threads" \
        --mmproj "$mmproj" --image "$work/picture.png" -r "$reps" -o json
    step nextn-image-cpu 120 30 "$bin" bench -m "${model[q08]}" -dev none -t "$threads" \
        --mmproj "$mmproj" --image "$work/picture.png" -r "$reps" -o json
fi
for m in q08 q27; do
    has "$m" || continue
    step "nextn-depth-$m" 120 45 "$bin" bench -m "${model[$m]}" -dev "$dev" -d 4096 \
        --depth-fill 512 --floor-verify-rows 8 --json "$raw/device-$m-depth.json"
done

# The summary: one table from the raw outputs.
python3 - "$raw" "$pp" "$tg" >"$out/device-bench-summary.txt" <<'EOF'
import glob, json, os, re, sys
raw, pp, tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = {}  # (shape, test) -> {"nextn": v, "llama": v, "note": str}
def put(shape, test, side, v, note=""):
    r = rows.setdefault((shape, test), {})
    r[side] = v
    if note:
        r.setdefault("note", []).append(note)
def load(path):
    try:
        return json.load(open(path))
    except Exception:
        return None
name = lambda p: os.path.basename(p).rsplit(".", 1)[0]
def split(n, prefix):  # "nextn-tg-moe8-ncmoe4" -> ("moe8", " ncmoe4")
    rest = n[len(prefix):].split("-")
    return rest[0], "".join(" " + t for t in rest[1:])
for p in glob.glob(f"{raw}/llama-bench-*.out"):
    shape, place = split(name(p), "llama-bench-")
    for r in load(p) or []:
        if r.get("n_gen", 0) == 0:
            put(shape, f"pp{r['n_prompt']}{place}", "llama", r["avg_ts"])
        else:
            put(shape, f"tg{r['n_gen']}{place}", "llama", r["avg_ts"])
for p in glob.glob(f"{raw}/nextn-pp-*.out"):
    shape, place = split(name(p), "nextn-pp-")
    v = [r["prefill_tokens_per_s"] for r in load(p) or [] if "prefill_tokens_per_s" in r]
    if v:
        put(shape, f"pp{pp}{place}", "nextn", max(v))
for p in glob.glob(f"{raw}/nextn-tg-*.out"):
    shape, place = split(name(p), "nextn-tg-")
    for r in load(p) or []:
        if str(r.get("n_max")) == "0":
            put(shape, f"tg{tg}{place}", "nextn", r["decode_tok_s"])
for p in glob.glob(f"{raw}/nextn-mtp-*.out"):
    shape, place = split(name(p), "nextn-mtp-")
    for r in load(p) or []:
        n, acc = str(r.get("n_max")), r.get("acceptance")
        if n.isdigit() and n != "0":
            put(shape, f"mtp{n}{place}", "nextn", r["decode_tok_s"],
                "nextn acc %.2f" % acc if acc is not None else "")
for p in glob.glob(f"{raw}/llama-mtp*.err"):
    m = re.match(r"llama-mtp(\d+)-(\w+)", name(p))
    text = open(p, errors="replace").read()
    sp = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", text)
    acc = re.search(r"accept\s+=\s+([\d.]+)%", text)
    if m and sp:
        put(m.group(2), f"mtp{m.group(1)}", "llama", float(sp.group(1)),
            "llama acc %.2f" % (float(acc.group(1)) / 100) if acc else "")
for p in glob.glob(f"{raw}/nextn-forced-*.out"):
    shape, place = split(name(p), "nextn-forced-")
    for r in load(p) or []:
        n = str(r.get("n_max"))
        if n.isdigit() and n != "0":
            put(shape, f"mtp{n}{place} forced", "nextn", r["decode_tok_s"],
                "x%.2f of plain" % r["speedup"] if r.get("speedup") else "")
images = {}
for p in glob.glob(f"{raw}/nextn-image-*.out"):
    for r in load(p) or []:
        images[name(p).rsplit("-", 1)[1]] = r
order = {"q08": 0, "q27": 1, "moe8": 2}
def key(k):
    shape, test = k
    place = 1 if "ncmoe" in test else 2 if "cpumoe" in test else 0
    kind = (0 if test.startswith("pp") else 1 if test.startswith("tg")
            else 2 if "forced" not in test else 3)
    return (order.get(shape, 9), kind, place, test)
fmt = lambda v: "%.1f" % v if v is not None else "-"
print("%-5s %-22s %10s %10s %7s  %s" % ("shape", "test", "nextn", "llama.cpp", "ratio", "note"))
for k in sorted(rows, key=key):
    r = rows[k]
    a, b = r.get("nextn"), r.get("llama")
    ratio = "%.2f" % (a / b) if a and b else "-"
    note = ", ".join(r.get("note", []))
    print("%-5s %-22s %10s %10s %7s  %s" % (k[0], k[1], fmt(a), fmt(b), ratio, note))
for where, r in sorted(images.items()):
    extra = ""
    if r.get("per_encode"):
        c = r["per_encode"]
        extra = ", %g dispatches, %g submissions" % (c["dispatches"], c["submissions"])
    print("vision tower on the %s: %d tokens (%d patches) in %.1f ms median, %.0f patches/s%s"
          % (where, r["tokens"], r["patches"], r["median_ms"], r["patches_per_second"], extra))
EOF
echo
echo "tok/s; ratio = nextn / llama.cpp; nextn on $dev; llama.cpp: ${LLAMA_CUDA_DIR:-absent};" \
    "$((SECONDS - t0))s in all"
[ -z "$skipped" ] || echo "not run (budget spent):$skipped" >>"$out/device-bench-summary.txt"
[ -z "$failed" ] || echo "failed (rc; 124 = timed out):$failed" >>"$out/device-bench-summary.txt"
# The profiles' kernel tables, the heaviest kernels first.
for m in q08 q27; do
    f="$raw/nextn-profile-$m.err"
    [ -s "$f" ] || continue
    {
        echo
        echo "profile, $m plain decode:"
        grep -m1 'device copy bandwidth' "$f"
        sed -n '/device time by kernel/,/^[^ ]/p' "$f" | grep '^  ' | head -16
    } >>"$out/device-bench-summary.txt"
done
cat "$out/device-bench-summary.txt"
cp "$out/device-bench-summary.txt" "$raw/summary.txt"
pack
