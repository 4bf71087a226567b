"""The commands around the runs: `tokenizer`, `demo`, `serve`, `import-hf`, `export`, `export-dcp`."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import OutputError
from .parser import print_json


def cmd_tokenizer(args) -> int:
    from ..data import BPETokenizer, parse_source
    from ..data.tokenizers import TOKENIZER_FILE, write_new_tokenizer
    from ..runtime import output_folder
    from ..util import removed_on_failure

    out = Path(args.out)
    target = out if out.suffix.lower() == ".json" else out / TOKENIZER_FILE  # NAME.JSON too: a file, not a folder
    # the arguments first: a refused one must leave no output folder behind
    BPETokenizer.check_vocab_size(args.vocab_size)
    if target.exists():  # checked before the (long) training too, not only when writing
        raise OutputError(f"{target} already exists; choose another --out (a run's tokenizer is never replaced)")
    source = parse_source(args.data)
    budget = args.max_bytes or None

    def texts():
        left = budget  # UTF-8 bytes still to read; None: no cap
        for doc in source.iter_documents("train"):
            if left is None:
                yield doc
                continue
            encoded = doc.encode()
            if len(encoded) >= left:
                # the document that reaches the cap is cut there: a `.txt` file is one document, and
                # yielding it whole read a corpus of any size past --max-bytes. A character the cut
                # splits is dropped ("ignore" can only meet that one: the rest is valid UTF-8).
                head = encoded[:left].decode("utf-8", errors="ignore")
                if head:
                    yield head
                return
            yield doc
            left -= len(encoded)

    # the folder is made (and checked writable) before the long training; data that turns out
    # missing or empty, or an interrupt, removes it again
    with removed_on_failure(target.parent):
        output_folder(target.parent, "--out folder")
        tokenizer = BPETokenizer.train(texts(), args.vocab_size)
        write_new_tokenizer(tokenizer, target)
    print(f"trained a {tokenizer.vocab_size}-token BPE tokenizer on {args.data}: {target}")
    return 0


def cmd_demo(args) -> int:
    from ..demo import run_demo

    archs = None if args.archs is None else [a.strip() for a in args.archs.split(",") if a.strip()]
    from ..demo import DEMO_STEPS

    run_demo(Path(args.out), steps=DEMO_STEPS if args.steps is None else args.steps, data=args.data,
             preset=args.preset, archs=archs, progress=not args.no_progress)
    return 0


def cmd_export_dcp(args) -> int:
    from ..runs import export_full_weights

    path = export_full_weights(args.run, force=args.force)
    print(f"wrote {path}")
    return 0


def cmd_serve(args) -> int:
    import os

    from ..serve import API_KEY_ENV, ServeSettings, serve

    settings = ServeSettings(run=args.run, host=args.host, port=args.port, device=args.device,
                             api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, model_name=args.model_name,
                             max_tokens_cap=args.max_tokens_cap, max_batch_size=args.max_batch_size,
                             max_queue=args.max_queue, batch_window_ms=args.batch_window_ms, batching=args.batching,
                             decode=args.decode, kv_dtype=args.kv_dtype, warm_options=tuple(args.warm_options),
                             request_timeout=args.request_timeout, access_log=args.access_log)
    serve(settings)
    return 0


def cmd_import_hf(args) -> int:
    from ..interop import import_hf

    summary = import_hf(args.source, args.out, sequence_len=args.sequence_len)
    if args.json:
        print_json(summary)
    else:
        m = summary["model"]
        print(f"imported {summary['model_type']} {args.source} ({summary['params']:,} params, {m['n_layer']} x "
              f"{m['n_embd']}, vocab {m['vocab_size']}, context {m['sequence_len']}) as a gpt run: {summary['run']}")
    return 0


def cmd_export(args) -> int:
    from ..interop import export_hf

    summary = export_hf(args.run, args.out, plain=True if args.plain else (False if args.remote_code else None),
                        show_progress=not args.no_progress, dtype=args.dtype)  # stderr
    if args.json:
        print_json(summary)
    else:
        print(f"exported {args.run} as {summary['format']}: {summary['out']}")
        if summary["plain_blockers"] and not args.remote_code:
            print(f"note: not a plain Llama model because of {', '.join(summary['plain_blockers'])}; load it (and "
                  f"its tokenizer: AutoTokenizer reads config.json first) with trust_remote_code=True",
                  file=sys.stderr)
    return 0


