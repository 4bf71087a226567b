"""The argument parser of every command: its flags, the declared inference options of every
architecture as flags (from the registry), and the argument types (one-line usage errors)."""

from __future__ import annotations

import argparse
import math
import os

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # Ctrl+C, as a shell reports a process ended by SIGINT (128 + 2)
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (`| head`), as a shell reports SIGPIPE (128 + 13)
DEFAULT_NEW_TOKENS = 64  # generate's default budget, capped at half the context (the prompt gets the rest)


def print_json(value) -> None:
    """A command's `--json` output: strict JSON, indented (a NaN or infinity, which strict parsers
    reject, is null; a path or other object is its text)."""
    import json

    from ..util import json_safe

    print(json.dumps(json_safe(value), indent=2, allow_nan=False, default=str))


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (the default prints the whole usage first)."""

    def error(self, message: str):
        from ..distributed import a_peer_of_torchrun

        # under torchrun every process parses the same line: rank 0 says the mistake, once
        said = f"latentloop: error: {message} (see '{self.prog} --help')\n"
        self.exit(EXIT_USAGE, None if a_peer_of_torchrun() else said)


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


def _tracker_list(text: str) -> tuple[str, ...]:
    from ..config import TRACKERS

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in TRACKERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(TRACKERS)}, comma-separated, got {text!r}")
    return names


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


# more threads than this many per core only oversubscribe the cores; far more crashed torch's
# thread pool (100,000: a segmentation fault) or overflowed its argument
MAX_THREADS_PER_CORE = 4


def _thread_count(text: str) -> int:
    value = _positive_int(text)
    most = MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
    if value > most:
        raise argparse.ArgumentTypeError(f"expected at most {most} ({MAX_THREADS_PER_CORE} per core of this "
                                         f"machine's {os.cpu_count() or 1}), got {text!r}")
    return value


def _add_threads_option(p: argparse.ArgumentParser) -> None:
    """The CPU's intra-op threads for commands that decode (applied in `cli.main`, before the model loads):
    where a client or other processes share the cores, fewer threads than cores can decode faster."""
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="CPU threads for the model's operations (torch.set_num_threads; default: torch's "
                        "choice, one per core); compiled steps are built for this count")


def _add_decode_options(p: argparse.ArgumentParser) -> None:
    """How generate and chat decode: the compiled static-cache step where it pays (default), always, or never."""
    from ..engine import KV_DTYPES

    p.add_argument("--decode", choices=["auto", "compiled", "eager"], default="auto",
                   help="auto: decode the first steps eagerly, timing them, and compile the step when the saving "
                        "over the budget reaches the compile's expected cost (latentloop.inference.fast.AutoCompile; "
                        "compiled steps are cached on disk for later processes); compiled: always; eager: never")
    p.add_argument("--compile", dest="decode", action="store_const", const="compiled",
                   help="the same as --decode compiled")
    p.add_argument("--no-compile", dest="decode", action="store_const", const="eager",
                   help="the same as --decode eager")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="what the compiled step's cache stores keys and values in (default: the model's dtype, "
                        "exact); float16, as llama.cpp's default cache, reads half the bytes per step over a long "
                        "context, with logits rounded accordingly. Compiled decoding only (auto or compiled)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: weight-only int8 linear layers (per output channel, symmetric), for speed and memory")




def _path(text: str) -> str:
    """A path argument: an empty one ("" from an unset shell variable) read as the current folder, and
    `--out ""` said ". exists and is not empty"."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty one")
    return text


def _analysis_type(option):
    """An analysis option's argument type: its type, a finite number for a float, within its minimum
    and maximum (one-line usage errors)."""
    if option.minimum is None and option.maximum is None and option.type is not float:
        return option.type

    def parse(text: str):
        try:
            value = option.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {option.type.__name__}, got {text!r}") from None
        # float() reads "nan" and "inf", and `nan < minimum` is False: `--exit-threshold nan` ran the
        # analysis and recorded null
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if option.minimum is not None and value < option.minimum:
            raise argparse.ArgumentTypeError(f"expected at least {option.minimum}, got {text!r}")
        if option.maximum is not None and value > option.maximum:
            raise argparse.ArgumentTypeError(f"expected at most {option.maximum}, got {text!r}")
        return value

    return parse


