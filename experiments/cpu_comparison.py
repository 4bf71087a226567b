"""CPU-scale comparison of the four architectures on `stdlib`, several seeds.

    python experiments/cpu_comparison.py --out runs/exp --seeds 0 1 2 --steps 300

Runs (each seed):
- gpt           tied baseline, `--steps` steps
- fbt           the default recipe ("short": feedback from step 0, 50/50 two-/three-pass batches since
                2026-12-03, 88/12 before; the deeper passes' loss weighted 1.5 since 2026-12-04, 1.0 before),
                the same tokens as gpt
- fbt-mix55, fbt-mix88   the short recipe's mix pinned: 50/50 (today's) or 88/12 (before 2026-12-03)
- fbt-lambda15, fbt-lambda2   loss_lambda pinned to 1.5 (the default since 2026-12-04) or 2
- fbt-paper     the paper's recipe (single-pass for 75% of the run, 75/22/3 over the whole run)
- gpt-2x        the baseline with twice the steps: matched training compute for lrt
- lrt           interleaved S=2 (about 2x the baseline's FLOPs per token), the same steps as gpt
- lrt-top       ablation: source = the normed top state (the released code) instead of the
                default upper-middle block (the paper)
- rgpt-params   isoparams: the preset's blocks as 1 + (L-2) x R + 1, R = 4 (default gate bias 0)
- rgpt-gate4    the same with the paper's gate bias init +4
- rgpt-flops    isoFLOPs: the same effective depth as gpt
- rfbt-flops    rgpt-flops' shape with fbt's feedback and pass recipe (latentloop's fifth arch): about
                fbt's FLOPs per token (2.2x gpt's); gpt-2x is its matched-compute baseline
- rgpt-flops-heavy, rgpt-params-heavy   rgpt's shapes with Huginn's heavy-tailed depth sampling
- mor-flops, mor-token-flops, mor-params   Mixture-of-Recursions on rgpt's shapes (expert choice, or
                token choice), N_r = rgpt's R: the RecurrentGPT paper's baselines

Every run is evaluated on the same validation windows, spaced evenly over the whole validation
split (`--eval-batches` batches of them; 0: every window): loss/BPB (fbt and rfbt under standard, soft and
fused, and the passes curve K = 1, 2, 3, 4, 8, 16, T on the first 2 batches; lrt with exact
sequential memory and the merged parallel estimate; rgpt at r = 1..R, with the mean gate and the
effective openness per step: each step's latest logged reading).
Writes `results.json` and `results.md` into --out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from latentloop.archs import get_arch  # noqa: E402
from latentloop.archs.rgpt.model import rgpt_shape_from_dense  # noqa: E402
from latentloop.checkpoint import checkpoint_candidates  # noqa: E402
from latentloop.config import DataConfig, RunConfig, TrainConfig, model_config  # noqa: E402
from latentloop.eval.loss import score_curve, score_run, text_batches  # noqa: E402
from latentloop.eval.stats import format_comparison, mean_sd, seed_rows, t_interval  # noqa: E402
from latentloop.train import fit, setup  # noqa: E402
from latentloop.util import pyplot, save_figure  # noqa: E402


def variants(preset: str, seq_len: int, steps: int) -> dict[str, tuple[dict, int]]:
    """name -> (model fields, steps)."""
    base = dict(sequence_len=seq_len, tie_embeddings=True)
    layers = model_config("gpt", preset).n_layer
    return {
        "gpt": (dict(arch="gpt", **base), steps),
        "fbt": (dict(arch="fbt", **base), steps),
        "fbt-paper": (dict(arch="fbt", recipe="paper", **base), steps),
        # fbt's recipe under Muon (issue 25: soft / standard grew from 1.07 to 1.11 when Muon became the default)
        "fbt-mix73": (dict(arch="fbt", pass_mix=(0.0, 0.7, 0.3), **base), steps),
        "fbt-mix55": (dict(arch="fbt", pass_mix=(0.0, 0.5, 0.5), **base), steps),  # the default since 2026-12-03
        "fbt-mix88": (dict(arch="fbt", pass_mix=(0.0, 0.88, 0.12), **base), steps),  # the default before it
        # the deeper passes weighted up (issue 25: fused / standard 1.0178 on seed 0 against 1.0177)
        "fbt-lambda15": (dict(arch="fbt", loss_lambda=1.5, **base), steps),
        "fbt-lambda2": (dict(arch="fbt", loss_lambda=2.0, **base), steps),
        "fbt-muon01": (dict(arch="fbt", train=dict(muon_lr=0.01), **base), steps),
        "fbt-fuse-adamw": (dict(arch="fbt", train=dict(muon_exclude=("fuse_",)), **base), steps),
        "gpt-2x": (dict(arch="gpt", **base), 2 * steps),
        "lrt": (dict(arch="lrt", **base), steps),
        "lrt-top": (dict(arch="lrt", source_layer=-1, **base), steps),
        "rgpt-params": (dict(arch="rgpt", **base, **rgpt_shape_from_dense(layers, "params", 4)), steps),
        "rgpt-gate4": (dict(arch="rgpt", gate_bias_init=4.0, **base, **rgpt_shape_from_dense(layers, "params", 4)),
                       steps),
        "rgpt-flops": (dict(arch="rgpt", **base, **rgpt_shape_from_dense(layers, "flops", 2)), steps),
        "rfbt-flops": (dict(arch="rfbt", **base, **rgpt_shape_from_dense(layers, "flops", 2)), steps),
        # the RecurrentGPT paper's baselines for spending recurrent depth (issue 27), on rgpt's two shapes
        "rgpt-flops-heavy": (dict(arch="rgpt", depth_sampling="heavy_tail", depth_mean=_matched_heavy_tail_mean(2),
                                  **base, **rgpt_shape_from_dense(layers, "flops", 2)), steps),
        "mor-flops": (dict(arch="mor", **base, **_mor_shape(layers, "flops", 2)), steps),
        "mor-token-flops": (dict(arch="mor", routing="token", **base, **_mor_shape(layers, "flops", 2)), steps),
        "rgpt-params-heavy": (dict(arch="rgpt", depth_sampling="heavy_tail", depth_mean=_matched_heavy_tail_mean(4),
                                   **base, **rgpt_shape_from_dense(layers, "params", 4)), steps),
        "mor-params": (dict(arch="mor", **base, **_mor_shape(layers, "params", 4)), steps),
    }


def _mor_shape(layers: int, iso: str, recursions: int) -> dict:
    """MoR on rgpt's middle-cycle shape (prelude / shared core / coda) with N_r = `recursions`."""
    return model_config("mor", None, n_layer=layers, recursions=recursions).iso_fields(iso)


