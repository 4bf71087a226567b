"""`generate` and `chat`: decoding through the engine with the options the user gave."""

from __future__ import annotations

import json
import sys

from ..errors import LatentloopError
from .parser import DEFAULT_NEW_TOKENS, generation_options


def _decode_mode(args) -> bool | str:
    """The engine's `compile=` for --decode."""
    return {"auto": "auto", "compiled": True, "eager": False}[args.decode]


def _say_compiling(message: str) -> None:
    print(f"[{message}]", file=sys.stderr, flush=True)


def cmd_generate(args) -> int:
    from ..engine import model_options, quantize_int8, row_info, stream
    from ..runs import load_run
    from ..runtime import resolve_device
    from ..util import TokenText

    device = resolve_device(args.device)
    model, tokenizer, _, _ = load_run(args.run, device)
    if args.quantize == "int8":
        quantize_int8(model)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise LatentloopError(f"--top-p must be in (0, 1], got {args.top_p}")
    # The engine fills in the defaults itself: hand it only what the user gave (checked here first, so
    # a bad option fails before any work). Handing it the filled-in dict made every fbt run fail, the
    # default `passes` read as given beside regime soft.
    options = generation_options(args, model)
    model_options(model, options, cached=not args.no_cache)
    context = model.config.sequence_len
    max_new = args.max_new_tokens if args.max_new_tokens is not None else min(DEFAULT_NEW_TOKENS, context // 2)
    _check_utf8_argument(args.prompt, "--prompt")
    prompt_ids = tokenizer.as_prompt(tokenizer.encode(args.prompt))  # BOS first where the tokenizer puts one
    if args.max_new_tokens is None and len(prompt_ids) < context:  # the default budget fits what is left
        max_new = min(max_new, context - len(prompt_ids))
    steps = stream(model, prompt_ids, max_new, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, stop_tokens=[*tokenizer.stop_ids, tokenizer.bos_id], use_cache=not args.no_cache,
                   pad_id=tokenizer.pad_id, compile=_decode_mode(args), on_compile=_say_compiling,
                   kv_dtype=args.kv_dtype, **options)
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
    if sys.stdin is None:  # started with stdin closed (`<&-`): no input at all
        return "", False
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


def _check_utf8_argument(value: str, flag: str) -> None:
    """A command-line text that is not UTF-8: Python keeps its bytes as lone surrogates
    ("surrogateescape"), which the chat format's check then named as escapes the user never wrote."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        try:
            what = f"byte 0x{bad.encode('utf-8', 'surrogateescape').hex()}"  # the byte the shell passed
        except UnicodeEncodeError:  # a surrogate no byte escapes to (from Python, not a shell)
            what = f"U+{ord(bad):04X}"
        raise LatentloopError(f"{flag} is not valid UTF-8 text ({what} at character {exc.start + 1})") from None


def _check_chat_start(tokenizer, start: list[dict], budget: int, context: int) -> None:
    """Before the first message: a reply budget the context allows, and a system turn that is text,
    leaving room (with or without a system turn) for a one-character message and the reply. Checked
    inside the loop, each message failed on them and the session ended with exit 0."""
    from ..data.chat import ChatFormatError

    if not 1 <= budget < context:
        raise LatentloopError(f"--max-new-tokens must be in [1, {context - 1}] for this model's context of "
                              f"{context} tokens, got {budget}")
    try:  # with the shortest message: what any conversation of this session takes at least
        least = len(tokenizer.render_prompt([*start, {"role": "user", "content": "?"}]))
    except ChatFormatError as exc:
        what = "--system is not a usable system message" if start else "the chat format refuses a first message"
        raise LatentloopError(f"{what}: {exc}") from None
    if least > context - budget:
        what = "--system takes" if start else "the chat format takes"
        raise LatentloopError(f"{what} {least} tokens with a one-character message, over the "
                              f"{context - budget} the context of {context} leaves beside a reply of {budget} "
                              f"(--max-new-tokens)")


def _turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of a seeded session's reply number `turn` (from 0): the session replays as a whole,
    while each turn draws numbers of its own (one seed for every turn gave two different messages the
    same draws, so a sampled reply repeated itself)."""
    from ..engine import MAX_SEED

    return None if seed is None else (seed + turn) % MAX_SEED


def cmd_chat(args) -> int:
    from ..chat import stream_reply
    from ..engine import PromptError, check_kv_dtype, check_sampling, model_options, quantize_int8
    from ..runs import load_run
    from ..runtime import resolve_device

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
    options = generation_options(args, model)  # the given ones only: the engine fills in the defaults (see generate)
    model_options(model, options)
    check_kv_dtype(model, options, args.kv_dtype, _decode_mode(args), use_cache=True)
    budget = args.max_new_tokens or min(DEFAULT_NEW_TOKENS, model.config.sequence_len // 2)
    if args.system:
        _check_utf8_argument(args.system, "--system")
    start = [{"role": "system", "content": args.system}] if args.system else []
    _check_chat_start(tokenizer, start, budget, model.config.sequence_len)
    messages = list(start)
    replies = 0  # turns answered so far: a seeded session draws turn k with seed + k (`_turn_seed`)
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
            command = text.split()[0]
            print(f"[{command} takes no argument: {CHAT_COMMANDS}]" if command in ("/quit", "/reset") else
                  f"[unknown command {command}: {CHAT_COMMANDS}]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        pieces = []
        stopped = False
        try:
            for piece in stream_reply(model, tokenizer, messages, budget, temperature=args.temperature,
                                      top_k=args.top_k, top_p=args.top_p, seed=_turn_seed(args.seed, replies),
                                      compile=_decode_mode(args), on_compile=_say_compiling,
                                      kv_dtype=args.kv_dtype, **options):
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except PromptError as exc:  # a message too long for the context: say so and keep the session
            messages.pop()
            print(f"[{exc}]", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl+C during a reply stops the reply, not the session (at the prompt: quits)
            stopped = True
        replies += 1
        sys.stdout.write("\n")
        if stopped:
            print("[stopped: the reply so far is kept; Ctrl+C at the prompt or /quit ends the session]",
                  file=sys.stderr)
        reply = "".join(pieces)
        if reply.strip():
            messages.append({"role": "assistant", "content": reply})
        else:  # an empty turn is not a turn of the format: forget the exchange
            messages.pop()


