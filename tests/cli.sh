#!/bin/sh
# cli.sh BIN_DIR DATA_DIR WORK_DIR — the command-line tools as a user meets them: --help,
# --version, --inspect of each kind, and named errors with the right exit status.
set -u
bin=$1 data=$2 work=$3
src_configs="$data/../../configs"
rm -rf "$work" && mkdir -p "$work"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# expect NAME STATUS PATTERN CMD... : CMD exits STATUS and its stdout+stderr match PATTERN.
expect() {
  name=$1 status=$2 pattern=$3
  shift 3
  "$@" >"$work/$name.out" 2>&1
  rc=$?
  [ "$rc" -eq "$status" ] || fail "$name: exit $rc, expected $status ($(head -c 300 "$work/$name.out"))"
  grep -q -- "$pattern" "$work/$name.out" || fail "$name: output lacks '$pattern': $(head -c 600 "$work/$name.out")"
}

convert="$bin/kvcap-convert"
expect help 0 "usage: kvcap-convert" "$convert" --help
expect version 0 "kvcap-convert [0-9]*\.[0-9]*\.[0-9]*" "$convert" --version
expect no_args 2 "nothing to do" "$convert"
expect bad_option 2 "see kvcap-convert --help" "$convert" --frobnicate
expect inspect_dataset 0 "kind       dataset, format version 1" "$convert" --inspect "$data/schema/good_dataset.safetensors"
expect inspect_dataset_grid 0 "grids      2x2: 1 span" "$convert" -i "$data/schema/good_dataset.safetensors"
expect inspect_artifact 0 "maps       storage F32, activation gelu, fallback flashcache" "$convert" -i "$data/schema/good_artifact.safetensors"
expect inspect_artifact_sched 0 "mean r 0.500" "$convert" -i "$data/schema/good_artifact.safetensors"
expect inspect_calib 0 "bucket 0: 9 training, 1 validation spans" "$convert" -i "$data/schema/good_calib.safetensors"
expect inspect_tensors 0 "l1.h0.b0.k_gram  F64    \[4, 4\]" "$convert" -i "$data/schema/good_calib.safetensors"
expect inspect_geometry 0 "2 query heads / 1 KV heads (G=2), head_dim 64" "$convert" -i "$data/schema/good_calib.safetensors"
expect inspect_missing 1 "no_such_file.kvcap" "$convert" -i "$work/no_such_file.kvcap"
expect inspect_bad_schema 1 "missing required tensor 's0.l1.v'" "$convert" -i "$data/schema/bad_missing_value.safetensors"
expect inspect_bad_container 1 "bad_json" "$convert" -i "$data/bad/bad_json.safetensors"
expect inspect_many 1 "error: .*bad_head_dim.*model.head_dim" "$convert" -i "$data/schema/good_calib.safetensors" "$data/schema/bad_head_dim.safetensors"
# --inspect validates with the readers' own check: an artifact the runtime would refuse (heads of
# a layer with different map sizes, a NaN in a map) fails here too, naming the file and tensor.
expect inspect_artifact_heads 1 "bad_artifact_head_h.safetensors: tensor 'l0.h1.b0.k_w1': h = 3 differs" "$convert" -i "$data/schema/bad_artifact_head_h.safetensors"
expect inspect_artifact_nan 1 "tensor 'l1.h0.b0.k_b2': non-finite value nan" "$convert" -i "$data/schema/bad_artifact_nan.safetensors"
expect inspect_theta_inf 1 "model.rope.theta: inf" "$convert" -i "$data/schema/bad_theta_inf.safetensors"
# A calibration state --inspect passes converts; one it refuses, kvcap-convert refuses with the
# same message and writes nothing.
expect conv_good_calib 0 "wrote $work/good.kvcap" "$convert" "$data/schema/good_calib.safetensors" --out "$work/good.kvcap"
state_agrees() { # NAME PATTERN: tests/data/schema/bad_calib_NAME.safetensors
  expect "inspect_calib_$1" 1 "$2" "$convert" -i "$data/schema/bad_calib_$1.safetensors"
  expect "conv_calib_$1" 1 "$2" "$convert" "$data/schema/bad_calib_$1.safetensors" --out "$work/bad_$1.kvcap"
  [ -e "$work/bad_$1.kvcap" ] && fail "conv_calib_$1: a failed conversion left bad_$1.kvcap behind"
}
state_agrees no_fit "calib.fit: missing"
state_agrees hidden "calib.fit.hidden: 2.5 is not an integer"
state_agrees hidden_huge "calib.fit.hidden: 1e+300 is not an integer"
state_agrees ridge_inf "calib.fit.ridge"
state_agrees storage "calib.fit.storage: 'I32'"
state_agrees spans "calib.spans\[0\]"
state_agrees gram_nan "tensor 'l0.h0.b0.v_gram': non-finite value nan at element 5"