def _add_analyses(sub) -> None:
    """`analyze KIND`: one subcommand per analysis a registered architecture offers (its spec's
    `analyses`), with that analysis's options as flags."""
    from ..archs import ARCHS

    by_kind: dict[str, tuple[object, list[str]]] = {}
    for spec in ARCHS.values():
        for kind, analysis in spec.analyses.items():
            by_kind.setdefault(kind, (analysis, []))[1].append(spec.name)
    kinds = "; ".join(f"{kind} ({', '.join(archs)})" for kind, (_, archs) in by_kind.items())
    a = sub.add_parser("analyze", help=f"look inside a trained run: {kinds}")
    asub = a.add_subparsers(dest="analysis", required=True, parser_class=_Parser)
    for kind, (analysis, archs) in by_kind.items():
        sp = asub.add_parser(kind, help=f"{'/'.join(archs)}: {analysis.help}")
        for option in analysis.options:
            sp.add_argument("--" + option.name.replace("_", "-"), dest=f"analysis_{option.name}",
                            type=_analysis_type(option), default=option.default, help=option.help)
        sp.add_argument("run", help="run folder or checkpoint folder")
        sp.add_argument("--batches", type=_positive_int, default=None, help="validation batches to use")
        sp.add_argument("--data", default=None,
                        help="the text to analyze on (stdlib, text:PATH, ...; default: the run's own, as eval "
                             "reads it)")
        sp.add_argument("--out", type=_path, default=None, help="output folder (default: RUN/analysis)")
        sp.add_argument("--json", action="store_true", help="print the result as JSON")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")


def _addgeneration_options(p: argparse.ArgumentParser) -> None:
    """One flag per inference option any architecture declares (its `ArchSpec`); the value is
    parsed and checked against the loaded model's arch later, so a flag of another arch is a
    one-line error. None means 'not given' (the model's default)."""
    from ..archs import option_union

    for name, (option, archs) in option_union().items():
        p.add_argument(option.flag, dest=f"option_{name}", default=None, metavar=_metavar(option),
                       help=f"[{', '.join(archs)}] {option.help_text}")


def _add_sampling_options(p: argparse.ArgumentParser, temperature: float) -> None:
    """The sampling flags of generate and chat (their default temperature differs)."""
    p.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default {temperature:g})")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (chat: reply k of the session draws with seed + k, so a session replays)")


