"""`latentloop demo`: train every available architecture briefly on the same data, evaluate, sample,
print a comparison table and write a report (Markdown + loss plot) into the demo folder.

Measured in steps, not seconds: every architecture trains for the same fixed number of steps
(`DEMO_STEPS`, or `--steps`), so the figures are the same on every machine that trains in the same
precision (deterministic on the CPU: fp32, or bf16 autocast where the CPU has bf16 instructions, see
`runtime.resolve_dtype`) and only the time they take differs; a progress bar shows each run's ETA.
The loss is logged often enough for `CURVE_POINTS` points per curve.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .archs import ARCHS, get_arch, scoring_notes
from .config import DataConfig, RunConfig, TrainConfig, model_config
from .engine import generate
from .errors import ConfigError, LatentloopError, OutputError
from .util import pyplot, save_figure, write_json_atomic, write_text_atomic

DEMO_MARKER = "demo.json"  # a folder holding this file was written by the demo and may be replaced
REPORT, PLOT = "report.md", "loss.png"  # what else it writes beside the marker: a folder per arch
# Steps per architecture (the same for all, so every arch sees the same tokens), sized for a few
# minutes for every architecture together on a quiet 2-core CPU at the `tiny` preset with
# DEMO_BATCH_SIZE rows of 256 tokens; a new architecture adds its own share.
DEMO_STEPS = 120
# The whole demo of six at DEMO_STEPS there on 2026-12-01 (experiments/RESULTS.md, "First hour"):
# the duration `demo --help` promises is derived from it, so the two cannot drift apart again.
DEMO_MEASURED_S = 295
DEMO_DURATION = f"about {round(DEMO_MEASURED_S / 60)} minutes on 2 quiet cores"
DEMO_BATCH_SIZE = 8
CURVE_POINTS = 24  # logged training-loss points per curve (at least 20, as the report promises)
WARMUP_FRACTION = 0.1  # of the steps: the learning rate's warmup
EVAL_BATCHES = 4  # validation batches per scoring option (fbt soft and lrt sequential step token by token)
SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 160


def _check_folder(out: Path) -> None:
    """Refuse an --out the demo may not replace; changes nothing. An earlier demo's folder is
    replaced only while it holds nothing but what a demo writes (a file of the user's own put there
    was deleted with it)."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file; choose a folder")
    if out.exists() and any(out.iterdir()) and not (out / DEMO_MARKER).is_file():
        raise LatentloopError(f"{out} exists and was not written by the demo; choose another --out")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in {DEMO_MARKER, REPORT, PLOT, *ARCHS})
        if foreign:
            raise LatentloopError(f"{out} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which "
                                  f"the demo did not write and would delete with the earlier demo; move it, or "
                                  f"choose another --out")


def _prepare_folder(out: Path) -> None:
    """Empty --out for the new demo (an earlier demo's folder is replaced). Called only once every
    argument has been checked: a mistyped option must not cost the previous demo."""
    _check_folder(out)
    if out.exists() and any(out.iterdir()):
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create --out {out}: {exc.strerror or exc}") from None


def _check_data(configs: dict[str, RunConfig], progress: bool) -> None:
    """Read and tokenize the demo's data as every arch's setup will (into the token cache, where setup
    finds it again) and check that each arch's validation split holds a window. Parsing the source
    spec alone passed an empty file, a file that is not UTF-8, a source too small to validate on
    (`task:s5:n=1`): setup refused them only after the previous demo had been removed."""
    from .data import load_tokenizer
    from .runtime import prepare_data
    from .train.start import check_validation_split

    first = next(iter(configs.values()))  # the same DataConfig for every arch
    tokens = prepare_data(first, load_tokenizer(first.data.tokenizer), progress)
    for config in configs.values():
        check_validation_split(tokens.val, config)