synth="$bin/kvcap-synth"
expect synth_help 0 "usage: kvcap-synth" "$synth" --help
expect synth_no_out 2 "--out DIR is required" "$synth"
expect synth_bad_grid 2 "--grid: '16by16'" "$synth" --out "$work/x" --grid 16by16
expect synth_bad_spans 2 "--spans: '0'" "$synth" --out "$work/x" --spans 0
expect synth_bad_config 1 "no_such.yaml" "$synth" --out "$work/x" --config "$work/no_such.yaml"
expect synth_run 0 "wrote 2 spans for SmolLM2-135M" "$synth" --out "$work/synth" --spans 2 --grid 4x4 --dtype bf16
expect synth_run16 0 "wrote 6 spans" "$synth" --out "$work/synth16" --spans 6 --grid 16x16 --seed 5
expect synth_inspect 0 "spans      2 (K/V BF16" "$convert" -i "$work/synth/shard-00000.safetensors"
[ -e "$work/x" ] && fail "failed runs left $work/x behind"
# A run that fails half-way leaves nothing it created: not the shard it wrote before the 2x2
# grid failed, not the folders it made, and nothing of a folder that was there before.
expect synth_fail_new 1 "error: synth: rank_k 8 / rank_v 8 must be in 1..4 / 1..3 for a 2x2 grid" "$synth" --out "$work/new/deep" --grid 8x8 --grid 2x2 --spans 2 --shard-mb 1
[ -e "$work/new" ] && fail "a failed kvcap-synth left $(find "$work/new")"
[ "$(grep -c "error:" "$work/synth_fail_new.out")" -eq 1 ] || fail "synth_fail_new: the error is not printed once"
mkdir -p "$work/kept" && : >"$work/kept/mine"
expect synth_fail_old 1 "for a 2x2 grid" "$synth" --out "$work/kept" --grid 8x8 --grid 2x2 --spans 2 --shard-mb 1
[ "$(ls -A "$work/kept")" = "mine" ] || fail "a failed kvcap-synth changed a folder it did not make: $(ls -A "$work/kept")"
# On a terminal the error stands once on a line of its own, ending with a newline (the progress
# bar's open line used to run into it).
if script -qec true /dev/null </dev/null >/dev/null 2>&1; then
  script -qec "'$synth' --out '$work/tty' --grid 4x4 --grid 2x2 --spans 3" /dev/null </dev/null >"$work/synth_tty.raw" 2>&1
  tr -d '\r' <"$work/synth_tty.raw" >"$work/synth_tty.out"
  { [ "$(grep -c "error:" "$work/synth_tty.out")" -eq 1 ] &&
    grep -q "^kvcap-synth: error: synth: rank_k 8" "$work/synth_tty.out" &&
    [ -z "$(tail -c 1 "$work/synth_tty.out")" ]; } ||
    fail "synth_tty: the error is not one line of its own: $(head -c 400 "$work/synth_tty.out")"
  [ -e "$work/tty" ] && fail "a failed kvcap-synth on a terminal left $work/tty behind"
fi

calibrate="$bin/kvcap-calibrate"
expect cal_help 0 "usage: kvcap-calibrate" "$calibrate" --help
expect cal_help_device 0 "--device DEV" "$calibrate" --help
expect cal_no_out 2 "--out STATE.kvcs is required" "$calibrate" --data "$work/synth"
expect cal_no_data 2 "--data PATH is required" "$calibrate" --out "$work/s.kvcs"
expect cal_run 0 "bucket  layer    r_k" "$calibrate" --data "$work/synth16" --out "$work/s.kvcs" --metrics-json "$work/m.json"
grep -q '"attn_cos"' "$work/m.json" || fail "metrics JSON lacks attn_cos"
grep -Eq '"device":[[:space:]]*"(cpu|cuda)"' "$work/m.json" || fail "metrics JSON lacks the device"
# --device: auto is cuda where a device is visible and cpu elsewhere, and writes what that
# device writes; cuda without a device is an error naming the option that writes nothing.
expect cal_device_bogus 2 "--device: 'bogus' is not cuda, cpu or auto" "$calibrate" --data "$work/synth16" --out "$work/dev.kvcs" --device bogus
expect cal_device_cpu 0 "^device: cpu" "$calibrate" --data "$work/synth16" --out "$work/dev-cpu.kvcs" --device cpu
expect cal_device_auto 0 "^device: c" "$calibrate" --data "$work/synth16" --out "$work/dev-auto.kvcs" --device auto
"$calibrate" --data "$work/synth16" --out "$work/dev-cuda.kvcs" --device cuda >"$work/cal_device_cuda.out" 2>&1
rc=$?
if grep -q "^device: cpu" "$work/cal_device_auto.out"; then
  [ "$rc" -eq 1 ] || fail "cal_device_cuda: exit $rc without a device, expected 1"
  grep -q -- "error: --device cuda: " "$work/cal_device_cuda.out" ||
    fail "cal_device_cuda: no error naming --device: $(head -c 300 "$work/cal_device_cuda.out")"
  [ -e "$work/dev-cuda.kvcs" ] && fail "a failed --device cuda run left dev-cuda.kvcs behind"
  cmp -s "$work/dev-auto.kvcs" "$work/dev-cpu.kvcs" || fail "--device auto and cpu wrote different states"