def _matched_heavy_tail_mean(recursions: int) -> float:
    """Huginn's r̄ (E[depth - 1]) that gives uniform{1..R}'s mean depth (R + 1) / 2, at least 1 (the
    setting's lower bound): the two samplings then train at about the same FLOPs."""
    return max(1.0, (recursions + 1) / 2 - 1)


def evaluations(arch: str, config) -> dict[str, dict]:
    if arch in ("fbt", "rfbt"):  # the regimes (rfbt: at its trained depth)
        return get_arch(arch).scoring_modes(config)
    if arch == "lrt":
        return {"sequential": {"prefill": "sequential"}, "interleaved": {"prefill": "interleaved"}}
    if arch == "rgpt":
        return {f"r={r}": {"steps": r} for r in range(1, config.recurrence_steps + 1)}
    if arch == "mor":  # at most r recursions: its early-exit curve
        return {f"r<={r}": {"steps": r} for r in range(1, config.recursions + 1)}
    return {"plain": {}}


def run_one(out: Path, name: str, fields: dict, steps: int, seed: int, preset: str, batch_size: int,
            eval_batches: int, data: str = "stdlib") -> dict:
    fields = dict(fields)
    arch = fields.pop("arch")
    train_fields = fields.pop("train", {})  # a variant's own training settings
    config = RunConfig(model=model_config(arch, preset, **fields),
                       train=TrainConfig(steps=steps, batch_size=batch_size, lr=3e-3, warmup_steps=max(1, steps // 20),
                                         eval_every=0, eval_batches=eval_batches, seed=seed, log_every=10,
                                         **train_fields),
                       data=DataConfig(source=data))
    run_dir = out / f"{name}-s{seed}"
    if run_dir.exists() and not checkpoint_candidates(run_dir):  # stopped before its first checkpoint
        shutil.rmtree(run_dir)
    state = setup(config, run_dir, resume=run_dir.exists(), progress=False)
    start = time.time()
    summary = fit(state, progress=False)
    model = state.model.eval()
    byte_lengths = state.tokenizer.token_byte_lengths()
    batches = text_batches(state.data.val, batch_size, config.model.sequence_len, eval_batches or None, spread=True,
                           bos_id=state.tokenizer.bos_id)  # documents at each BOS: an interval per run
    scores = score_run(model, batches, byte_lengths, evaluations(arch, config.model))
    extra = {}
    for curve_name, curve in get_arch(arch).curves.items():  # fbt's and rfbt's passes curve
        extra[curve_name] = score_curve(model, curve, state.data.val, byte_lengths, batch_size,
                                        config.model.sequence_len, max_batches=CURVE_BATCHES)
    if arch == "rgpt":  # each recurrence step's latest logged gate readings (a step runs its drawn depth only)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        extra["gates"] = {}
        for row in rows:
            extra["gates"] |= {k: v for k, v in row.items() if k.startswith(("openness_r", "gate_mean_r"))}
    return {"name": name, "seed": seed, "arch": arch, "params": model.num_params(), "steps": steps,
            "tokens": summary["tokens"], "train_flops": summary["flops"], "seconds": time.time() - start,
            "scores": scores, **extra}


CURVE_BATCHES = 2  # the fixed point costs T forwards per batch


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


BASELINES = ("gpt", "gpt-2x")  # equal tokens; about matched training compute for the 2x-FLOPs variants


def paired_tables(by_name: dict[str, list[dict]]) -> list[str]:
    """Each run and scoring against each baseline's default scoring: the per-seed ratio of
    validation BPB, its mean with the 95% t-interval over the paired seeds and the verdict
    ("lower" / "higher" when the interval excludes 1, else "undecided")."""
    values = {(name, label): {r["seed"]: r["scores"][label]["bpb"] for r in runs}
              for name, runs in by_name.items() for label in runs[0]["scores"]}
    lines = []
    for baseline in BASELINES:
        if baseline not in by_name:
            continue
        base_key = (baseline, next(iter(by_name[baseline][0]["scores"])))
        rows = seed_rows(values, base_key)
        lines += ["", f"val BPB / {baseline} ({base_key[1]}), per seed, paired: mean [95% t-interval over seeds]:", "",
                  "| run | eval | ratio | verdict | paired seeds |", "|---|---|---:|---|---:|"]
        lines += [f"| {row['name'][0]} | {row['name'][1]} | {format_comparison(row['paired'])} | {row['verdict']} | "
                  f"{len(row['paired']['seeds'])} |" for row in rows if "paired" in row]
    return lines


PAPER_HALF_DEPTH_SHARE = 0.92  # RecurrentGPT: ~92% of the accuracy kept with half the recurrence steps
DEPTH_LABEL = re.compile(r"^r(?:<=|=)(\d+)$")  # scorings at a depth: rgpt's "r=2", MoR's "r<=2"


def early_exit_curves(by_name: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Per run scored at several depths: for each depth r of R, the share of the full-depth quality
    kept, BPB(R) / BPB(r) per seed (1 = nothing lost), with its mean and 95% t-interval."""
    curves = {}
    for name, runs in by_name.items():
        depths = sorted((int(m.group(1)), label) for label in runs[0]["scores"] if (m := DEPTH_LABEL.match(label)))
        if len(depths) < 2:
            continue
        full = depths[-1]
        points = []
        for r, label in depths:
            kept = [run["scores"][full[1]]["bpb"] / run["scores"][label]["bpb"] for run in runs]
            mean, _ = mean_sd(kept)
            points.append({"r": r, "fraction": r / full[0], "kept": kept, "mean": mean, "interval": t_interval(kept)})
        curves[name] = points
    return curves


def early_exit_lines(curves: dict[str, list[dict]]) -> list[str]:
    if not curves:
        return []
    lines = ["", "Early exit: quality kept at a fraction of the depth, BPB(R) / BPB(r) per seed, mean [95% t-interval] "
             f"(the paper: ~{PAPER_HALF_DEPTH_SHARE:.0%} of its accuracy at half depth):", "",
             "| run | r / R | kept |", "|---|---:|---:|"]
    for name, points in curves.items():
        for p in points:
            interval = f" [{p['interval'][0]:.4f}, {p['interval'][1]:.4f}]" if p["interval"] else ""
            lines.append(f"| {name} | {p['r']} / {points[-1]['r']} | {p['mean']:.4f}{interval} |")
    return lines


def plot_early_exit(curves: dict[str, list[dict]], out: Path) -> str | None:
    """early_exit.png: each run's kept quality against the fraction of depth run, a band of its
    t-interval, and the paper's half-depth figure as a line; None without matplotlib or curves."""
    if not curves:
        return None
    plt = pyplot("the early-exit plot")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (name, points) in enumerate(curves.items()):
        xs = [p["fraction"] for p in points]
        ax.plot(xs, [p["mean"] for p in points], marker="o", color=f"C{i % 10}", label=name)
        if all(p["interval"] for p in points):
            ax.fill_between(xs, [p["interval"][0] for p in points], [p["interval"][1] for p in points],
                            color=f"C{i % 10}", alpha=0.2)
    ax.axhline(PAPER_HALF_DEPTH_SHARE, color="grey", linestyle="--", linewidth=1)
    ax.annotate("the paper: ~92% of accuracy at half depth", (0.5, PAPER_HALF_DEPTH_SHARE), fontsize=8,
                color="grey", xytext=(0.52, PAPER_HALF_DEPTH_SHARE + 0.005))
    ax.set_xlabel("fraction of the trained depth run (r / R)")
    ax.set_ylabel("quality kept: BPB(R) / BPB(r)")
    ax.set_title("early exit at a fixed depth (3 seeds, 95% t-interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / "early_exit.png", dpi=120)
    return "early_exit.png"


def _interval(score: dict) -> str:
    """The bootstrap interval over documents of one run's BPB (the first seed's), when it has one."""
    low_high = score.get("bpb_ci")
    return f" [{low_high[0]:.3f}, {low_high[1]:.3f}]" if low_high else ""


def summarise(results: list[dict]) -> str:
    by_name: dict[str, list[dict]] = {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r)
    lines = ["| run | params | tokens | train FLOPs | eval | val loss (mean ± sd) | val BPB (mean ± sd) | seeds | "
             "first seed's BPB, 95% bootstrap over documents |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for name, runs in by_name.items():
        for label in runs[0]["scores"]:
            losses = [r["scores"][label]["loss"] for r in runs]
            bpbs = [r["scores"][label]["bpb"] for r in runs]
            lines.append(f"| {name} | {runs[0]['params']:,} | {runs[0]['tokens']:,} | {runs[0]['train_flops']:.2e}"
                         f" | {label} | {statistics.mean(losses):.4f} ± {_sd(losses):.4f} | "
                         f"{statistics.mean(bpbs):.4f} ± {_sd(bpbs):.4f} | {len(runs)} |"
                         f"{_interval(runs[0]['scores'][label])} |")
    lines += paired_tables(by_name)
    lines += early_exit_lines(early_exit_curves(by_name))
    curves = [r for r in results if "passes_curve" in r]
    if curves:
        labels = list(curves[0]["passes_curve"])
        lines += ["", "fbt fused forward, val loss by passes (first 2 batches; fixed point = K = T):", "",
                  "| run | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
        for name in {r["name"]: None for r in curves}:
            runs = [r for r in curves if r["name"] == name]
            cells = []
            for label in labels:
                values = [r["passes_curve"][label]["loss"] for r in runs]
                cells.append(f"{statistics.mean(values):.4f} ± {_sd(values):.4f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    gated = [r for r in results if "gates" in r]
    if gated:
        lines += ["", "rgpt gates at the last logged training step (mean over seeds):", "",
                  "| run | r | mean gate | effective openness ‖Δh‖/‖o‖ |", "|---|---:|---:|---:|"]
        for name in {r["name"]: None for r in gated}:
            runs = [r for r in gated if r["name"] == name]
            for r_step in range(1, 33):
                key = f"openness_r{r_step}"
                with_step = [r for r in runs if key in r["gates"]]
                if not with_step:
                    continue
                gates = [r["gates"][f"gate_mean_r{r_step}"] for r in with_step]
                opens = [r["gates"][key] for r in with_step]
                lines.append(f"| {name} | {r_step} | {statistics.mean(gates):.3f} ± {_sd(gates):.3f} | "
                             f"{statistics.mean(opens):.3f} ± {_sd(opens):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/exp")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batches", type=int, default=32,
                        help="validation batches, their windows spread over the whole split (0: all of it)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these variants")
    parser.add_argument("--data", default="stdlib", help="data source (stdlib, text:PATH, task:NAME)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else []
    done = {(r["name"], r["seed"]) for r in results}
    for seed in args.seeds:
        for name, (fields, steps) in variants(args.preset, args.seq_len, args.steps).items():
            if (args.only and name not in args.only) or (name, seed) in done:
                continue
            result = run_one(out, name, fields, steps, seed, args.preset, args.batch_size, args.eval_batches,
                             args.data)
            results.append(result)
            results_file.write_text(json.dumps(results, indent=2) + "\n")
            print(f"{name} seed {seed}: " + ", ".join(f"{k} {v['bpb']:.4f}" for k, v in result["scores"].items()),
                  flush=True)
    table = summarise(results)
    by_name: dict[str, list[dict]] = {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r)
    plot = plot_early_exit(early_exit_curves(by_name), out)
    if plot:
        table += f"\n\n![early exit]({plot})"
    (out / "results.md").write_text(f"# CPU comparison on {args.data} ({args.preset}, T={args.seq_len})\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
