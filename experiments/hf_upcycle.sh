#!/usr/bin/env bash
# Hugging Face interop on CPU (issue 12): a small gpt with Llama options -> plain Llama export ->
# import-hf -> upcycled into fbt and lrt, each continued for the same tokens as the continued base.
# Usage: bash experiments/hf_upcycle.sh [OUT] (default runs/hf); prints every eval as JSON lines.
set -euo pipefail
OUT=${1:-runs/hf}
LL=${LL:-latentloop}
BASE_STEPS=${BASE_STEPS:-300}
MORE_STEPS=${MORE_STEPS:-150}
EVAL_BATCHES=${EVAL_BATCHES:-16}
LLAMA="--set learned_norms=true --set qk_norm=false --set embed_norm=false --set mlp=swiglu --set norm_eps=1e-5
       --set n_kv_head=2 --set tie_embeddings=false"
SHAPE="--set sequence_len=128 --set batch_size=8"
rm -rf "$OUT" && mkdir -p "$OUT"

time $LL train --preset tiny --data stdlib --steps "$BASE_STEPS" $LLAMA $SHAPE --seed 0 --out "$OUT/base" --no-progress
$LL export "$OUT/base" --format hf --plain --out "$OUT/base-hf"
$LL import-hf "$OUT/base-hf" --out "$OUT/imported"
for arch in gpt fbt lrt; do  # the same data order (seed 1) and schedule for the three continuations
  time $LL train --arch "$arch" --init-from "$OUT/imported" --data stdlib --steps "$MORE_STEPS" --lr 1e-3 \
    --set warmup_steps=10 --set batch_size=8 --seed 1 --out "$OUT/$arch" --no-progress
done
for run in base imported gpt fbt lrt; do
  echo "{\"run\": \"$run\", \"eval\": $($LL eval "$OUT/$run" --json --batches "$EVAL_BATCHES")}" | tr -d '\n'
  echo
done
