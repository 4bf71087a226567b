#!/usr/bin/env bash
# Issue 13's prepared GPU benchmark: one H200 runs it whole in about 10 minutes and it prints one
# JSON object on stdout (progress goes to stderr; every part's files stay in OUT_DIR).
#
#   bash benchmarks/gpu.sh [OUT_DIR]          # default runs/gpu-bench; PYTHON=.venv/bin/python to choose
#   BENCH_BUDGET_S=300 bash benchmarks/gpu.sh # part 1's time budget (default 480 s): to fit a shorter lease
#
# 1. python -m benchmarks.gpu_bench: training tokens/s and MFU (bf16, compiled) at the gpt2 shape for
#    gpt, fbt K=1/2/3, lrt interleaved S=2 and rgpt; decode tokens/s at batch 1 and 64 per regime/mode;
#    peak memory; flex_attention vs the dense mask on lrt's subsets (forward and backward).   ~7-8 min
# 2. The distributed GPU paths through the real command line, under torchrun (NCCL, one process per
#    GPU, NPROC=1 on one GPU): fsdp2 with the bf16/fp32 policy, torch.compile per block and activation
#    checkpointing on lrt (DCP save, the gathered model.safetensors, then generate from it); ddp on gpt
#    with the whole model compiled.                                                                ~2 min
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
NPROC=${NPROC:-1}
OUT=${1:-runs/gpu-bench}
mkdir -p "$OUT"
export LATENTLOOP_CACHE=${LATENTLOOP_CACHE:-$OUT/cache}
rm -rf "$OUT/fsdp2-run" "$OUT/ddp-run"
log() { echo "gpu.sh: $*" >&2; }

log "1/3 benchmarks.gpu_bench"
BENCH_BUDGET_S=${BENCH_BUDGET_S:-480}
# the budget stops starting new cases; a case already running (a compile, then its timing) may take ~80 s more
timeout $((BENCH_BUDGET_S + 80)) "$PYTHON" -m benchmarks.gpu_bench --budget-s "$BENCH_BUDGET_S" --out "$OUT/gpu_bench.json" \
  >"$OUT/gpu_bench.stdout" 2>"$OUT/gpu_bench.stderr"
bench_status=$?

# A small corpus (the interpreter's own stdlib, 4 MB) keeps tokenizing out of the way.
TRAIN_COMMON=(--data stdlib --set data.max_bytes=4000000 --set train.eval_every=0 --set train.eval_batches=4
              --set train.log_every=5 --no-progress --json)

log "2/3 torchrun fsdp2: lrt, compile + activation checkpointing, DCP + gathered weights"
timeout 240 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m latentloop train \
  --arch lrt --preset small --steps 30 --batch-size 16 --set train.strategy=fsdp2 --set train.compile=true \
  --set train.activation_checkpointing=true --set train.save_every=15 "${TRAIN_COMMON[@]}" \
  --out "$OUT/fsdp2-run" >"$OUT/fsdp2.stdout" 2>"$OUT/fsdp2.stderr"
fsdp2_status=$?
timeout 120 "$PYTHON" -m latentloop generate "$OUT/fsdp2-run" --prompt "def " --max-new-tokens 16 \
  --temperature 0 --device cuda --json >"$OUT/generate.stdout" 2>"$OUT/generate.stderr"
generate_status=$?

log "3/3 torchrun ddp: gpt, whole model compiled"
timeout 180 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m latentloop train \
  --arch gpt --preset small --steps 30 --batch-size 16 --set train.strategy=ddp --set train.compile=true \
  "${TRAIN_COMMON[@]}" --out "$OUT/ddp-run" >"$OUT/ddp.stdout" 2>"$OUT/ddp.stderr"
ddp_status=$?

"$PYTHON" - "$OUT" "$bench_status" "$fsdp2_status" "$generate_status" "$ddp_status" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
codes = dict(zip(["gpu_bench", "fsdp2_train", "generate", "ddp_train"], map(int, sys.argv[2:])))


def read(name):
    """A part's JSON, or its exit code and the end of its stderr."""
    path = out / f"{name}.stdout"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        err = out / f"{name}.stderr"
        tail = err.read_text().splitlines()[-15:] if err.exists() else []
        return {"error": f"no JSON from {path.name}", "stderr_tail": tail}


report = {"exit_codes": codes, "gpu_bench": read("gpu_bench"), "fsdp2_train": read("fsdp2"),
          "generate_from_fsdp2_run": read("generate"), "ddp_train": read("ddp")}
ckpts = sorted((out / "fsdp2-run" / "checkpoints").glob("step_*"))
report["fsdp2_checkpoint_files"] = sorted(p.name for p in ckpts[-1].iterdir()) if ckpts else []
print(json.dumps(report, indent=2))
sys.exit(0 if not any(codes.values()) else 1)
EOF
