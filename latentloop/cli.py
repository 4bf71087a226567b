"""The `latentloop` command line: train, eval, generate, tokenizer, analyze, compare, demo, serve,
import-hf, export, export-dcp.

Every user mistake ends in one line on stderr (`latentloop: error: ...`) and exit code 2, with no
traceback; anything else is a bug and keeps its traceback. Under torchrun the line is printed once:
an error every process raised alike (agreed on, or raised before the processes could talk) is
printed by rank 0 alone; an error of one process alone names its rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import CheckpointError, ConfigError, LatentloopError, OutputError

EXIT_USAGE = 2
# A process whose peers vanished mid-collective waits this long for torchrun to stop it: the peer
# that failed first has printed the cause, and torchrun ends the others within its monitor interval.
PEER_GRACE_S = 10.0
DEFAULT_NEW_TOKENS = 64  # generate's default budget, capped at half the context (the prompt gets the rest)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (the default prints the whole usage first)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"latentloop: error: {message} (see '{self.prog} --help')\n")


def _int_at_least(minimum: int, description: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {description}, got {text!r}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _add_decode_options(p: argparse.ArgumentParser) -> None:
    """How generate and chat decode: the compiled static-cache step where it pays (default), always, or never."""
    p.add_argument("--decode", choices=["auto", "compiled", "eager"], default="auto",
                   help="auto: decode the first steps eagerly, timing them, and compile the step when the saving "
                        "over the budget reaches the compile's expected cost (latentloop.models.fast.AutoCompile; "
                        "compiled steps are cached on disk for later processes); compiled: always; eager: never")
    p.add_argument("--compile", dest="decode", action="store_const", const="compiled",
                   help="the same as --decode compiled")
    p.add_argument("--no-compile", dest="decode", action="store_const", const="eager",
                   help="the same as --decode eager")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: weight-only int8 linear layers (per output channel, symmetric), for speed and memory")


def _decode_mode(args) -> bool | str:
    """The engine's `compile=` for --decode."""
    return {"auto": "auto", "compiled": True, "eager": False}[args.decode]


def _say_compiling(message: str) -> None:
    print(f"[{message}]", file=sys.stderr, flush=True)


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    """One flag per inference option any architecture declares (its `ArchSpec`); the value is
    parsed and checked against the loaded model's arch later, so a flag of another arch is a
    one-line error. None means 'not given' (the model's default)."""
    from .archs import option_union

    for name, (option, archs) in option_union().items():
        p.add_argument(option.flag, dest=f"option_{name}", default=None, metavar=_metavar(option),
                       help=f"[{', '.join(archs)}] {option.help}")


def _add_sampling_options(p: argparse.ArgumentParser, temperature: float) -> None:
    """The sampling flags of generate and chat (their default temperature differs)."""
    p.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default {temperature:g})")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")


