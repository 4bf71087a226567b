"""`eval` (loss, BPB and their intervals per scoring mode; task accuracy with --tasks; the loss by
position), `compare` and `analyze`."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from ..errors import CheckpointError, ConfigError, LatentloopError, OutputError
from .parser import generation_options, print_json
from .training import first_batches


def cmd_eval(args) -> int:
    from ..archs import get_arch
    from ..eval.loss import row_documents, score_run, text_batches
    from ..runs import load_run
    from ..runtime import eval_data, resolve_device

    if args.tasks is None and (args.limit is not None or args.eval_dir is not None):
        raise LatentloopError("--limit and --eval-dir apply to --tasks only")
    if args.tasks is not None and args.data is not None:
        raise LatentloopError("--data applies to the loss, not to --tasks")
    if args.tasks is not None:  # flags of the loss that --tasks would otherwise drop without a word
        given = [flag for flag, value in (("--split train", args.split != "val"), ("--batches", bool(args.batches)),
                                          ("--by-position", args.by_position is not None),
                                          ("--against", args.against is not None),
                                          ("--passes-curve", args.passes_curve)) if value]
        if given:
            raise LatentloopError(f"{', '.join(given)} apply to the loss, not to --tasks")
    if args.against is not None and args.by_position is None:
        raise LatentloopError("--against draws a base run beside --by-position; give --by-position BUCKETS")
    device = resolve_device(args.device)
    model, tokenizer, config, checkpoint = load_run(args.run, device)
    if args.quantize == "int8":  # the quality cost of int8 decoding: the same scores with int8 linears
        from ..engine import quantize_int8

        quantize_int8(model)
    if args.tasks is not None:  # task accuracy (CORE, generation), written to RUN/evals/
        from ..eval.core import DEFAULT_BATCH_SIZE
        from ..eval.suite import format_suite, run_folder, run_tasks

        run_dir = run_folder(args.run, checkpoint)
        step = _checkpoint_step(checkpoint)
        # a checkpoint named by path (not the run's latest) and a quantized model are kept apart from
        # the run's own results: their tag (file name) says so, and the file records both
        chosen = Path(args.run).resolve() != run_dir.resolve()
        result = run_tasks(model, tokenizer, args.tasks, data_dir=args.eval_dir,
                           options=generation_options(args, model), limit=args.limit,
                           progress=not args.no_progress, run_dir=run_dir,
                           batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
                           meta={"run": str(args.run), "checkpoint": str(checkpoint), "step": step,
                                 "arch": config.model.arch},
                           variant={"quantize": args.quantize, "step": step if chosen else None})
        if args.json:
            print_json({"run": str(args.run), "checkpoint": str(checkpoint), **result})
        else:
            print(format_suite(result))
            print(f"results: {run_dir / 'evals'}")
        return 0
    if args.passes_curve and not get_arch(config.model.arch).offers("passes_curve"):
        from ..archs import offering

        raise ConfigError(f"--passes-curve needs a run of {' or '.join(offering('passes_curve'))}; "
                          f"this one is {config.model.arch}")
    data = eval_data(config, tokenizer, args.data, checkpoint=checkpoint)
    tokens = data.val if args.split == "val" else data.train
    options = generation_options(args, model)
    from ..data.chat import ChatData

    chat = isinstance(data, ChatData)
    if chat and (args.by_position is not None or args.passes_curve):
        raise LatentloopError("--by-position and --passes-curve score plain text; this data is conversations")
    if args.by_position is not None:
        return _eval_by_position(args, model, tokens, config, checkpoint, options, tokenizer)
    # no options given: score every way the architecture offers (fbt regimes, lrt prefills, rgpt depths)
    if chat:  # the loss on the assistant's tokens, as SFT validates
        from ..data.chat import masked_batches

        def batches():  # each conversation a document of the intervals, where the packing started it
            return row_documents(masked_batches(tokens, args.batch_size or 16, args.batches or None), tokenizer.bos_id,
                                 tokens.starts)
    else:  # documents (for the intervals) start at each BOS of the stream
        batches = text_batches(tokens, args.batch_size or 16, config.model.sequence_len, args.batches or None,
                               bos_id=tokenizer.bos_id)
    # fbt's default eval scores three regimes: minutes on a large split. The bar is on stderr, under
    # --json too: its stdout stays one JSON document
    if not args.no_progress:
        batches = _with_progress(batches, tokens, args, config.model.sequence_len)
    by_option = score_run(model, batches, tokenizer.token_byte_lengths(), {"given": options} if options else None)
    overflowed = next(((label, scores["loss"]) for label, scores in by_option.items()
                       if not math.isfinite(scores["loss"])), None)
    if overflowed is not None:  # a figure of nan printed as a result, exit 0, read as a bad model, not a broken one
        label, loss = overflowed
        scored = "" if label == "given" else f" scored as {label}"
        raise CheckpointError(f"the loss of {checkpoint}{scored} on the {args.split} split is {loss}: its logits "
                              f"are not finite (NaN or inf); no figure to report")
    first = next(iter(by_option))
    metrics = {"run": str(args.run), "checkpoint": str(checkpoint), "split": args.split, "scored_as": first,
               "quantize": args.quantize, **by_option[first]}  # an int8 model's figures say so, as --tasks' do
    # what the figure covers, beside train's own (which scores the first train.eval_batches of this split)
    source = args.data or config.data.source
    scope = _scored_batches(args.batches, tokens, args.batch_size or 16, config.model.sequence_len)
    metrics["measured_on"] = (f"{by_option[first].get('tokens', 0):,} {'assistant ' if chat else ''}tokens of the "
                              f"{args.split} split of {source} ({scope}); train's val figure scores "
                              f"{first_batches(config.train.eval_batches)} of {config.train.batch_size} sequences")
    if len(by_option) > 1:
        metrics["by_option"] = by_option
    if args.passes_curve:
        from ..eval.loss import score_curve

        metrics["passes_curve"] = score_curve(model, get_arch(config.model.arch).curves["passes_curve"], tokens,
                                              tokenizer.token_byte_lengths(), args.batch_size or 16,
                                              config.model.sequence_len, args.batches or None,
                                              show_progress=not args.no_progress)
    notes = get_arch(config.model.arch).notes_for(by_option)
    if notes:
        metrics["notes"] = notes
    if args.json:
        print_json(metrics)
    else:
        skipped = {"by_option", "passes_curve", "notes", "loss_ci", "bpb_ci"}
        if not args.quantize:
            skipped.add("quantize")
        if metrics.get("loss_ci") is None and "interval" in metrics:  # no interval computed: a note says why
            skipped.add("interval")
            notes = [*notes, metrics["interval"]]
        for key, value in metrics.items():
            if key not in skipped:
                print((f"{key:>12}: {value:.4f}" if isinstance(value, float) else f"{key:>12}: {value}")
                      + _interval_text(metrics.get(f"{key}_ci")))
        for label, scores in metrics.get("by_option", {}).items():
            print(f"{label:>12}: loss {scores['loss']:.4f}{_interval_text(scores.get('loss_ci'))}  "
                  f"ppl {scores['ppl']:.3f}  bpb {scores['bpb']:.4f}{_interval_text(scores.get('bpb_ci'))}")
        if "passes_curve" in metrics:
            print("fused forward, loss by passes (the paper's stability check):")
            for label, scores in metrics["passes_curve"].items():
                print(f"{label:>12}: loss {scores['loss']:.4f}  bpb {scores['bpb']:.4f}")
        for note in notes:
            print(f"note: {note}")
    return 0


def _checkpoint_step(checkpoint: Path) -> int | None:
    """The training step of a checkpoint folder (its state.json, else its name step_N), None if unknown."""
    from ..checkpoint import step_in_name
    from ..util import is_int, read_json_object

    step = read_json_object(Path(checkpoint) / "state.json").get("step")
    return step if is_int(step) else step_in_name(checkpoint)


def _scored_batches(requested: int, tokens, batch_size: int, seq_len: int) -> str:
    """How much of the split the loss covers: every batch, or the first N when --batches left some
    out (a --batches beyond the split's count scored all of them, and says so)."""
    import math

    rows = len(tokens.tokens) if hasattr(tokens, "tokens") else max(0, (len(tokens) - 1) // seq_len)
    available = math.ceil(rows / batch_size)
    if not requested or requested >= available:
        return f"every batch, {available}" if requested else "every batch"
    return first_batches(requested)


def _interval_text(interval) -> str:
    """' [low, high]' after a figure that has an interval (eval's loss and BPB), else nothing."""
    return f" [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else ""


def _with_progress(batches, tokens, args, seq_len: int):
    """`batches` (a callable giving a pass over the scored batches) with a progress bar per pass."""
    import math

    from ..util import progress

    rows = len(tokens.tokens) if hasattr(tokens, "tokens") else max(0, (len(tokens) - 1) // seq_len)
    total = math.ceil(rows / (args.batch_size or 16))
    total = min(total, args.batches) if args.batches else total

    def with_bar():
        return progress(batches(), total=total, desc="eval batches")

    return with_bar


def _eval_by_position(args, model, tokens, config, checkpoint, options, tokenizer=None) -> int:
    from ..engine import model_options
    from ..eval.loss import decoding_logits, loss_by_position, plain_logits

    model_options(model, options)  # a bad option fails before any batch
    if args.by_position > config.model.sequence_len:
        from ..util import warn_once

        warn_once(f"--by-position {args.by_position}: a context of {config.model.sequence_len} positions makes at "
                  f"most {config.model.sequence_len} buckets, one position each")
    logits_fn = decoding_logits(options) if options else plain_logits
    batch_size = args.batch_size or 16
    base = _position_base(args, checkpoint, model, tokenizer)  # (path, model, context) or None, before any batch
    buckets = loss_by_position(model, tokens, batch_size, config.model.sequence_len, args.by_position,
                               args.batches or None, logits_fn)
    result = {"run": str(args.run), "checkpoint": str(checkpoint), "split": args.split, "quantize": args.quantize,
              "sequence_len": config.model.sequence_len, "by_position": buckets}
    if base is not None:
        path, base_model, context = base
        edges = [b["start"] for b in buckets] + [buckets[-1]["end"]]  # the same position ranges, up to its context
        # the run's own windows, each read by the base up to its context: the same text at the same positions
        result["base"] = {"run": str(path), "sequence_len": context, "by_position": loss_by_position(
            base_model, tokens, batch_size, context, max_batches=args.batches or None, edges=edges,
            window=config.model.sequence_len)}
    plot = _plot_by_position(result, args, checkpoint)
    if plot is not None:
        result["plot"] = str(plot)
    if args.json:
        print_json(result)
        return 0
    base_rows = {b["start"]: (b["loss"], b["end"]) for b in result.get("base", {}).get("by_position", [])}
    cut = []  # buckets the base's shorter context covers in part: beside the run's whole bucket, said so
    base_name = f"  {'base':>8}" if base is not None else ""
    print(f"loss by position ({args.split}, context {config.model.sequence_len}"
          + (f", {args.quantize} weights" if args.quantize else "")
          + (f"; base {result['base']['run']}, context {result['base']['sequence_len']}" if base else "") + "):")
    print(f"  {'positions':<13} {'this run':>8}{base_name}")
    for bucket in buckets:
        beside = ""
        if base is not None and bucket["start"] in base_rows:
            loss, end = base_rows[bucket["start"]]
            beside = f"  {loss:>8.4f}" + ("*" if end < bucket["end"] else "")
            if end < bucket["end"]:
                cut.append(f"* the base's figure covers positions {bucket['start']}-{end - 1} only (its context "
                           f"ends there), the run's {bucket['start']}-{bucket['end'] - 1}")
        elif base is not None:
            beside = f"  {'–':>8}"
        print(f"  {bucket['start']:>6}-{bucket['end'] - 1:<6} {bucket['loss']:>8.4f}{beside}")
    for line in cut:
        print(line)
    if plot is not None:
        print(f"plot: {plot}")
    return 0


def _position_base(args, checkpoint, model, tokenizer=None):
    """The base run to draw beside --by-position: --against, else the run this one started from
    (recorded in its checkpoint) when it is on this machine; None when there is none. Its tokenizer
    must read the tokens as this run's does: the same fingerprint (the same id mapping), not merely
    a vocabulary of the same size, else its losses are of other tokens (or its embedding is indexed
    past its end)."""
    from ..runs import load_run
    from ..runtime import resolve_device
    from ..util import read_json_object

    path = args.against
    if path is None:
        path = read_json_object(checkpoint / "state.json").get("init_from")
        if not isinstance(path, str) or not Path(path).exists():
            return None
    base_model, base_tokenizer, base_config, _ = load_run(path, resolve_device(args.device))
    if tokenizer is not None and base_tokenizer.fingerprint() != tokenizer.fingerprint():
        raise LatentloopError(f"--against {path}: its tokenizer ({base_tokenizer.fingerprint()}) is not this run's "
                              f"({tokenizer.fingerprint()}); its loss by position would be of other tokens")
    if base_config.model.vocab_size > model.config.vocab_size:
        raise LatentloopError(f"--against {path}: its vocabulary ({base_config.model.vocab_size} tokens) is not this "
                              f"run's ({model.config.vocab_size})")
    return path, base_model, base_config.model.sequence_len


def _plot_by_position(result: dict, args, checkpoint) -> Path | None:
    """RUN/evals/loss_by_position.png: the loss per position range of the run and of its base; None
    without matplotlib."""
    from ..eval.suite import EVALS_DIR, run_folder
    from ..util import pyplot, save_figure

    plt = pyplot("loss_by_position.png")
    if plt is None:
        return None

    folder = run_folder(args.run, checkpoint) / EVALS_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write into {folder}: {exc.strerror or exc}") from None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, curve in (("this run", result), ("base", result.get("base"))):
        if curve:
            rows = curve["by_position"]
            ax.plot([(b["start"] + b["end"] - 1) / 2 for b in rows], [b["loss"] for b in rows], marker="o",
                    label=f"{label} (context {curve['sequence_len']})")
    if result.get("base"):
        ax.axvline(result["base"]["sequence_len"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("position in the context")
    ax.set_ylabel("mean loss (nats / token)")
    ax.set_title(f"loss by position ({result['split']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = folder / "loss_by_position.png"
    save_figure(fig, path, dpi=120)
    return path


def cmd_compare(args) -> int:
    from ..eval.compare import compare_runs

    try:  # compare_runs makes --out once the runs and the baseline have been read (a refusal leaves none)
        report = compare_runs(args.runs, args.out, args.baseline, show_progress=not args.no_progress)
    except OSError as exc:  # the folder was writable a moment ago: a full disk, a file dropped in the way
        raise OutputError(f"cannot write the report into {args.out}: {exc.strerror or exc}") from None
    print(report["markdown"])
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(f"report: {report['report']}")
    return 0



def cmd_analyze(args) -> int:
    from ..analysis import available, run_analysis
    from ..runtime import output_folder

    if args.out:  # before the analysis runs, not after
        output_folder(args.out, "--out")
    options = {k[len("analysis_"):]: v for k, v in vars(args).items() if k.startswith("analysis_")}
    show = not args.no_progress  # the long ones (1000 passes, accuracy at every depth): on stderr, --json too
    result = run_analysis(args.analysis, args.run, batches=args.batches, out=Path(args.out) if args.out else None,
                          show_progress=show, data=args.data, **options)
    summary = available()[args.analysis].summary(result)
    if args.json:  # strict JSON, as the analysis file: NaN as null
        print_json(result)
    else:
        print(summary)
        print(f"written to {result['folder']}")
    return 0


