#!/usr/bin/env bash
# Issue 51's instrument: one H200 runs it whole in at most 8 minutes and it prints one JSON object on
# stdout (progress goes to stderr; every part's files stay in OUT_DIR).
#
#   bash benchmarks/gpu.sh [OUT_DIR]          # default runs/gpu-bench; PYTHON=.venv/bin/python to choose
#   GPU_SH_CPU=1 bash benchmarks/gpu.sh OUT   # the same parts on the CPU at the tiny shape (a slow test)
#   TOTAL_S=300 bash benchmarks/gpu.sh        # the whole run's budget (default 480 s): to fit a shorter lease
#
# 1. python -m benchmarks.gpu_bench (its budget: TOTAL_S less 90 s): for every registered
#    architecture the trainer's compiled step at the gpt2 shape (tokens/s, MFU against 989 TFLOP/s,
#    peak memory, the largest micro-batch, a torch.profiler summary and trace in OUT/traces), gpt
#    at that micro-batch, decode at batch 1 and 64 after warm-up (CUDA graphs where the step
#    allows), Hugging Face generate with a static cache on the exported model beside it, flex vs
#    dense, a loop of 40 short generations (CUDA graphs recorded, cache addresses). Its JSON: OUT/gpu_bench.json.
# 2. While time is left, the distributed paths through the real command line under torchrun (one
#    process per GPU, NPROC=1 on one GPU): fsdp2 on lrt with per-block compile and activation
#    checkpointing (DCP save, the gathered model.safetensors, then generate from it); ddp on gpt with
#    the whole step compiled and `train --profile 3` (its trace in OUT/ddp-run/profile).
set -uo pipefail
cd "$(dirname "$0")/.."
# the GPU machines' image has python3 (the one holding PyTorch) and no plain `python`
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "gpu.sh: $PYTHON cannot import torch: set PYTHON to the interpreter that holds PyTorch" >&2
  exit 2
fi
KILL_AFTER_S=10  # `timeout -k`: a command that ignores SIGTERM (a hung torchrun) is killed this much later
GENERATE_S=60  # the generate check after fsdp2: reserved before fsdp2 starts
NPROC=${NPROC:-1}
OUT=${1:-runs/gpu-bench}
TOTAL_S=${TOTAL_S:-480}
mkdir -p "$OUT"
export LATENTLOOP_CACHE=${LATENTLOOP_CACHE:-$OUT/cache}
rm -rf "$OUT/fsdp2-run" "$OUT/ddp-run" "$OUT/gpu_bench.json"  # an earlier run's report is never read as this one's
log() { echo "gpu.sh: $*" >&2; }
started=$(date +%s)
left() { echo $((TOTAL_S - ($(date +%s) - started))); }

# the CPU fallback: tiny shapes, dynamo's graphs run by AOT autograd without inductor (aot_eager: the backend
# "eager" fails lrt's checkpointed MLPs under bf16 autocast, torch 2.13)
if [ -n "${GPU_SH_CPU:-}" ]; then
  BENCH_ARGS=(--cpu --tiny --threads 1)
  TRAIN_SHAPE=(--preset test --set sequence_len=64 --batch-size 4 --device cpu --set train.compile_backend=aot_eager
               --set data.max_bytes=200000)
  GENERATE_DEVICE=cpu
else
  BENCH_ARGS=()
  TRAIN_SHAPE=(--preset small --batch-size 16 --device cuda --set data.max_bytes=4000000)
  GENERATE_DEVICE=cuda
fi

BENCH_BUDGET_S=${BENCH_BUDGET_S:-$((TOTAL_S - 90))}
log "1/3 benchmarks.gpu_bench (budget ${BENCH_BUDGET_S} s)"
# the budget stops starting new cases; one already running (a compile, then its timing) may take ~50 s more
timeout -k $KILL_AFTER_S $((BENCH_BUDGET_S + 50)) "$PYTHON" -m benchmarks.gpu_bench "${BENCH_ARGS[@]}" --budget-s "$BENCH_BUDGET_S" \
  --out-dir "$OUT" >"$OUT/gpu_bench.stdout" 2>"$OUT/gpu_bench.stderr"
bench_status=$?

