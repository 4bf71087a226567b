"""Post-training at CPU scale (issue 15): pretrain gpt / fbt / rgpt briefly on stdlib, SFT each on a
built-in *_steps task in the chat format (and gpt on GSM8K train), then measure accuracy and trace
length (tokens before the final answer) per regime / depth, before and after SFT.

    PYTHONPATH=. python experiments/post_training.py --out runs/post --gsm8k ../shared/data \
        --pretrain-steps 120 --sft-steps 120 --limit 50

One seed by default (the budget is ~20 CPU minutes on a shared 2-core machine). Evaluation uses the
task's *training* difficulty (`test=` = the train range) because the harder test split is out of
reach at this scale; say so wherever the numbers are quoted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from latentloop.cli import main
from latentloop.eval.generation import run_generation_tasks
from latentloop.runtime import load_run

TASK = "addition_steps:digits=2,n=4000"
EVAL_TASK = "addition_steps:digits=2,test=1-2"  # the training range (see the docstring)
REGIMES = {"gpt": {"plain": {}},
           "fbt": {"standard": {"regime": "standard"}, "soft": {"regime": "soft"}, "fused": {"regime": "fused"}},
           "rgpt": {f"depth {r}": {"steps": r} for r in (1, 2, 4)}}


def evaluate(run: Path, arch: str, chat: bool, limit: int, gsm8k_dir: str | None) -> dict:
    model, tokenizer, _, _ = load_run(run)
    rows = {}
    for label, options in REGIMES[arch].items():
        names = [f"chat:{EVAL_TASK}" if chat else EVAL_TASK]
        if chat and gsm8k_dir:
            names.append("chat:gsm8k")
        results = run_generation_tasks(model, tokenizer, names, gsm8k_dir, options, limit=limit, progress=False)
        rows[label] = {name: {k: r[k] for k in ("accuracy", "n", "mean_trace_tokens", "mean_reasoning_tokens")}
                       for name, r in results.items()}
    return rows


def run(args) -> dict:
    out = Path(args.out)
    report = {}
    for arch in args.archs.split(","):
        started = time.perf_counter()
        base, sft = out / f"{arch}-base", out / f"{arch}-sft"
        common = ["--no-progress", "--seed", str(args.seed)]
        if not base.exists():
            assert main(["train", "--arch", arch, "--preset", "test", "--data", "stdlib", "--steps",
                         str(args.pretrain_steps), "--batch-size", "8", "--out", str(base),
                         "--set", "max_bytes=2000000",
                         "--set", "eval_every=0", *common]) == 0
        if not sft.exists():
            assert main(["train", "--stage", "sft", "--init-from", str(base), "--data", f"chat:task:{TASK}",
                         "--steps", str(args.sft_steps), "--batch-size", "8", "--out", str(sft),
                         "--set", "eval_every=0",
                         "--lr", "3e-3", *common]) == 0
        report[arch] = {"before": evaluate(base, arch, False, args.limit, None),
                        "after": evaluate(sft, arch, True, args.limit, None),
                        "seconds": time.perf_counter() - started}
        print(json.dumps({arch: report[arch]}, indent=1), flush=True)
    if args.gsm8k:
        gsm = out / "gpt-gsm8k"
        if not gsm.exists():
            assert main(["train", "--stage", "sft", "--init-from", str(out / "gpt-base"), "--data",
                         f"chat:{args.gsm8k}/sft/gsm8k_train.jsonl:question=user,answer=assistant", "--steps",
                         str(args.sft_steps), "--batch-size", "8", "--out", str(gsm), "--set", "eval_every=0",
                         "--lr", "3e-3", "--no-progress"]) == 0
        model, tokenizer, _, _ = load_run(gsm)
        result = run_generation_tasks(model, tokenizer, ["chat:gsm8k"], f"{args.gsm8k}/eval", {}, limit=args.limit,
                                      progress=False)["chat:gsm8k"]
        report["gpt-gsm8k"] = {k: result[k] for k in ("accuracy", "n", "mean_trace_tokens", "mean_reasoning_tokens")}
        print(json.dumps({"gpt-gsm8k": report["gpt-gsm8k"]}), flush=True)
    (out / "post_training.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/post")
    parser.add_argument("--archs", default="gpt,fbt,rgpt")
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gsm8k", default=None, help="the shared data folder (with sft/ and eval/)")
    run(parser.parse_args())