def run_demo(out: Path, steps: int = DEMO_STEPS, data: str = "stdlib", preset: str = "tiny",
             archs: list[str] | None = None, progress: bool = True) -> list[dict[str, Any]]:
    archs = list(ARCHS) if archs is None else archs  # registration order: the baseline first
    if not archs:
        raise ConfigError(f"--archs names no arch: choose from {', '.join(sorted(ARCHS))}")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ConfigError(f"unknown arch(s) {', '.join(unknown)}: choose from {', '.join(sorted(ARCHS))}")
    twice = sorted({a for a in archs if archs.count(a) > 1})
    if twice:  # its second run would find the first's folder, after the first had trained
        raise ConfigError(f"--archs names {', '.join(twice)} more than once")
    if not (isinstance(steps, int) and steps >= 1):
        raise ConfigError(f"--steps must be a whole number >= 1, got {steps}")
    _check_folder(out)
    log_every = max(1, steps // CURVE_POINTS)
    # every arch's config and the data are checked before the folder is touched: a mistyped --preset
    # or --data, or data that cannot be trained on, found at the first arch's setup had already
    # removed the previous demo
    configs = {arch: RunConfig(model=model_config(arch, preset, tie_embeddings=True),  # fbt needs it: all alike
                               train=TrainConfig(steps=steps, batch_size=DEMO_BATCH_SIZE, eval_every=0,
                                                 eval_batches=EVAL_BATCHES, log_every=log_every,
                                                 warmup_steps=max(1, round(steps * WARMUP_FRACTION))),
                               data=DataConfig(source=data))
               for arch in archs}
    _check_data(configs, progress)
    _prepare_folder(out)
    write_json_atomic(out / DEMO_MARKER, {"status": "running", "archs": archs})
    results = []
    started = time.perf_counter()
    try:
        _run_archs(archs, configs, out, steps, progress, results)
    except BaseException as exc:  # a Ctrl+C or a failure: the marker said "running" forever after
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        write_json_atomic(out / DEMO_MARKER, {"status": status, "archs": archs,
                                              "finished": [summary["arch"] for summary in results]})
        raise
    _write_report(out, results, data, preset, steps, time.perf_counter() - started)
    return results


def _run_archs(archs, configs, out, steps, progress, results: list) -> None:
    """Train, score and sample each arch in turn, appending its summary to `results` as it ends."""
    from .train import fit, setup

    for number, arch in enumerate(archs, start=1):
        print(f"== {arch} ({number}/{len(archs)}): {steps} steps of {DEMO_BATCH_SIZE} rows")
        config = configs[arch]
        state = setup(config, out / arch, progress=progress)
        summary = fit(state, progress=progress)
        if summary.get("interrupted") or summary.get("validation_skipped"):  # a Ctrl+C, honoured and saved by
            raise KeyboardInterrupt  # fit: it stops the demo too (its report needed every run's val loss)
        summary["by_option"] = score_options(state)
        prompt = state.tokenizer.as_prompt(state.tokenizer.encode(SAMPLE_PROMPT))
        room = config.model.sequence_len - len(prompt)
        ids = generate(state.model, prompt, min(SAMPLE_TOKENS, room), temperature=0.8, top_k=50, seed=0,
                       stop_tokens=[state.tokenizer.bos_id, *state.tokenizer.stop_ids])
        notes = get_arch(arch).demo_lines(state.history, config.model)  # what the arch reports of its run
        if notes:
            summary["notes"] = notes
        summary.update(arch=arch, sample=SAMPLE_PROMPT + state.tokenizer.decode(ids),
                       history=[row for row in state.history if "loss" in row or "val_loss" in row])
        results.append(summary)


def score_options(state) -> dict[str, dict[str, float]]:
    """Validation loss/BPB under each of the model's evaluation options (fbt regimes, ...)."""
    from .eval.loss import score_run, text_batches

    cfg = state.config
    # a sample of the split: windows spread over all of it; documents at each BOS for the intervals
    batches = text_batches(state.data.val, cfg.train.batch_size, cfg.model.sequence_len, EVAL_BATCHES, spread=True,
                           bos_id=state.tokenizer.bos_id)
    return score_run(state.model, batches, state.tokenizer.token_byte_lengths())


def _interval(interval) -> str:
    """' [low, high]' (the bootstrap interval over documents), or nothing when there is none."""
    return f" [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else ""


def interval_note(results: list[dict[str, Any]]) -> str:
    """The report's note on the table's brackets: what they are where a row has one, else why no row
    has (the default demo's 18 validation documents are under `MIN_INTERVAL_DOCUMENTS`: a sentence
    about brackets under a table without any misled). The reasons are the rows' own "interval"."""
    from .eval.stats import CONFIDENCE

    rows = [scores for r in results for scores in r["by_option"].values()]
    reasons = "; ".join(dict.fromkeys(scores["interval"] for scores in rows
                                      if not scores.get("bpb_ci") and scores.get("interval")))
    if not any(scores.get("bpb_ci") for scores in rows):
        return "no interval of BPB" + (f": {reasons}" if reasons else "")
    note = f"in brackets, the {CONFIDENCE:.0%} bootstrap interval of BPB over the documents they cover"
    return note + (f" (none in a row without brackets: {reasons})" if reasons else "")


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| arch | params | steps | tokens | train s | scored as | val loss | val bpb |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        for label, scores in r["by_option"].items():
            lines.append(f"| {r['arch']} | {r['params']:,} | {r['step']} | {r['tokens']:,} | {r['elapsed']:.0f} | "
                         f"{label} | {scores['loss']:.4f} | {scores['bpb']:.4f}{_interval(scores.get('bpb_ci'))} |")
    return "\n".join(lines)


def _plot(out: Path, results: list[dict[str, Any]]) -> str | None:
    plt = pyplot()  # without it the report says how to get the plot
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        train = [(h["tokens"], h["loss"]) for h in r["history"] if "loss" in h]
        if train:
            ax.plot(*zip(*train), label=f"{r['arch']} train")
        ax.scatter([r["tokens"]], [r["val_loss"]], marker="o", label=f"{r['arch']} val")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("latentloop demo")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / PLOT, dpi=120)
    return PLOT