else
  [ "$rc" -eq 0 ] || fail "cal_device_cuda: exit $rc with a device: $(head -c 300 "$work/cal_device_cuda.out")"
  grep -q "^device: cuda" "$work/cal_device_cuda.out" || fail "cal_device_cuda: summary lacks 'device: cuda'"
  cmp -s "$work/dev-auto.kvcs" "$work/dev-cuda.kvcs" || fail "--device auto and cuda wrote different states"
fi
expect cal_inspect 0 "kind       calib" "$convert" -i "$work/s.kvcs"
# A state that cannot be written: named, exit 1, nothing left (and, under the sanitizers, the
# state is freed on that path too).
expect cal_unwritable 1 "$work/no/such/dir/s.kvcs" "$calibrate" --data "$work/synth16" --out "$work/no/such/dir/s.kvcs"
grep -q "LeakSanitizer" "$work/cal_unwritable.out" && fail "cal_unwritable: the state leaked"
expect cal_unmatched 1 "4x4 grid (n = 16), which matches no bucket" "$calibrate" --data "$work/synth" --out "$work/bad.kvcs"
[ -e "$work/bad.kvcs" ] && fail "a failed calibration left bad.kvcs behind"
expect cal_skip 1 "buckets\[0\] (16x16 dense): no training span" "$calibrate" --data "$work/synth" --out "$work/bad.kvcs" --skip-unmatched
expect conv_run 0 "wrote $work/a.kvcap" "$convert" "$work/s.kvcs" --out "$work/a.kvcap" --keys uniform:0.25 --storage bf16
# Trained key maps converted at the schedule they were trained at stay trained: the state's
# pyramid ratios come back through its JSON header to 15 digits, and are still that schedule.
sed -e 's/method: closed_form/method: trained/' -e 's/steps: 50, finetune_steps: 20/steps: 3, finetune_steps: 1/' \
  "$src_configs/smollm2-135m.calib.yaml" >"$work/trained.yaml"
expect cal_trained 0 "bucket  layer    r_k" "$calibrate" --config "$work/trained.yaml" --data "$work/synth16" --out "$work/trained.kvcs"
expect conv_trained 0 "key maps as calibrated" "$convert" "$work/trained.kvcs" --out "$work/trained.kvcap" --keys pyramid:0.5:0.25
grep -q "replaced by closed-form" "$work/conv_trained.out" && fail "conv_trained: the trained maps were refitted"
expect conv_trained_prov 0 '"key_maps":"trained"' "$convert" --inspect "$work/trained.kvcap"
# A ratio that keeps no point of a bucket is refused by name (it kept one row while the
# summary said "mean retention 0.000"); nothing is written.
expect conv_tiny_ratio 1 "keys: layer 0's ratio 1e-300 keeps none of the 256 points of bucket 0 (16x16)" \
  "$convert" "$work/s.kvcs" --out "$work/tiny.kvcap" --keys uniform:1e-300
[ -e "$work/tiny.kvcap" ] && fail "a refused conversion left tiny.kvcap behind"
expect conv_inspect 0 "storage BF16, activation linear" "$convert" -i "$work/a.kvcap"
expect conv_inspect_r 0 "keys       mean r 0.250" "$convert" -i "$work/a.kvcap"
# What the value basis keeps of the values, next to random directions: the synthetic spans'
# values are rank 8 plus a little noise, so the basis keeps nearly all, without a warning;
# values that are noise alone leave a basis no structure (the DCT's, fitted to nothing, keeps
# what chance does), and kvcap-convert warns, but converts.
grep -q "value basis, bucket 1 (16x16, tiles 4x4): keeps 9[0-9] % .*(random directions: 38 %)" \
  "$work/conv_run.out" || fail "conv_run: no value-basis line: $(cat "$work/conv_run.out")"