def _metavar(option) -> str:
    if option.choices:
        return "{" + ",".join(option.choices) + "}"
    return option.kind.__name__.upper() + "".join(f"|{word}" for word in option.keywords)


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from .serve import settings as defaults

    p.add_argument("run", help="run folder or checkpoint folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback only; any other needs an API key)")
    p.add_argument("--port", type=_non_negative_int, default=8000,
                   help="port, at most 65535 (default 8000; 0: any free port, printed at start)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda[:N], mps")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${defaults.API_KEY_ENV} when set)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the run folder's name)")
    p.add_argument("--max-tokens-cap", type=_positive_int, default=defaults.DEFAULT_MAX_TOKENS_CAP,
                   help=f"largest max_tokens a request may ask for (default {defaults.DEFAULT_MAX_TOKENS_CAP})")
    p.add_argument("--max-batch-size", type=_positive_int, default=defaults.DEFAULT_MAX_BATCH_SIZE,
                   help=f"rows decoded together, and the most one request may ask for (prompts x n); 1 turns "
                        f"batching off (default {defaults.DEFAULT_MAX_BATCH_SIZE})")
    p.add_argument("--max-queue", type=_positive_int, default=defaults.DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait for a batch; more get 429 (default {defaults.DEFAULT_MAX_QUEUE})")
    p.add_argument("--batching", choices=defaults.BATCHING, default=defaults.BATCHING[0],
                   help="continuous: requests join the running batch at its next decode step and leave when done; "
                        "rounds: a batch of the requests waiting, run to its end while new ones wait (default "
                        f"{defaults.BATCHING[0]})")
    p.add_argument("--batch-window-ms", type=float, default=defaults.DEFAULT_BATCH_WINDOW_MS,
                   help=f"how long an idle server waits for more requests before it starts a batch (default "
                        f"{defaults.DEFAULT_BATCH_WINDOW_MS:g})")
    p.add_argument("--request-timeout", type=float, default=defaults.DEFAULT_REQUEST_TIMEOUT_S,
                   help=f"seconds a request may take, waiting included, before it ends with 504 (default "
                        f"{defaults.DEFAULT_REQUEST_TIMEOUT_S:g})")
    p.add_argument("--access-log", action="store_true", help="log every request")


def build_parser() -> argparse.ArgumentParser:
    from .archs import ARCHS

    parser = _Parser(prog="latentloop", description="Train, evaluate and sample latent-state language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a model into a run folder")
    t.add_argument("--config", help="YAML file with sections model/train/data")
    t.add_argument("--arch", help="architecture: " + "; ".join(
        f"{spec.name}: {spec.summary}" for spec in ARCHS.values()))
    t.add_argument("--preset", help="model size preset: test, tiny, small, gpt2, 1b")
    t.add_argument("--data", help="data source: stdlib, text:PATH, hf:NAME[:CONFIG], task:NAME")
    t.add_argument("--tokenizer", help="'byte' or a path to a tokenizer.json")
    t.add_argument("--steps", type=_positive_int, help="optimizer steps")
    t.add_argument("--batch-size", type=_positive_int, help="sequences per micro-batch")
    t.add_argument("--lr", type=float, help="peak learning rate")
    t.add_argument("--seed", type=int, help="random seed")
    t.add_argument("--device", help="auto, cpu, cuda[:N], mps")
    t.add_argument("--out", required=True, help="run folder to create (or continue with --resume)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    t.add_argument("--init-from", metavar="RUN",
                   help="start from another run's weights; from a gpt run (e.g. imported with import-hf) "
                        "--arch fbt / lrt / rgpt upcycles it; the model shape and the tokenizer come from RUN")
    t.add_argument("--stage", choices=["pretrain", "sft", "extend"], default=None,
                   help="sft: fine-tune --init-from RUN on conversations (--data chat:FILE[:field=role,...] or "
                        "chat:task:NAME), loss on the assistant's tokens only; extend: continue --init-from RUN at a "
                        "longer context (--set sequence_len=N; rope_theta scaled). Both start from the base run's "
                        "config and tokenizer")
    t.add_argument("--iso", choices=["flops", "params"], default=None,
                   help="rgpt: shape the recurrent model from the preset's dense depth at equal FLOPs (same "
                        "effective depth) or equal parameters (same distinct blocks); prints both models' sizes")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set n_layer=4 or --set train.lr=1e-3 (repeatable)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print the final summary as JSON")

    e = sub.add_parser("eval", help="validation loss / perplexity / bits per byte of a run, or task accuracy (--tasks)")
    e.add_argument("run", help="run folder or checkpoint folder")
    e.add_argument("--json", action="store_true", help="print the metrics as JSON")
    e.add_argument("--split", choices=["val", "train"], default="val", help="data split to evaluate")
    e.add_argument("--batches", type=_non_negative_int, default=0, help="evaluate at most this many batches (0: all)")
    e.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: score the model with weight-only int8 linear layers (as generate --quantize int8)")
    e.add_argument("--batch-size", type=_positive_int, default=None,
                   help="sequences per batch (default 16 for the loss, 64 rows for --tasks)")
    e.add_argument("--device", default="cpu", help="cpu, cuda[:N], mps")
    e.add_argument("--data", default=None, metavar="SOURCE",
                   help="data to score the loss on (text:PATH, hf:NAME, ...); required unless the run was trained "
                        "on a built-in source (stdlib, task:NAME): the files a run's config.json names are not "
                        "read on its say-so")
    e.add_argument("--tasks", default=None, metavar="NAMES|core",
                   help="evaluate tasks instead of the loss: 'core' (the 22 CORE tasks), CORE task names and/or "
                        "generation tasks, comma-separated; results go to RUN/evals/")
    e.add_argument("--by-position", type=_positive_int, default=None, metavar="BUCKETS",
                   help="the loss per position: mean loss of the targets in each of BUCKETS equal ranges of the "
                        "context (does a model extended to a longer context use it?)")
    e.add_argument("--limit", type=_positive_int, default=None, help="with --tasks: at most N examples per task")
    e.add_argument("--eval-dir", default=None, metavar="PATH",
                   help="with --tasks: folder of the task jsonl files (default: $LATENTLOOP_EVAL_DIR, else the "
                        "cached official bundle, fetched once when online)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.add_argument("--passes-curve", action="store_true",
                   help="fbt: also the loss of the K-pass fused forward for K = 1, 2, 3, 4, 8, 16 and at the "
                        "sequential fixed point (K = T passes, exact): the paper's stability check")
    _add_generation_options(e)

    g = sub.add_parser("generate", help="continue a prompt with a trained model")
    g.add_argument("run", help="run folder or checkpoint folder")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=_non_negative_int, default=None,
                   help=f"tokens to generate (default: {DEFAULT_NEW_TOKENS}, at most half the model's context)")
    _add_sampling_options(g, temperature=0.8)
    g.add_argument("--no-cache", action="store_true", help="use the naive uncached reference path")
    _add_decode_options(g)
    g.add_argument("--json", action="store_true", help="print prompt, completion and token ids as JSON")
    g.add_argument("--device", default="cpu", help="cpu, cuda[:N], mps")
    _add_generation_options(g)

    ch = sub.add_parser("chat", help="talk to an SFT run: type a message, the reply streams; /reset starts over, "
                                     "/quit (or end of input) ends")
    ch.add_argument("run", help="run folder or checkpoint folder (trained with --stage sft)")
    ch.add_argument("--system", default=None, help="a system message to start every conversation with")
    ch.add_argument("--max-new-tokens", type=_positive_int, default=None,
                    help=f"reply budget (default: {DEFAULT_NEW_TOKENS}, at most half the model's context)")
    _add_sampling_options(ch, temperature=0.0)
    _add_decode_options(ch)
    ch.add_argument("--device", default="cpu", help="cpu, cuda[:N], mps")
    _add_generation_options(ch)

    k = sub.add_parser("tokenizer", help="tokenizer tools")
    ksub = k.add_subparsers(dest="tokenizer_command", required=True, parser_class=_Parser)
    kt = ksub.add_parser("train", help="train a byte-level BPE tokenizer")
    kt.add_argument("--data", required=True, help="data source: stdlib, text:PATH, hf:NAME[:CONFIG]")
    kt.add_argument("--vocab-size", type=_positive_int, required=True, help="vocabulary size (>= 259)")
    kt.add_argument("--out", required=True, help="output tokenizer.json file or folder (an existing tokenizer file "
                                                 "is never overwritten)")
    kt.add_argument("--max-bytes", type=_non_negative_int, default=20_000_000,
                    help="read at most this many bytes of training text (0: all)")

    a = sub.add_parser("analyze", help="look inside a trained run (fbt contraction and probes, rgpt depth)")
    asub = a.add_subparsers(dest="analysis", required=True, parser_class=_Parser)
    ac = asub.add_parser("contraction", help="fbt: iterate the multi-pass map; relative change and loss per pass")
    ac.add_argument("--passes", type=_positive_int, default=1000, help="passes to iterate")
    ap = asub.add_parser("probe", help="fbt: linear probes of nesting depth from layer 0, standard vs recurrent")
    ap.add_argument("--passes", type=_positive_int, default=4, help="passes of the recurrent prefill")
    ad = asub.add_parser("depth", help="rgpt: early-exit curve, gate per step, exit depth vs token loss")
    ad.add_argument("--max-steps", type=_positive_int, default=None, help="evaluate r = 1..this (default: trained R)")
    ad.add_argument("--exit-threshold", type=float, default=0.01, help="KL threshold of the adaptive exit")
    ad.add_argument("--min-steps", type=_positive_int, default=1, help="steps before any exit")
    ad.add_argument("--task-limit", type=_positive_int, default=50,
                    help="for runs trained on task:NAME, test examples scored at each depth")
    for sp in (ac, ap, ad):
        sp.add_argument("run", help="run folder or checkpoint folder")
        sp.add_argument("--batches", type=_positive_int, default=None, help="validation batches to use")
        sp.add_argument("--out", default=None, help="output folder (default: RUN/analysis)")
        sp.add_argument("--json", action="store_true", help="print the result as JSON")

    i = sub.add_parser("import-hf", help="import a Hugging Face Llama-family checkpoint (llama, mistral, qwen2) "
                                         "as a gpt run")
    i.add_argument("source", metavar="PATH", help="a local model folder (config.json, *.safetensors, "
                                                  "tokenizer.json) or a Hub name org/name")
    i.add_argument("--out", required=True, help="run folder to create")
    i.add_argument("--sequence-len", type=_positive_int, default=None,
                   help="context of the run (default: the model's max_position_embeddings)")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")

    x = sub.add_parser("export", help="export a run as a Hugging Face model folder")
    x.add_argument("run", help="run folder or checkpoint folder")
    x.add_argument("--format", choices=["hf"], default="hf", help="output format (hf: transformers)")
    x.add_argument("--out", required=True, help="folder to create")
    kind = x.add_mutually_exclusive_group()
    kind.add_argument("--plain", action="store_true",
                      help="require a plain LlamaForCausalLM / Qwen2ForCausalLM (error if the run's options block it)")
    kind.add_argument("--remote-code", action="store_true",
                      help="always ship latentloop's own modeling code (trust_remote_code=True)")
    x.add_argument("--json", action="store_true", help="print the summary as JSON")

    d = sub.add_parser("demo", help="train every architecture briefly, compare, sample, write a report")
    d.add_argument("--steps", type=int, default=None,
                   help="training steps per architecture (default: the demo's own, about 4 minutes on 2 quiet cores)")
    d.add_argument("--out", default="runs/demo", help="folder for the runs and the report (replaced)")
    d.add_argument("--data", default="stdlib", help="data source")
    d.add_argument("--preset", default="tiny", help="model size preset")
    d.add_argument("--archs", default=None, help="comma-separated architectures (default: all available)")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")

    sv = sub.add_parser("serve", help="an OpenAI-compatible completions server for a run (pip install "
                                      "'latentloop[serve]')")
    _add_serve_arguments(sv)

    x = sub.add_parser("export-dcp", help="write model.safetensors for a checkpoint that holds sharded weights only "
                                          "(an fsdp2 run saved with train.full_weights=false)")
    x.add_argument("run", help="run folder (its latest checkpoint) or checkpoint folder")
    x.add_argument("--force", action="store_true", help="write it again even if the checkpoint has one")

    c = sub.add_parser("compare", help="compare runs: params, tokens, FLOPs, loss, BPB, CORE and task accuracy")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    c.add_argument("--out", default="compare", help="folder for compare.md and the loss plots (default: ./compare)")
    c.add_argument("--baseline", default=None, metavar="NAME",
                   help="the group (runs differing only in seed) or run the paired differences are taken against "
                        "(default: the first)")
    return parser


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def _run_config_from_args(args):
    from .config import RunConfig, apply_overrides, load_yaml

    saved = Path(args.out) / "config.json"
    if args.stage in ("sft", "extend") and not args.config and not args.resume:
        from .train import stage_config

        if not args.init_from:
            raise LatentloopError(f"--stage {args.stage} continues a trained run: give --init-from RUN")
        if args.arch or args.preset or args.tokenizer:
            raise LatentloopError(f"--stage {args.stage} keeps the base run's arch, shape and tokenizer: drop "
                                  f"--arch/--preset/--tokenizer")
        flags = {"train.steps": args.steps, "train.batch_size": args.batch_size, "train.lr": args.lr,
                 "train.seed": args.seed, "train.device": args.device}
        return stage_config(args.stage, args.init_from, args.overrides, data=args.data, flags=flags)
    if args.config:
        raw = load_yaml(args.config)
    elif args.resume and saved.is_file():
        try:
            raw = json.loads(saved.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot resume: {saved} is unreadable or cut short ({exc})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"cannot resume: {saved} does not hold a run config")
    else:
        raw = {}
    raw = {s: dict(raw.get(s) or {}) for s in ("model", "train", "data")} | {
        k: v for k, v in raw.items() if k not in ("model", "train", "data")}
    flags = {"model.arch": args.arch, "model.preset": args.preset, "data.source": args.data,
             "data.tokenizer": args.tokenizer, "train.steps": args.steps, "train.batch_size": args.batch_size,
             "train.lr": args.lr, "train.seed": args.seed, "train.device": args.device, "train.stage": args.stage}
    for key, value in flags.items():
        if value is not None:
            section, name = key.split(".")
            raw[section][name] = value
    if args.init_from and not (args.resume and saved.is_file()):
        _inherit_from_run(raw, args.init_from)
    elif not raw["model"].get("preset") and not args.config and not (args.resume and saved.is_file()):
        raw["model"]["preset"] = "tiny"
    return RunConfig.from_dict(apply_overrides(raw, args.overrides))


