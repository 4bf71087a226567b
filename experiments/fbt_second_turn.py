"""fbt SFT, a chat's second turn: the reply's loss and greedy exact match on held-out two-turn chats, with
the earlier reply replayed fused (`written`, what chat and serve do since 12-06) and read plain (before),
beside training's own forward on the same weights (its exact, T-pass form).

    python experiments/fbt_second_turn.py --out runs/fbt-second-turn      # ~3 minutes on 2 cores

Task: "copy s" -> s, then "rev" -> s reversed (s: 3-6 letters of a-j). Trains a `test`-preset fbt for
30 steps on stdlib, then SFT for 400 steps on 4,000 such chats; scores 64 chats whose strings no
training chat holds. The paired difference (plain - replayed) has a 95% t-interval over the chats."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

LETTERS = "abcdefghij"
TRAIN_CHATS, EVAL_CHATS = 4000, 64
T_975 = {63: 1.998}  # Student's t, two-sided 95%, 63 degrees of freedom


def chat(rng: random.Random) -> tuple[str, list[dict]]:
    s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
    return s, [{"role": "user", "content": "copy " + s}, {"role": "assistant", "content": s},
               {"role": "user", "content": "rev"}, {"role": "assistant", "content": s[::-1]}]


def train(out: Path) -> Path:
    rng = random.Random(0)
    chats = [chat(rng) for _ in range(TRAIN_CHATS)]
    data = out / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": messages}) + "\n" for _, messages in chats))
    cli = [sys.executable, "-m", "latentloop", "train", "--no-progress"]
    subprocess.run([*cli, "--arch", "fbt", "--preset", "test", "--data", "stdlib", "--set", "data.max_bytes=300000",
                    "--steps", "30", "--out", str(out / "base")], check=True)
    subprocess.run([*cli, "--stage", "sft", "--init-from", str(out / "base"), "--data", f"chat:{data}",
                    "--steps", "400", "--out", str(out / "sft")], check=True)
    return out / "sft"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run = args.out / "sft" if (args.out / "sft" / "config.json").is_file() else train(args.out)
    from latentloop.archs.fbt.objective import sft_fuse_mask
    from latentloop.data.chat import prompt_written
    from latentloop.engine import generate
    from latentloop.runs import load_run

    model, tok, config, _ = load_run(run, "cpu", accelerate=False)
    model.eval()
    seen = {json.loads(line)["messages"][1]["content"] for line in (args.out / "chats.jsonl").open()}
    rng, held_out = random.Random(1), []
    while len(held_out) < EVAL_CHATS:
        s, messages = chat(rng)
        if s not in seen and s not in {h[0] for h in held_out}:
            held_out.append((s, messages))
    losses = {"replayed": [], "plain": [], "training forward": []}
    exact = {"replayed": 0, "plain": 0}
    with torch.no_grad():
        for _, messages in held_out:
            prompt = tok.render_prompt(messages[:3])
            reply = tok.encode(messages[3]["content"]) + [tok.chat_tokens.end]
            for name, written in (("replayed", prompt_written(tok, messages[:3], prompt)), ("plain", None)):
                cache = model.new_cache(1, len(prompt) + len(reply))
                extra = {} if written is None else {"written": torch.tensor([written])}
                logits = [model.prefill(torch.tensor([prompt]), cache, regime="soft", last_logits=True,
                                        **extra).logits[0, -1]]
                for token in reply[:-1]:  # teacher-forced soft steps, as decoding runs them
                    logits.append(model.decode(torch.tensor([[token]]), cache, regime="soft").logits[0, -1])
                losses[name].append(F.cross_entropy(torch.stack(logits), torch.tensor(reply)).item())
                out = generate(model, prompt, 12, temperature=0.0, stop_tokens=[tok.chat_tokens.end], regime="soft",
                               written=written, compile=False)
                exact[name] += int(tok.decode(out) == messages[3]["content"])
            ids, mask = tok.render(messages)
            x, y, trained = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]), torch.tensor([mask[1:]])
            fused = sft_fuse_mask(trained) & (x != config.model.bos_id)
            exact_forward = model(x, passes=x.shape[1], fuse_mask=fused).logits[0]  # training's, Jacobi-exact
            second = trained[0].clone()
            second[:len(prompt) - 1] = False
            losses["training forward"].append(F.cross_entropy(exact_forward[second], y[0][second]).item())
    n = len(held_out)
    for name, values in losses.items():
        print(f"reply 2 loss, {name:16s}: {statistics.mean(values):.4f} nats/token (mean over {n} held-out chats)")
    gaps = [p - r for p, r in zip(losses["plain"], losses["replayed"])]
    half = T_975[n - 1] * statistics.stdev(gaps) / math.sqrt(n)
    print(f"plain - replayed: {statistics.mean(gaps):+.4f} [{statistics.mean(gaps) - half:+.4f}, "
          f"{statistics.mean(gaps) + half:+.4f}] (95% t-interval over chats)")
    print(f"greedy reply 2 exactly right: replayed {exact['replayed']}/{n}, plain {exact['plain']}/{n}")


if __name__ == "__main__":
    main()
