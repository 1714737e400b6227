#!/bin/bash
# Issue 33's GPU measurements in one call of a few minutes: each stage logs to $OUT (default ./gpu-check) and has
# its own time limit, so a stage that fails or runs long leaves the others their time.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on a machine with one CUDA GPU
#
# Needs the project and TRL importable; on a machine without a registry, WHEELS=.gpu/whl installs carried wheels
# first (see ../shared/notes/gpu.md in the developers' workspace). Stages, in order of value: a GRPO step llmrl vs
# TRL at 128 new tokens (the server profiles its second generate and update into $OUT/prof), ZeRO-3 vs ZeRO-2
# serving, the decoding paths at 128 new tokens (no exactness row: it compiles another shape), a GRPO step at 512,
# then packing (the planner's choice of unpacked passes for long continuations, against packing them, on an update's
# pass), then the attention window (static-cache steps over windows of the cache vs over all of it, at the long
# length; its windowed row captures a CUDA graph per window width, from one compiled step). Limits: T1..T6 seconds;
# STAGES=zero3,grpo-long runs only those. All six need more than one call (10 minutes) and more than a session's
# device time (15 minutes): on an H100, STAGES=zero3,grpo-long (about 7 minutes), then STAGES=window,grpo-short
# (about 6), leaves the decoding and packing stages for another session. HF_COMPILE=1
# adds HF's static cache + compile row to the decoding stage (about 45 s more on an H100: give it T3=200), for the
# target "at least as fast as HF's static cache + compile" in the same run. TRAINING='{"max_tokens_per_micro_batch":
# 40000}' trains each GRPO micro-batch in one pass, as TRL does (by default llmrl splits one of over 8,192 tokens
# into passes, at the cost of one more forward pass; the JSON's "median update" shows the difference). A smoke run on CPU:
#   DEVICE=cpu SHAPE=narrow DECODING_SHAPE=tiny DTYPE=float32 NEW=8,16 bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
T0=$(date +%s)
if [ -n "${WHEELS:-}" ]; then  # WHEELS=.gpu/whl: install the carried wheels first (a machine without a registry)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl > "$OUT/setup.log" 2>&1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}  # the project's venv, if any
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
TOK=()  # a tokenizer folder (SmolLM2's for real prompt lengths); default: the tests' tiny Llama's
[ -n "${TOKENIZER:-}" ] && TOK=(--tokenizer "$TOKENIZER")
DEVICE=${DEVICE:-0} SHAPE=${SHAPE:-smollm2-1.7b} DTYPE=${DTYPE:-bfloat16} NEW=${NEW:-128,512}
SHORT=${NEW%,*} LONG=${NEW#*,}
DECODER_DEVICE=$([ "$DEVICE" = cpu ] && echo cpu || echo "cuda:$DEVICE")
[ "$DEVICE" = cpu ] || export DS_ACCELERATOR=cuda  # a DeepSpeed wheel built on a CPU machine records "cpu"
S="--shape $SHAPE --devices $DEVICE --dtype $DTYPE --prompts 8 --samples 8 --prompt-tokens 64 --threads 8"
TRAINING=${TRAINING:-"{}"}  # more llmrl training settings for the GRPO stages, as JSON (see grpo_step --training)
STAGES=${STAGES:-grpo-short,zero3,decoding,grpo-long,packing,window}  # which stages run, in their fixed order
stage() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  case ",$STAGES," in *",$name,"*) ;; *) return ;; esac
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/stages.log"
}
stage grpo-short "${T1:-200}" "$PY" -m benchmarks.grpo_step $S "${TOK[@]}" --steps 4 --new-tokens "$SHORT" \
  --training "$TRAINING" --paths now,trl --profile "$OUT/prof" --out "$OUT/grpo-short.json"
stage zero3 "${T2:-150}" "$PY" -m benchmarks.zero3_serving --shape "$SHAPE" --devices "$DEVICE" --dtype "$DTYPE" \
  "${TOK[@]}" --names zero2,zero3 --repeats 4 --profile "$OUT/prof-zero3"
stage decoding "${T3:-150}" "$PY" -m benchmarks.decoding --device "$DECODER_DEVICE" "${TOK[@]}" \
  --shape "${DECODING_SHAPE:-smollm2-1.7b}" \
  --new-tokens "$SHORT" --batch1-shape "" $([ "${HF_COMPILE:-0}" = 1 ] || echo --skip-hf-compile) \
  --skip-exactness --out "$OUT/decoding.json"
stage grpo-long "${T4:-260}" "$PY" -m benchmarks.grpo_step $S "${TOK[@]}" --steps 2 --new-tokens "$LONG" \
  --training "$TRAINING" --paths now,trl --out "$OUT/grpo-long.json"
stage packing "${T5:-120}" "$PY" -m benchmarks.packing_choice --device "$DECODER_DEVICE" --shape "$SHAPE" \
  --dtype "$DTYPE" --prompts 8 --samples 8 --new-tokens "$LONG"
stage window "${T6:-180}" "$PY" -m benchmarks.attention_window --device "$DECODER_DEVICE" "${TOK[@]}" \
  --shape "${DECODING_SHAPE:-smollm2-1.7b}" --dtype "$DTYPE" --prompts 8 --samples 8 --prompt-tokens 64 \
  --new-tokens "$LONG" --length-bucket "${WINDOW_BUCKET:-256}"
grep -h "planned\|packed always\|round\|median\|\"now\"\|\"trl\"\|ZeRO-2's\|decoding per rank\|windowed\|whole cache" "$OUT"/*.log \
  | cut -c1-200