def _inherit_from_run(raw: dict, run: str) -> None:
    """--init-from: the model's shape and options, and the tokenizer, come from that run (a config
    file's model fields and --set still override them)."""
    from .checkpoint import find_tokenizer_file, resolve_checkpoint
    from .interop.upcycle import upcycle_fields

    if raw["model"].get("preset"):
        raise LatentloopError("--preset does not combine with --init-from (the model's shape comes from that run)")
    raw["model"] = upcycle_fields(run, raw["model"].get("arch")) | raw["model"]
    raw["data"].setdefault("tokenizer", str(find_tokenizer_file(resolve_checkpoint(run))))


def _first_batches(count: int) -> str:
    """How much of a split a loss covers: `count` batches from its start (0: all of them)."""
    return f"the first {count} batches" if count else "every batch"


def cmd_train(args) -> int:
    import os

    from .train import fit, setup

    config = _run_config_from_args(args)
    if args.iso:
        config = _iso_shaped(config, args.iso, show=os.environ.get("RANK", "0") in ("", "0"))  # once per job
    if config.train.stage == "extend" and args.init_from and os.environ.get("RANK", "0") in ("", "0"):
        from .checkpoint import read_run_config, resolve_checkpoint

        base = read_run_config(resolve_checkpoint(args.init_from)).model
        print(f"extend: context {base.sequence_len} -> {config.model.sequence_len}, RoPE base (rope_theta) "
              f"{base.rope_theta:g} -> {config.model.rope_theta:g}", file=sys.stderr)
    state = setup(config, args.out, resume=args.resume, progress=not args.no_progress, init_from=args.init_from)
    if state.init_report is not None:
        report = state.init_report
        print(f"initialised from {args.init_from} ({report['source_arch']} -> {config.model.arch}): "
              f"{report['mapping']}; {len(report['new'])} new tensors"
              + (f"; exact at step 0: {report['exact_at_step0']}" if "exact_at_step0" in report else ""),
              file=sys.stderr)
    summary = fit(state, progress=not args.no_progress)
    if not state.dist.is_main:  # rank 0 reports for the job
        return 0
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"trained {config.model.arch} ({summary['params']:,} params) for {summary['step']} steps, "
              f"{summary['tokens']:,} tokens: val loss {summary['val_loss']:.4f}, bpb {summary['val_bpb']:.4f} "
              f"(on {summary.get('val_tokens', 0):,} tokens: {_first_batches(config.train.eval_batches)} of the val "
              f"split; `latentloop eval` scores all of it); checkpoint {summary['checkpoint']}")
    return 0