# The interpreter's own stdlib as the corpus keeps tokenizing out of the way.
TRAIN_COMMON=(--data stdlib --set train.eval_every=0 --set train.eval_batches=2 --set train.log_every=5 --no-progress
              --json "${TRAIN_SHAPE[@]}")
fsdp2_status=skipped generate_status=skipped ddp_status=skipped

if [ "$(left)" -gt $((GENERATE_S + 60)) ]; then
  log "2/3 torchrun fsdp2: lrt, blocks compiled + activation checkpointing, DCP + gathered weights ($(left) s left)"
  timeout -k $KILL_AFTER_S $(($(left) - GENERATE_S - 2 * KILL_AFTER_S)) "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m latentloop \
    train --arch lrt --steps 20 --set train.strategy=fsdp2 --set train.compile=true \
    --set train.activation_checkpointing=true --set train.save_every=10 "${TRAIN_COMMON[@]}" \
    --out "$OUT/fsdp2-run" >"$OUT/fsdp2.stdout" 2>"$OUT/fsdp2.stderr"
  fsdp2_status=$?
  if [ "$fsdp2_status" -eq 0 ]; then  # a run cut off by its timeout left a partial checkpoint: nothing to check
    timeout -k $KILL_AFTER_S $GENERATE_S "$PYTHON" -m latentloop generate "$OUT/fsdp2-run" --prompt "def " \
      --max-new-tokens 16 --temperature 0 --device "$GENERATE_DEVICE" --json >"$OUT/generate.stdout" \
      2>"$OUT/generate.stderr"
    generate_status=$?
  else
    generate_status=skipped:fsdp2-failed
  fi
fi

if [ "$(left)" -gt 40 ]; then
  log "3/3 torchrun ddp: gpt, the whole step compiled, train --profile 3 ($(left) s left)"
  timeout -k $KILL_AFTER_S $(($(left) - 2 * KILL_AFTER_S)) "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m latentloop \
    train --arch gpt --steps 20 --set train.strategy=ddp --set train.compile=true --profile 3 "${TRAIN_COMMON[@]}" \
    --out "$OUT/ddp-run" >"$OUT/ddp.stdout" 2>"$OUT/ddp.stderr"
  ddp_status=$?
fi

"$PYTHON" - "$OUT" "$(($(date +%s) - started))" "$TOTAL_S" "$bench_status" "$fsdp2_status" "$generate_status" \
  "$ddp_status" <<'EOF'
import json, sys
from pathlib import Path

out, elapsed, total = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
statuses = dict(zip(["gpu_bench", "fsdp2_train", "generate", "ddp_train"], sys.argv[4:]))
codes = {key: None if status.startswith("skipped") else int(status) for key, status in statuses.items()}


def read(name):
    """A part's JSON, or why there is none: skipped for time, or its exit code and the end of its stderr."""
    path = out / f"{name}.stdout"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        err = out / f"{name}.stderr"
        tail = err.read_text().splitlines()[-15:] if err.exists() else []
        return {"error": f"no JSON from {path.name}", "stderr_tail": tail}


bench = read("gpu_bench")
if "error" in bench and (out / "gpu_bench.json").exists():  # killed at its limit: the cases it saved as it went
    bench = {**json.loads((out / "gpu_bench.json").read_text()), "stderr_tail": bench["stderr_tail"]}
report = {"elapsed_s": elapsed, "budget_s": total, "within_budget": elapsed <= total, "exit_codes": codes,
          "gpu_bench": bench}
for part, name in (("fsdp2_train", "fsdp2"), ("generate_from_fsdp2_run", "generate"), ("ddp_train", "ddp")):
    key = {"fsdp2": "fsdp2_train", "generate": "generate", "ddp": "ddp_train"}[name]
    why = {"skipped": "time budget", "skipped:fsdp2-failed": "the fsdp2 run failed: no checkpoint to generate from"}
    report[part] = {"skipped": why[statuses[key]]} if codes[key] is None else read(name)
ckpts = sorted((out / "fsdp2-run" / "checkpoints").glob("step_*"))
report["fsdp2_checkpoint_files"] = sorted(p.name for p in ckpts[-1].iterdir()) if ckpts else []
summary = out / "ddp-run" / "profile" / "summary.json"
report["ddp_profile"] = json.loads(summary.read_text()) if summary.exists() else None
print(json.dumps(report, indent=2))
sys.exit(0 if not any(codes.values()) else 1)
EOF
