"""Talking to an SFT run: the reply to a conversation, streamed through `engine.stream`.

    for piece in stream_reply(model, tokenizer, messages, max_new_tokens=128, regime="soft"):
        print(piece, end="")

The conversation is rendered by the tokenizer (`tokenizer.render_prompt`: the turns so far and
`<|assistant|>`), the reply ends at `<|end|>` (or EOS / BOS / the budget), and pieces are whole
UTF-8 characters. When the conversation no longer fits the context with the reply's budget, its
oldest exchanges are dropped (a system turn is kept): the model sees the most recent turns, as a
sliding window. The earlier replies in the prompt are marked as the model's own (`written`): fbt
reads them fused, as it wrote them and as SFT trains them. `latentloop chat RUN` is the interactive
loop around this (in `cli`).
"""

from __future__ import annotations

from collections.abc import Iterator

from .data.chat import MAX_CHAT_TEXT_CHARS, check_messages, prompt_written, replies_encoded_alone
from .engine import PromptError, stream
from .errors import ConfigError
from .util import TokenText


def _text_length(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))


def chat_prompt(tokenizer, messages: list[dict], budget: int) -> list[int]:
    """The prompt ids of `messages`, dropping the oldest exchanges (never the system turn nor the
    last user turn) until they fit `budget` tokens."""
    return fitted_conversation(tokenizer, messages, budget)[1]


def fitted_conversation(tokenizer, messages: list[dict], budget: int) -> tuple[list[dict], list[int]]:
    """(the messages kept, their prompt ids): `chat_prompt`, with what it kept."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        check_messages(messages, for_training=False)  # its one line for what is not a list of objects
    messages = list(messages)
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    turns = messages[len(system):]
    while _text_length(system + turns) > MAX_CHAT_TEXT_CHARS:  # the format refuses more text: drop as below
        if len(turns) <= 1:
            with_system = " with the system message" if system else ""
            raise PromptError(f"the last message ({_text_length(system + turns):,} characters{with_system}) is over "
                              f"the {MAX_CHAT_TEXT_CHARS:,} characters a conversation may hold")
        turns = turns[2:]
    while True:
        ids = tokenizer.render_prompt(system + turns)
        if len(ids) <= budget:
            return system + turns, ids
        if len(turns) <= 1:
            raise PromptError(f"the last message ({len(ids)} tokens with the format) does not fit the context "
                              f"left for it ({budget} tokens); shorten it or lower the reply budget")
        turns = turns[2:]  # one user + assistant exchange


def stream_reply(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 **options) -> Iterator[str]:
    """Yield the assistant's reply to `messages` (ending with a user turn) piece by piece."""
    tokens = getattr(tokenizer, "chat_tokens", None)
    if tokens is None:
        raise ConfigError("this run's tokenizer has no chat tokens: fine-tune it first (latentloop train --stage sft "
                          "--init-from RUN --data chat:...)")
    context = model.config.sequence_len
    if not 1 <= max_new_tokens < context:
        raise PromptError(f"the reply budget must be in [1, {context - 1}] for a context of {context}, got "
                          f"{max_new_tokens}")
    kept, prompt = fitted_conversation(tokenizer, messages, context - max_new_tokens)
    # the earlier replies, marked: a model with latent feedback reads them as it wrote them (fbt)
    written = prompt_written(tokenizer, kept, prompt) if getattr(model, "REPLAYS_WRITTEN", False) else None
    decoder = TokenText(tokenizer, message_start=replies_encoded_alone(tokenizer))  # as `decode` gives a reply
    for step in stream(model, prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       stop_tokens=[tokens.end, *tokenizer.stop_ids, tokenizer.bos_id], pad_id=tokenizer.pad_id,
                       written=written, **options):
        piece = decoder.add(step.tokens[0])
        if piece:
            yield piece
    tail = decoder.finish()
    if tail:
        yield tail