def _iso_shaped(config, iso: str, show: bool = True):
    """Reshape a config whose arch trades depth for compute (its `iso_fields`) from its dense depth;
    print params and FLOPs/token of both (`show`)."""
    import dataclasses

    from .archs import ARCHS, build_model
    from .config import ModelConfig, model_config

    shape = config.model.iso_fields(iso)
    if shape is None:
        able = [name for name, spec in ARCHS.items() if spec.config_class.iso_fields is not ModelConfig.iso_fields]
        raise LatentloopError(f"--iso applies to an arch whose depth recurs ({', '.join(able)}); "
                              f"this one is {config.model.arch}")
    dense_layers = config.model.n_layer
    fields = {f.name: getattr(config.model, f.name) for f in dataclasses.fields(config.model)
              if f.name not in shape and f.name != "n_layer"}
    reshaped = model_config(config.model.arch, None, **fields, **shape)
    config.model = reshaped
    if not show:
        return config
    dense_fields = {f.name: fields[f.name] for f in dataclasses.fields(ModelConfig) if f.name in fields}
    dense = build_model(ModelConfig(**{**dense_fields, "n_layer": dense_layers}))
    recurrent = build_model(reshaped)
    T = reshaped.sequence_len
    dense_flops, recurrent_flops = dense.flops_per_token(T), recurrent.flops_per_token(T)
    matched = f"{dense_layers} " + ("block applications per token" if iso == "flops" else "distinct blocks")
    print(f"iso {iso} ({matched} in both): dense {ModelConfig.arch} {dense_layers} layers: "
          f"{dense.num_params():,} params, {dense_flops:,.0f} FLOPs/token (fwd+bwd)")
    print(f"iso {iso}: {reshaped.arch} {reshaped.depth_summary()}: {recurrent.num_params():,} params "
          f"({recurrent.num_params() / dense.num_params():.2f}x), {recurrent_flops:,.0f} FLOPs/token at R "
          f"({recurrent_flops / dense_flops:.2f}x" + ("; the rest is the recurrence's own projection and gate, "
                                                      "once per step)" if iso == "flops" else ")"))
    return config