def _metavar(option) -> str:
    if option.choices:
        return "{" + ",".join(option.choices) + "}"
    return option.kind.__name__.upper() + "".join(f"|{word}" for word in option.keywords)


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from ..engine import KV_DTYPES
    from ..serve import settings as defaults

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
    p.add_argument("--decode", choices=defaults.SERVE_DECODE, default=defaults.SERVE_DECODE[0],
                   help="compiled: continuous batching's steps compiled (a static cache, one graph per batch size "
                        "1, 2, 4, ... up to --max-batch-size, compiled before the server listens and cached on disk; "
                        "options that do not compile stay eager); eager: every decode step eagerly; auto: compiled "
                        "when every size's step is already in the on-disk cache (a start of seconds, not a compile "
                        f"of minutes), else eager (default {defaults.SERVE_DECODE[0]})")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="what the compiled path's cache stores keys and values in (default: the model's dtype, "
                        "exact); float16, as llama.cpp's server, reads half the bytes per step over long contexts, "
                        "logits rounded accordingly. Compiled batches only (--decode compiled or "
                        "auto); a batch on the eager path keeps the model's dtype")
    p.add_argument("--warm-options", action="append", default=[], metavar="JSON",
                   help="a JSON object of the architecture's options, as a request gives them (e.g. '{\"steps\": "
                        "4}'), whose compiled steps are made at start beside the default options' (compiled with "
                        "--decode compiled; with auto, loaded where the on-disk cache holds them); repeatable. A "
                        "request never makes the server compile: options whose steps are not ready decode eagerly")
    p.add_argument("--batch-window-ms", type=float, default=defaults.DEFAULT_BATCH_WINDOW_MS,
                   help=f"how long an idle server waits for more requests before it starts a batch (default "
                        f"{defaults.DEFAULT_BATCH_WINDOW_MS:g})")
    p.add_argument("--request-timeout", type=float, default=defaults.DEFAULT_REQUEST_TIMEOUT_S,
                   help=f"seconds a request may take, waiting included, before it ends with 504 (default "
                        f"{defaults.DEFAULT_REQUEST_TIMEOUT_S:g})")
    p.add_argument("--access-log", action="store_true", help="log every request")
    _add_threads_option(p)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ..archs import ARCHS
    from .planning import add_plan_arguments

    parser = _Parser(prog="latentloop", description="Train, evaluate and sample latent-state language models.")
    parser.add_argument("--version", action="version", version=f"latentloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a model into a run folder")
    t.add_argument("--config", help="YAML file with sections model/train/data")
    t.add_argument("--arch", help="architecture: " + "; ".join(
        f"{spec.name}: {spec.summary}" for spec in ARCHS.values()))
    t.add_argument("--preset", help="model size preset: test, tiny, small, gpt2, 1b")
    t.add_argument("--data", help="data source: stdlib, text:PATH, hf:NAME[:CONFIG], task:NAME[:knobs], "
                                  "mix:SOURCE+SOURCE[+...], or for --stage sft chat:FILE[:field=role,...] / "
                                  "chat:task:NAME")
    t.add_argument("--tokenizer", type=_path, help="'byte' or a path to a tokenizer.json")
    t.add_argument("--steps", type=_positive_int, help="optimizer steps")
    t.add_argument("--batch-size", type=_positive_int, help="sequences per micro-batch")
    t.add_argument("--lr", type=float, help="AdamW's peak learning rate (train.lr); with the default Muon "
                                            "optimizer, that of the embeddings, head and vectors only: the block "
                                            "matrices' is train.muon_lr")
    t.add_argument("--seed", type=int, help="random seed")
    t.add_argument("--device", help="auto, cpu, cuda[:N], mps")
    t.add_argument("--out", type=_path, required=True, help="run folder to create (or continue with --resume)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    from ..archs import ARCHS

    t.add_argument("--init-from", metavar="RUN",
                   help="start from another run's weights; from a gpt run (e.g. imported with import-hf) --arch "
                        + " / ".join(name for name, spec in ARCHS.items() if spec.upcycles)
                        + " upcycles it; the model shape and the tokenizer come from RUN")
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
    t.add_argument("--log", type=_tracker_list, default=None, metavar="TRACKER[,TRACKER]",
                   help="also log the metrics to tensorboard (RUN/tensorboard) and/or wandb (RUN/wandb, offline "
                        "unless WANDB_MODE or WANDB_API_KEY is set); metrics.jsonl is always written")
    t.add_argument("--profile", type=_positive_int, default=None, metavar="STEPS",
                   help="record STEPS optimizer steps with torch.profiler (after the first steps, which compile): "
                        "a trace for TensorBoard / Perfetto and summary.json (time by kind of kernel, idle gaps) "
                        "in RUN/profile")
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
                   help="data to score the loss on (text:PATH, hf:NAME, ...); default: the run's own data when "
                        "it is built in (stdlib, task:NAME, chat:task:NAME) or is the text: file or folder the run "
                        "was trained on, still holding the tokens the run recorded (checked against its checksums); "
                        "any other source must be named")
    e.add_argument("--tasks", default=None, metavar="NAMES|core",
                   help="evaluate tasks instead of the loss: 'core' (the 22 CORE tasks), CORE task names and/or "
                        "generation tasks, comma-separated; results go to RUN/evals/")
    e.add_argument("--by-position", type=_positive_int, default=None, metavar="BUCKETS",
                   help="the loss per position: mean loss of the targets in each of BUCKETS equal ranges of the "
                        "context (does a model extended to a longer context use it?), beside the base run's "
                        "(--against, default the run it started from) and drawn in RUN/evals/loss_by_position.png")
    e.add_argument("--against", default=None, metavar="RUN",
                   help="with --by-position: the run to draw beside it (default: the run this one was started "
                        "from with --init-from, when it is on this machine)")
    e.add_argument("--limit", type=_positive_int, default=None, help="with --tasks: at most N examples per task")
    e.add_argument("--eval-dir", default=None, metavar="PATH",
                   help="with --tasks: folder of the task jsonl files (default: $LATENTLOOP_EVAL_DIR, else the "
                        "cached official bundle, fetched once when online)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.add_argument("--passes-curve", action="store_true",
                   help="fbt: also the loss of the K-pass fused forward for K = 1, 2, 3, 4, 8, 16 and at the "
                        "sequential fixed point (K = T passes, exact): the paper's stability check")
    _addgeneration_options(e)

    g = sub.add_parser("generate", help="continue a prompt with a trained model")
    g.add_argument("run", help="run folder or checkpoint folder")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=_non_negative_int, default=None,
                   help=f"tokens to generate (default: {DEFAULT_NEW_TOKENS}, at most half the model's context)")
    _add_sampling_options(g, temperature=0.8)
    g.add_argument("--no-cache", action="store_true", help="use the naive uncached reference path")
    _add_decode_options(g)
    _add_threads_option(g)
    g.add_argument("--json", action="store_true", help="print prompt, completion and token ids as JSON")
    g.add_argument("--device", default="cpu", help="cpu, cuda[:N], mps")
    _addgeneration_options(g)

    ch = sub.add_parser("chat", help="talk to an SFT run: type a message, the reply streams; /reset starts over, "
                                     "/quit (or end of input) ends")
    ch.add_argument("run", help="run folder or checkpoint folder (trained with --stage sft)")
    ch.add_argument("--system", default=None, help="a system message to start every conversation with")
    ch.add_argument("--max-new-tokens", type=_positive_int, default=None,
                    help=f"reply budget (default: {DEFAULT_NEW_TOKENS}, at most half the model's context)")
    _add_sampling_options(ch, temperature=0.0)
    _add_decode_options(ch)
    _add_threads_option(ch)
    ch.add_argument("--device", default="cpu", help="cpu, cuda[:N], mps")
    _addgeneration_options(ch)

    k = sub.add_parser("tokenizer", help="tokenizer tools")
    ksub = k.add_subparsers(dest="tokenizer_command", required=True, parser_class=_Parser)
    kt = ksub.add_parser("train", help="train a byte-level BPE tokenizer")
    kt.add_argument("--data", required=True, help="data source: stdlib, text:PATH, hf:NAME[:CONFIG]")
    kt.add_argument("--vocab-size", type=_positive_int, required=True, help="vocabulary size (>= 259)")
    kt.add_argument("--out", type=_path, required=True,
                    help="output tokenizer.json file or folder (an existing tokenizer file is never overwritten)")
    kt.add_argument("--max-bytes", type=_non_negative_int, default=20_000_000,
                    help="read at most this many bytes of training text (0: all)")

    _add_analyses(sub)

    i = sub.add_parser("import-hf", help="import a Hugging Face Llama-family checkpoint (llama, mistral, qwen2) "
                                         "as a gpt run")
    i.add_argument("source", metavar="PATH", type=_path, help="a local model folder (config.json, *.safetensors, "
                                                  "tokenizer.json) or a Hub name org/name")
    i.add_argument("--out", type=_path, required=True, help="run folder to create")
    i.add_argument("--sequence-len", type=_positive_int, default=None,
                   help="context of the run (default: the model's max_position_embeddings)")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")

    x = sub.add_parser("export", help="export a run as a Hugging Face model folder")
    x.add_argument("run", help="run folder or checkpoint folder")
    x.add_argument("--format", choices=["hf"], default="hf", help="output format (hf: transformers)")
    x.add_argument("--out", type=_path, required=True, help="folder to create")
    kind = x.add_mutually_exclusive_group()
    kind.add_argument("--plain", action="store_true",
                      help="require a plain LlamaForCausalLM / Qwen2ForCausalLM (error if the run's options block it)")
    kind.add_argument("--remote-code", action="store_true",
                      help="always ship latentloop's own modeling code (trust_remote_code=True)")
    x.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the weights' type in the folder (bfloat16 / float16: half the size, each weight rounded once)")
    x.add_argument("--json", action="store_true", help="print the summary as JSON")
    x.add_argument("--no-progress", action="store_true", help="do not name each stage on stderr")

    from ..demo import DEMO_DURATION, DEMO_STEPS

    d = sub.add_parser("demo", help="train every architecture briefly, compare, sample, write a report")
    d.add_argument("--steps", type=int, default=None,
                   help=f"training steps per architecture (default: {DEMO_STEPS}, {DEMO_DURATION})")
    d.add_argument("--out", type=_path, default="runs/demo", help="folder for the runs and the report (replaced)")
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

    add_plan_arguments(sub.add_parser("plan", help="size a training run before starting it: FLOPs, memory per device "
                                                   "and wall-clock at a stated MFU"))

    c = sub.add_parser("compare", help="compare runs: params, tokens, FLOPs, loss, BPB, CORE and task accuracy")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    c.add_argument("--out", type=_path, default="compare",
                   help="folder for compare.md and the loss plots (default: ./compare)")
    c.add_argument("--baseline", default=None, metavar="NAME",
                   help="the group (runs differing only in seed) or run the paired differences are taken against "
                        "(default: the first)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser




def generation_options(args, model) -> dict:
    """The option flags given on the command line, each parsed by the loaded model's own declaration
    (mor's `--steps` has other bounds than rgpt's); a flag it does not declare, by another arch's (the
    engine then names it as not supported)."""
    from ..archs import option_union

    own = {option.name: option for option in model.OPTIONS}
    return {name: own.get(name, option).parse(getattr(args, f"option_{name}"))
            for name, (option, _) in option_union().items() if getattr(args, f"option_{name}", None) is not None}