# What a run this short can and cannot show, written into every report after the size of its runs
# (`caveat`: the tokens and parameters these runs had, not a size fixed for the default demo's).
CAVEAT = ("the figures show that every architecture trains, scores and decodes through the same code, and "
          "how far each got in the same number of steps; they cannot rank the architectures (one seed, "
          "far from convergence) or say how they scale.")


def _span(values: list[int]) -> str:
    """'N' when every value is N, else 'LOW to HIGH' (thousands separated)."""
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,} to {high:,}"


def caveat(results: list[dict[str, Any]]) -> str:
    """`CAVEAT` after the tokens each architecture trained on and the models' parameter counts."""
    return (f"These are {_span([r['tokens'] for r in results])} training tokens per architecture on models of "
            f"{_span([r['params'] for r in results])} parameters: {CAVEAT}")


def _write_report(out: Path, results: list[dict[str, Any]], data: str, preset: str, steps: int,
                  seconds: float) -> None:
    table = _table(results)
    plot = _plot(out, results)
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    parts = [f"# latentloop demo\n\npreset `{preset}`, data `{data}`, {steps} steps of {DEMO_BATCH_SIZE} rows "
             f"per architecture, device {device}, {seconds:.0f} s in all\n", caveat(results), "",
             table, "", f"_val loss and BPB: {EVAL_BATCHES} validation batches of windows spread over the whole split; "
             f"{interval_note(results)}._", ""]
    parts += [line for note in scoring_notes(r["arch"] for r in results) for line in (f"_{note}._", "")]
    for r in results:
        parts += [line for note in r.get("notes", []) for line in (f"{r['arch']} {note}", "")]
    parts.append(f"![loss]({plot})\n" if plot else "(install the `plot` extra for a loss plot)\n")
    for r in results:
        parts += [f"## {r['arch']} sample\n", "```", r["sample"], "```", ""]
    write_text_atomic(out / REPORT, "\n".join(parts))
    slim = [{k: v for k, v in r.items() if k != "history"} for r in results]
    write_json_atomic(out / DEMO_MARKER, {"status": "done", "results": slim})
    print(table)
    print(f"report: {out / REPORT}")