def _generation_options(args) -> dict:
    """The option flags given on the command line, parsed by their declarations."""
    from .archs import option_union

    return {name: option.parse(getattr(args, f"option_{name}")) for name, (option, _) in option_union().items()
            if getattr(args, f"option_{name}", None) is not None}


def cmd_eval(args) -> int:
    from .archs import get_arch
    from .eval.loss import row_documents, score_run, text_batches
    from .runtime import eval_data, load_run, resolve_device

    if args.tasks is None and (args.limit is not None or args.eval_dir is not None):
        raise LatentloopError("--limit and --eval-dir apply to --tasks only")
    if args.tasks is not None and args.data is not None:
        raise LatentloopError("--data applies to the loss, not to --tasks")
    device = resolve_device(args.device)
    model, tokenizer, config, checkpoint = load_run(args.run, device)
    if args.quantize == "int8":  # the quality cost of int8 decoding: the same scores with int8 linears
        from .engine import quantize_int8

        quantize_int8(model)
    if args.tasks is not None:  # task accuracy (CORE, generation), written to RUN/evals/
        from .eval.core import DEFAULT_BATCH_SIZE
        from .eval.suite import format_suite, run_folder, run_tasks

        run_dir = run_folder(args.run, checkpoint)
        result = run_tasks(model, tokenizer, args.tasks, data_dir=args.eval_dir, options=_generation_options(args),
                           limit=args.limit, progress=not args.no_progress and not args.json, run_dir=run_dir,
                           batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
                           meta={"run": str(args.run), "checkpoint": str(checkpoint), "arch": config.model.arch})
        if args.json:
            print(json.dumps({"run": str(args.run), "checkpoint": str(checkpoint), **result}, indent=2, default=str))
        else:
            print(format_suite(result))
            print(f"results: {run_dir / 'evals'}")
        return 0
    if args.passes_curve and "passes_curve" not in get_arch(config.model.arch).analyses:
        from .archs import offering

        raise ConfigError(f"--passes-curve needs a run of {' or '.join(offering('passes_curve'))}; "
                          f"this one is {config.model.arch}")
    data = eval_data(config, tokenizer, args.data, checkpoint=checkpoint)
    tokens = data.val if args.split == "val" else data.train
    options = _generation_options(args)
    from .data.chat import ChatData

    chat = isinstance(data, ChatData)
    if chat and (args.by_position is not None or args.passes_curve):
        raise LatentloopError("--by-position and --passes-curve score plain text; this data is conversations")
    if args.by_position is not None:
        return _eval_by_position(args, model, tokens, config, checkpoint, options)
    # no options given: score every way the architecture offers (fbt regimes, lrt prefills, rgpt depths)
    if chat:  # the loss on the assistant's tokens, as SFT validates
        from .data.chat import masked_batches

        def batches():  # each conversation a document of the intervals
            return row_documents(masked_batches(tokens, args.batch_size or 16, args.batches or None), tokenizer.bos_id)
    else:  # documents (for the intervals) start at each BOS of the stream
        batches = text_batches(tokens, args.batch_size or 16, config.model.sequence_len, args.batches or None,
                               bos_id=tokenizer.bos_id)
    if not args.no_progress and not args.json:  # fbt's default eval scores three regimes: a minute or more
        batches = _with_progress(batches, tokens, args, config.model.sequence_len)
    by_option = score_run(model, batches, tokenizer.token_byte_lengths(), {"given": options} if options else None)
    first = next(iter(by_option))
    metrics = {"run": str(args.run), "checkpoint": str(checkpoint), "split": args.split, "scored_as": first,
               **by_option[first]}
    # what the figure covers, beside train's own (which scores the first train.eval_batches of this split)
    source = args.data or config.data.source
    scope = _first_batches(args.batches)
    metrics["measured_on"] = (f"{by_option[first].get('tokens', 0):,} {'assistant ' if chat else ''}tokens of the "
                              f"{args.split} split of {source} ({scope}); train's val figure scores "
                              f"{_first_batches(config.train.eval_batches)} of {config.train.batch_size}")
    if len(by_option) > 1:
        metrics["by_option"] = by_option
    if args.passes_curve:
        from .eval.loss import passes_curve

        metrics["passes_curve"] = passes_curve(model, tokens, tokenizer.token_byte_lengths(), args.batch_size or 16,
                                               config.model.sequence_len, args.batches or None)
    notes = get_arch(config.model.arch).notes_for(by_option)
    if notes:
        metrics["notes"] = notes
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        for key, value in metrics.items():
            if key not in ("by_option", "passes_curve", "notes", "loss_ci", "bpb_ci"):
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