grep -q "warning" "$work/conv_run.out" && fail "conv_run: warned on low-rank values"
"$synth" --out "$work/noise" --spans 6 --grid 16x16 --seed 5 --noise 100 -q >/dev/null 2>&1 &&
  "$calibrate" -q --data "$work/noise" --out "$work/noise.kvcs" >/dev/null 2>&1 ||
  fail "noise: kvcap-synth or kvcap-calibrate failed"
expect conv_noise 0 "warning: bucket 1 (16x16): the value basis keeps 3[0-9] % .* random directions 38 %: these spans hold little for it" \
  "$convert" "$work/noise.kvcs" --out "$work/noise.kvcap" --value-basis dct
[ -s "$work/noise.kvcap" ] || fail "conv_noise: the warning stopped the conversion"

# An output naming an input (any spelling: ./, a symlink, a hard link) or a file inside an input
# folder is refused before any work, and the input stays as it was; so are two outputs naming
# one file, outputs that are devices or FIFOs, and FIFOs as inputs (refused, not waited on).
sum_before=$(cksum <"$work/s.kvcs")
ln -sf s.kvcs "$work/s-link.kvcs"
ln -f "$work/s.kvcs" "$work/s-hard.kvcs"
expect same_out 2 "--out $work/s.kvcs is the same file as the input STATE" "$convert" "$work/s.kvcs" --out "$work/s.kvcs"
expect same_out_dot 2 "is the same file as the input" "$convert" "$work/s.kvcs" --out "$work/./s.kvcs"
expect same_out_link 2 "is the same file as the input" "$convert" "$work/s.kvcs" --out "$work/s-link.kvcs"
expect same_out_hard 2 "is the same file as the input" "$convert" "$work/s.kvcs" --out "$work/s-hard.kvcs"
[ "$(cksum <"$work/s.kvcs")" = "$sum_before" ] || fail "a refused convert changed its input"
# One state (or dataset) given twice would be merged with itself, its statistics counted twice:
# refused before any work, naming both arguments, whatever the spelling.
expect conv_dup_state 2 "STATE $work/s.kvcs and STATE $work/./s.kvcs name the same file" "$convert" "$work/s.kvcs" "$work/./s.kvcs" --out "$work/dup.kvcap"
expect conv_dup_link 2 "STATE $work/s.kvcs and STATE $work/s-link.kvcs name the same file" "$convert" "$work/s.kvcs" "$work/dev-cpu.kvcs" "$work/s-link.kvcs" --out "$work/dup.kvcap"
expect conv_dup_hard 2 "STATE $work/s-hard.kvcs name the same file" "$convert" "$work/s.kvcs" "$work/s-hard.kvcs" --out "$work/dup.kvcap"
[ -e "$work/dup.kvcap" ] && fail "a refused merge wrote dup.kvcap"
cp "$data/schema/good_calib.safetensors" "$work/copy.kvcs" # a copy is another file: merged
expect conv_merge 0 "wrote $work/merged.kvcap" "$convert" "$data/schema/good_calib.safetensors" "$work/copy.kvcs" --out "$work/merged.kvcap"
expect cal_dup_data 2 "--data $work/synth16 and --data $work/synth16/ name the same folder" "$calibrate" --data "$work/synth16" --data "$work/synth16/" --out "$work/dup.kvcs"
expect cal_dup_shard 2 "--data $work/synth16/shard-00000.safetensors is a file inside --data $work/synth16" "$calibrate" --data "$work/synth16" "$work/synth16/shard-00000.safetensors" --out "$work/dup.kvcs"
[ -e "$work/dup.kvcs" ] && fail "a refused calibration wrote dup.kvcs"
expect cal_out_in_data 2 "is a file inside the input --data" "$calibrate" --data "$work/synth16" --out "$work/synth16/shard-00000.safetensors"
expect cal_out_metrics 2 "name the same file" "$calibrate" --data "$work/synth16" --out "$work/t.kvcs" --metrics-json "$work/./t.kvcs"
expect cal_out_device 2 "--metrics-json /dev/null exists and is not a regular file" "$calibrate" --data "$work/synth16" --out "$work/t.kvcs" --metrics-json /dev/null
[ -e "$work/t.kvcs" ] && fail "a refused calibration wrote t.kvcs"
[ -c /dev/null ] || fail "/dev/null is no longer a device"
if mkfifo "$work/fifo" 2>/dev/null; then
  expect fifo_in 1 "fifo: not a regular file (a FIFO)" timeout 10 "$convert" "$work/fifo" --out "$work/f.kvcap"
  expect fifo_out 2 "fifo exists and is not a regular file" timeout 10 "$convert" "$work/s.kvcs" --out "$work/fifo"
  [ -p "$work/fifo" ] || fail "a refused convert replaced the FIFO"