def _interval_text(interval) -> str:
    """' [low, high]' after a figure that has an interval (eval's loss and BPB), else nothing."""
    return f" [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else ""


def _with_progress(batches, tokens, args, seq_len: int):
    """`batches` (a callable giving a pass over the scored batches) with a progress bar per pass."""
    import math

    from .util import progress

    rows = len(tokens.tokens) if hasattr(tokens, "tokens") else max(0, (len(tokens) - 1) // seq_len)
    total = math.ceil(rows / (args.batch_size or 16))
    total = min(total, args.batches) if args.batches else total

    def with_bar():
        return progress(batches(), total=total, desc="eval batches")

    return with_bar


def _eval_by_position(args, model, tokens, config, checkpoint, options) -> int:
    from .engine import model_options
    from .eval.loss import decoding_logits, loss_by_position, plain_logits

    model_options(model, options)  # a bad option fails before any batch
    logits_fn = decoding_logits(options) if options else plain_logits
    buckets = loss_by_position(model, tokens, args.batch_size or 16, config.model.sequence_len, args.by_position,
                               args.batches or None, logits_fn)
    if args.json:
        print(json.dumps({"run": str(args.run), "checkpoint": str(checkpoint), "split": args.split,
                          "sequence_len": config.model.sequence_len, "by_position": buckets}, indent=2))
        return 0
    print(f"loss by position ({args.split}, context {config.model.sequence_len}):")
    for bucket in buckets:
        print(f"  {bucket['start']:>6}-{bucket['end'] - 1:<6} {bucket['loss']:.4f}")
    return 0


def cmd_compare(args) -> int:
    from .eval.compare import compare_runs
    from .runtime import output_folder

    output_folder(args.out, "--out")
    try:
        report = compare_runs(args.runs, args.out, args.baseline)
    except OSError as exc:  # the folder was writable a moment ago: a full disk, a file dropped in the way
        raise OutputError(f"cannot write the report into {args.out}: {exc.strerror or exc}") from None
    print(report["markdown"])
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(f"report: {report['report']}")
    return 0


def cmd_generate(args) -> int:
    from .engine import model_options, quantize_int8, row_info, stream
    from .runtime import load_run, resolve_device
    from .util import TokenText

    device = resolve_device(args.device)
    model, tokenizer, _, _ = load_run(args.run, device)
    if args.quantize == "int8":
        quantize_int8(model)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise LatentloopError(f"--top-p must be in (0, 1], got {args.top_p}")
    # The engine fills in the defaults itself: hand it only what the user gave (checked here first, so
    # a bad option fails before any work). Handing it the filled-in dict made every fbt run fail, the
    # default `passes` read as given beside regime soft.
    options = _generation_options(args)
    model_options(model, options, cached=not args.no_cache)
    context = model.config.sequence_len
    max_new = args.max_new_tokens if args.max_new_tokens is not None else min(DEFAULT_NEW_TOKENS, context // 2)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise LatentloopError("--prompt is not valid UTF-8 text") from None
    prompt_ids = [tokenizer.bos_id] + tokenizer.encode(args.prompt)
    if args.max_new_tokens is None and len(prompt_ids) < context:  # the default budget fits what is left
        max_new = min(max_new, context - len(prompt_ids))
    steps = stream(model, prompt_ids, max_new, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, stop_tokens=[tokenizer.eos_id, tokenizer.bos_id], use_cache=not args.no_cache,
                   pad_id=tokenizer.pad_id, compile=_decode_mode(args), on_compile=_say_compiling, **options)
    ids, info = [], {}
    decoder = TokenText(tokenizer)
    if not args.json:  # the prompt is echoed once the arguments are known to be valid
        sys.stdout.write(args.prompt)
    for step in steps:
        token = step.tokens[0]
        ids.append(token)
        info = row_info(step.info, 0)
        if not args.json:
            sys.stdout.write(decoder.add(token))  # whole characters only
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"prompt": args.prompt, "completion": tokenizer.decode(ids), "ids": ids,
                          "prompt_tokens": len(prompt_ids), "new_tokens": len(ids), **info}))
    else:
        sys.stdout.write(decoder.finish() + "\n")
        if "prefill_passes" in info:
            print(f"[prefill passes used: {info['prefill_passes']}]", file=sys.stderr)
    return 0


CHAT_COMMANDS = "/reset starts a new conversation, /quit ends (so does end of input)"


def _read_message_line() -> tuple[str, bool]:
    """A line of stdin ("" at its end) and whether it held bytes that are not text in stdin's
    encoding; those are replaced by U+FFFD, as a terminal or editor shows them, so that a stray byte
    in pasted or piped text costs one character rather than the turn (the caller says so)."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is not None:
        line = raw.readline()
        try:
            return line.decode(sys.stdin.encoding or "utf-8"), False
        except UnicodeDecodeError:
            return line.decode(sys.stdin.encoding or "utf-8", errors="replace"), True
    line = sys.stdin.readline()  # a text stream (a test's StringIO): undecodable bytes arrive as surrogates
    try:
        line.encode("utf-8")
        return line, False
    except UnicodeEncodeError:
        try:
            data = line.encode("utf-8", "surrogateescape")  # the escaped bytes back
        except UnicodeEncodeError:
            data = line.encode("utf-8", "surrogatepass")
        return data.decode("utf-8", errors="replace"), True


def cmd_chat(args) -> int:
    from .chat import stream_reply
    from .engine import PromptError, check_sampling, model_options, quantize_int8
    from .runtime import load_run, resolve_device

    device = resolve_device(args.device)
    model, tokenizer, _, _ = load_run(args.run, device)
    if args.quantize == "int8":
        quantize_int8(model)
    if getattr(tokenizer, "chat_tokens", None) is None:
        raise LatentloopError(f"{args.run} has no chat tokens: fine-tune it first (latentloop train --stage sft "
                              f"--init-from {args.run} --data chat:...)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise LatentloopError(f"--top-p must be in (0, 1], got {args.top_p}")
    # before the first message: checked inside the loop, a bad value was one more message the
    # session survived (and it ended with exit 0)
    check_sampling(args.temperature, args.top_k, args.top_p, args.seed)
    options = _generation_options(args)  # the given ones only: the engine fills in the defaults (see generate)
    model_options(model, options)
    budget = args.max_new_tokens or min(DEFAULT_NEW_TOKENS, model.config.sequence_len // 2)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print(f"[{CHAT_COMMANDS}]", file=sys.stderr)
    while True:
        sys.stdout.write("> ")
        sys.stdout.flush()
        line, replaced = _read_message_line()
        if not line:  # end of input
            sys.stdout.write("\n")
            return 0
        text = line.strip()
        if replaced and text:
            print("[the message was not valid text in the input's encoding: its undecodable bytes are sent as "
                  "U+FFFD]", file=sys.stderr)
        if not text:
            continue
        if text == "/quit":
            return 0
        if text == "/reset":
            messages = list(start)
            print("[new conversation]")
            continue
        if text.startswith("/"):
            print(f"[unknown command {text.split()[0]}: {CHAT_COMMANDS}]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        pieces = []
        try:
            for piece in stream_reply(model, tokenizer, messages, budget, temperature=args.temperature,
                                      top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                      compile=_decode_mode(args), on_compile=_say_compiling, **options):
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except PromptError as exc:  # a message too long for the context: say so and keep the session
            messages.pop()
            print(f"[{exc}]", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        reply = "".join(pieces)
        if reply.strip():
            messages.append({"role": "assistant", "content": reply})
        else:  # an empty turn is not a turn of the format: forget the exchange
            messages.pop()


def cmd_tokenizer(args) -> int:
    from .data import BPETokenizer, parse_source
    from .data.tokenizers import TOKENIZER_FILE, write_new_tokenizer
    from .runtime import output_folder

    out = Path(args.out)
    target = out if out.suffix == ".json" else out / TOKENIZER_FILE
    if target.exists():  # checked before the (long) training too, not only when writing
        raise OutputError(f"{target} already exists; choose another --out (a run's tokenizer is never replaced)")
    output_folder(target.parent, "--out folder")
    source = parse_source(args.data)
    budget = args.max_bytes or None

    def texts():
        used = 0
        for doc in source.iter_documents("train"):
            yield doc
            used += len(doc.encode())
            if budget is not None and used >= budget:
                return

    tokenizer = BPETokenizer.train(texts(), args.vocab_size)
    write_new_tokenizer(tokenizer, target)
    print(f"trained a {tokenizer.vocab_size}-token BPE tokenizer on {args.data}: {target}")
    return 0


def cmd_analyze(args) -> int:
    from . import analysis
    from .runtime import output_folder

    if args.out:  # before the analysis runs, not after
        output_folder(args.out, "--out")
    common = dict(out=Path(args.out) if args.out else None)
    if args.batches:
        common["batches"] = args.batches
    if args.analysis == "contraction":
        result = analysis.contraction(args.run, passes=args.passes, **common)
        summary = (f"passes {result['passes']}: final relative change {result['final_relative_change']:.2e}, "
                   f"loss pass 1 {result['loss_pass1']:.4f}, best {result['loss_best']:.4f}, "
                   f"final {result['loss_final']:.4f}")
    elif args.analysis == "probe":
        result = analysis.probe(args.run, passes=args.passes, **common)
        summary = "; ".join(f"{name} {r['test_accuracy']:.3f}" for name, r in result["probes"].items())
        summary += f" (majority {next(iter(result['probes'].values()))['majority_baseline']:.3f})"
    else:
        if args.exit_threshold < 0:
            raise LatentloopError(f"--exit-threshold must be >= 0, got {args.exit_threshold}")
        result = analysis.depth(args.run, max_steps=args.max_steps, exit_threshold=args.exit_threshold,
                                min_steps=args.min_steps, task_limit=args.task_limit, **common)
        summary = ", ".join(f"r={r}: {loss:.4f}" for r, loss in zip(result["steps"], result["loss"]))
        summary += (f"; mean exit depth {result['mean_exit_depth']:.2f}, Spearman(exit depth, loss) "
                    f"{result['spearman_exit_depth_vs_token_loss']:.3f}")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(summary)
        print(f"written to {result['folder']}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    archs = [a.strip() for a in args.archs.split(",")] if args.archs else None
    from .demo import DEMO_STEPS

    run_demo(Path(args.out), steps=DEMO_STEPS if args.steps is None else args.steps, data=args.data,
             preset=args.preset, archs=archs, progress=not args.no_progress)
    return 0


def cmd_export_dcp(args) -> int:
    from .runtime import export_full_weights

    path = export_full_weights(args.run, force=args.force)
    print(f"wrote {path}")
    return 0


def cmd_serve(args) -> int:
    import os

    from .serve import API_KEY_ENV, ServeSettings, serve

    settings = ServeSettings(run=args.run, host=args.host, port=args.port, device=args.device,
                             api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, model_name=args.model_name,
                             max_tokens_cap=args.max_tokens_cap, max_batch_size=args.max_batch_size,
                             max_queue=args.max_queue, batch_window_ms=args.batch_window_ms, batching=args.batching,
                             request_timeout=args.request_timeout, access_log=args.access_log)
    serve(settings)
    return 0


def cmd_import_hf(args) -> int:
    from .interop import import_hf

    summary = import_hf(args.source, args.out, sequence_len=args.sequence_len)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        m = summary["model"]
        print(f"imported {summary['model_type']} {args.source} ({summary['params']:,} params, {m['n_layer']} x "
              f"{m['n_embd']}, vocab {m['vocab_size']}, context {m['sequence_len']}) as a gpt run: {summary['run']}")
    return 0


def cmd_export(args) -> int:
    from .interop import export_hf

    summary = export_hf(args.run, args.out, plain=True if args.plain else (False if args.remote_code else None))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"exported {args.run} as {summary['format']}: {summary['out']}")
        if summary["plain_blockers"] and not args.remote_code:
            print(f"note: not a plain Llama model because of {', '.join(summary['plain_blockers'])}; load it (and "
                  f"its tokenizer: AutoTokenizer reads config.json first) with trust_remote_code=True",
                  file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "tokenizer": cmd_tokenizer,
            "chat": cmd_chat, "demo": cmd_demo, "compare": cmd_compare, "analyze": cmd_analyze, "serve": cmd_serve,
            "import-hf": cmd_import_hf, "export": cmd_export, "export-dcp": cmd_export_dcp}


def _report(exc: LatentloopError) -> None:
    """Print a user error's line, once per job (see the module docstring)."""
    import os

    from .runtime import current_dist

    env = current_dist()
    shared, own = getattr(exc, "shared", False), getattr(exc, "rank_specific", False)
    if shared and not env.is_main:
        return  # every process has it; rank 0 prints it
    if not env.distributed and os.environ.get("RANK", "0") not in ("", "0") and not own:
        return  # before the process group: torchrun started every process alike, and rank 0 fails alike
    prefix = f"rank {env.rank}: " if env.world_size > 1 and not env.is_main and not shared else ""
    print(f"latentloop: error: {prefix}{exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code. Without `argv` (sys.argv) this is the process's own
    command line, and after a command that joined a process group it ends the process itself
    (`runtime.exit_without_finalizing`); with `argv` (tests, other Python code) it always returns."""
    args = build_parser().parse_args(argv)
    try:
        code = COMMANDS[args.command](args)
    except LatentloopError as exc:
        _report(exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("latentloop: interrupted", file=sys.stderr)
        return 130
    except RuntimeError:
        from .runtime import current_dist

        if current_dist().world_size > 1:  # most likely a peer failed first: let torchrun end this process
            import time

            time.sleep(PEER_GRACE_S)
        raise
    from .runtime import destroy_distributed, exit_without_finalizing

    # after a failure the process exits instead: leaving a group can wait on its peers
    if destroy_distributed() and argv is None:  # this process's own command line (the script, python -m)
        exit_without_finalizing(code)  # a process group's threads outlive it: see there
    return code


if __name__ == "__main__":
    sys.exit(main())