fi
cp "$data/eval/metrics-sample.json" "$work/metrics.json"
report="$bin/kvcap-report"
expect report_same_in 2 "--html $work/./metrics.json is the same file as the input" "$report" "$work/metrics.json" --html "$work/./metrics.json"
expect report_same_out 2 "name the same file" "$report" "$work/metrics.json" --html "$work/r.html" --csv "$work/./r.html"
cmp -s "$data/eval/metrics-sample.json" "$work/metrics.json" || fail "a refused report changed its input"
# outputs that belong together: the HTML cannot be written, so the CSV is not written either
expect report_half 1 "$work/no/such/dir/r.html" "$report" "$work/metrics.json" --csv "$work/half.csv" --html "$work/no/such/dir/r.html"
[ -e "$work/half.csv" ] && fail "a report that failed on its HTML wrote its CSV"
# A signal in the middle of a write (here a file-size limit, SIGXFSZ, as deterministic as a
# Ctrl-C at that write) ends the tool as it would, without leaving the temporary file.
mkdir -p "$work/limited"
(ulimit -f 2048 && exec "$synth" --out "$work/limited" --spans 6 --grid 16x16 --seed 5) >"$work/xfsz.out" 2>&1
rc=$?
[ "$rc" -gt 128 ] || fail "xfsz: exit $rc, expected the death by SIGXFSZ ($(head -c 300 "$work/xfsz.out"))"
[ -z "$(ls -A "$work/limited")" ] || fail "an interrupted write left $(ls -A "$work/limited")"
expect conv_bad_sched 2 "--keys: 'pyramid:0.5'" "$convert" "$work/s.kvcs" --out "$work/b.kvcap" --keys pyramid:0.5
expect conv_missing 1 "no_such.kvcs" "$convert" "$work/no_such.kvcs" --out "$work/b.kvcap"
expect conv_wrong_kind 1 "kvcap.kind: 'artifact', expected 'calib'" "$convert" "$work/a.kvcap" --out "$work/b.kvcap"
[ -e "$work/b.kvcap" ] && fail "a failed conversion left b.kvcap behind"

bench="$bin/kvcap-bench"
expect bench_help 0 "--row-kernels" "$bench" --help
expect bench_bad_heads 2 "--heads: '7/2'" "$bench" --heads 7/2
expect bench_run 0 "kvcapsule: bytes include the maps" "$bench" --grid 8x8 --layers 1 --steps 2 --heads 4/1 --policy kvcapsule --warm --threads 1
grep -q "4 q / 1 kv heads" "$work/bench_run.out" || fail "bench_run: --heads 4/1 not in the header"
expect bench_engine 0 "OpenMP threads run attend's tasks" "$bench" --grid 8x8 --layers 1 --steps 3 --heads 4/1 --policy streaming --engine-threads --threads 2
grep -Eq "^streaming +[0-9.]+ +[0-9.]+ " "$work/bench_engine.out" || fail "bench_engine: no streaming row"
expect bench_rows 0 "fused KVCapsule, tiled maps of 16 points, h 6, R_v 6" "$bench" --row-kernels --heads 2/1 --storage bf16
[ "$(grep -c "cold (caches evicted before each call)" "$work/bench_rows.out")" -eq 2 ] ||
  fail "bench_rows: not one cold rate per kernel"
grep -Eq "^  (in L2|cold) .* 0\.0 " "$work/bench_rows.out" && fail "bench_rows: a kernel read nothing"

# kvcap-eval generate: usage errors name the option, before any model is read
ev="$bin/kvcap-eval"
expect gen_help 0 "usage: kvcap-eval generate --ids LIST" "$ev" generate --help
expect gen_no_ids 2 "--ids is required" "$ev" generate
expect gen_bad_ids 2 "--ids: '1,x' is not a list of token ids" "$ev" generate --ids 1,x
expect gen_bad_span 2 "--spans: 'image:4': expected text:N or vision:RxC" "$ev" generate --ids 1,2 --spans image:4
expect gen_cover 2 "--spans: cover 5 tokens, --ids has 2" "$ev" generate --ids 1,2 --spans text:1,vision:2x2
expect gen_no_model 1 "no_such.gguf" "$ev" generate --ids 1,2 -m "$work/no_such.gguf"
if [ "$failures" -ne 0 ]; then
  echo "$failures CLI check(s) failed"
  exit 1
fi
echo "all CLI checks passed"
