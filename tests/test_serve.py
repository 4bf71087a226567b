"""`latentloop serve` against real clients.

Servers run in subprocesses (`python -m latentloop serve RUN --port P`) on free loopback ports,
started together by a module fixture and stopped at its end; the clients are the official
`openai` package, httpx (raw HTTP, server-sent events, a client that hangs up) and
lm-evaluation-harness's own `local-completions` model. The runs are random-init models saved as
run folders: every comparison is token for token against the engine in this process, which does
not need a trained model. Every wait is bounded in time.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import SERVER_EXIT_S, ServeProcess, serving, shared_data

import latentloop as ll
from latentloop.archs import ARCHS as REGISTERED
from latentloop.cli import main
from latentloop.data import ByteTokenizer
from latentloop.engine import row_info
from latentloop.runs import save_run
from latentloop.serve.limits import Limits
from latentloop.serve.protocol import APIError, special_names, token_string
from latentloop.serve.requests import DetokenizeBody, TokenizeBody, body_context, parse_completion, validate
from latentloop.serve.text import RowText

REPO = Path(ll.__file__).resolve().parents[1]
ARCHS = tuple(REGISTERED)  # every registered architecture gets a server here
CONTEXT = 128  # room for the lm-eval COPA rows (at most ~85 tokens with BOS)
CALL_TIMEOUT_S = 60  # any one client call
SERVER_START_COMPILED_S = 600  # a compiled server compiles 3 graphs before it answers (cold, on 2 busy cores)
EXIT_TIMEOUT_S = SERVER_EXIT_S  # from SIGTERM to the process's end
POLL_S = 0.05
PROMPT = "def fibonacci(n):\n    "
NEW_TOKENS = 10
SLOW_STEPS = 32  # rgpt recurrence steps that make each decode step slow enough to hang up during it
# the most recurrence steps a request may ask for: a request of all the context's tokens at this
# depth takes ~15 s on an idle 2-core machine, so it outlasts the rgpt server's timeout whatever the load
LONG_STEPS = 256
RGPT_TIMEOUT_S = 5  # --request-timeout of the rgpt server (its other requests take about a second)
TOK = ByteTokenizer()
CHAT_TOK = ByteTokenizer(chat=True)
# A model's own chat template (ChatML), and one that loops for a while on the message "slow": about 4e8
# template steps, ~30 s on an idle core, far longer than the test that sends it takes (it stops the
# server, and so the render); finite, so that a render left running ends all the same
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SLOW_CONTENT = "slow"
SLOW_TEMPLATE = ("{% if messages[-1].content == '" + SLOW_CONTENT + "' %}{% for i in range(100000) %}"
                 "{% for j in range(4000) %}{% endfor %}{% endfor %}{% endif %}" + CHATML)
# --request-timeout of the slow-template server: below the template's own time limit (5 s), and long
# enough for the quick chat request sent meanwhile to start a renderer process of its own (~0.1 s idle)
# while the slow render keeps a core busy
TEMPLATE_TIMEOUT_S = 4
RESPONSIVE_S = 5  # the most /health may take while a template renders (2 busy cores, GIL shared with it)
PROMPT_EXIT_S = 10  # from SIGTERM to the process's end while a render that would take far longer runs
STOPS = [TOK.eos_id, TOK.bos_id]  # what `latentloop generate` and the server stop on

httpx = pytest.importorskip("httpx")
try:
    import jinja2  # noqa: F401
    HAS_JINJA = True
except ImportError:
    HAS_JINJA = False


# --------------------------------------------------------------------------------------------
# Without HTTP: request checks and the text of a choice
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fbt_model():
    torch.manual_seed(0)
    return ll.build("fbt", preset="test").eval()


LIMITS = Limits(context=64, max_tokens_cap=32, max_rows=4)


def parse(body, model):
    return parse_completion(body, model, TOK, LIMITS, "m")


def test_parse_completion_fields(fbt_model):
    request = parse({"model": "m", "prompt": ["ab", "c"], "max_tokens": 3, "n": 2, "regime": "fused",
                     "passes": "auto", "stop": "\n", "logprobs": 2, "temperature": 0}, fbt_model)
    assert request.prompts == [[TOK.bos_id, 97, 98], [TOK.bos_id, 99]] and request.added_bos == [True, True]
    assert request.rows == 4 and request.greedy and request.stop == ("\n",) and request.logprobs == 2
    assert request.options == {"regime": "fused", "passes": "auto"}
    assert request.resolved == {"regime": "fused", "passes": "auto"}
    # token prompts: BOS added only where missing; defaults fill in, passes does not apply to soft
    request = parse({"prompt": [[TOK.bos_id, 5], [6, 7]]}, fbt_model)
    assert request.prompts == [[TOK.bos_id, 5], [TOK.bos_id, 6, 7]] and request.added_bos == [False, True]
    assert request.resolved == {"regime": "soft"} and request.max_tokens == 16 and request.temperature == 1.0


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "x" * 70}, 400, "context"),
    ({"prompt": "x" * 40, "max_tokens": 30}, 400, "exceeds the model's context"),
    ({"prompt": "x", "max_tokens": 33}, 400, "--max-tokens-cap"),
    ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens must be an integer"),
    ({"prompt": "x", "n": 0}, 400, "n must be an integer"),
    ({"prompt": ["x", "y"], "n": 3}, 400, "--max-batch-size"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "foo": 1}, 400, "unknown field(s): foo"),
    ({"prompt": "x", "steps": 2}, 400, "arch 'fbt' does not support option(s): steps"),
    ({"prompt": "x", "regime": "bogus"}, 400, "regime must be one of"),
    ({"prompt": "x", "passes": 3}, 400, "passes applies to regime 'fused' only"),
    ({"prompt": "x", "stop": [1]}, 400, "stop must be"),
    ({"prompt": 5}, 400, "prompt must be"),
    ({"prompt": []}, 400, "prompt must be"),
    ({"prompt": [1, "a"]}, 400, "not a mix"),
    ({"prompt": [[1, 999]]}, 400, "token ids"),
    ({"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream=true"),
    ({"prompt": "x", "stream": True, "stream_options": {"usage": True}}, 400, 'stream_options must be {"include_'),
    ({"prompt": "x", "seed": 2**64}, 400, "seed must be an integer in [0, 9223372036854775807], got 1844674407"),
    ({"prompt": "x", "max_tokens": "9" * 10**6}, 400, "max_tokens must be an integer in [0, 32] (--max-tokens-cap)"),
    ({"prompt": "x", "max_tokens": 2, "stop": ["a"] * 5}, 400, "stop takes at most 4 sequences, got 5"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of is not supported (only best_of = n), got 2"),
    ({"prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias is not supported (only biases of 0)"),
    ({"prompt": "x", "logit_bias": {"5": False}}, 400, "logit_bias is not supported"),
    ({"prompt": "x", "logit_bias": {"abc": 0}}, 400, "logit_bias keys are token ids in [0, "),  # was accepted
    ({"prompt": "x", "logit_bias": {"99999": 0}}, 400, "logit_bias keys are token ids"),
    ({"prompt": "x", "stop": "\ud800"}, 400, "stop is not valid UTF-8 text (it holds a lone surrogate)"),
    ({"prompt": "x", "stop": ["ok", "a\udc00"]}, 400, "stop is not valid UTF-8 text"),
    ({"prompt": "x", "top_k": True}, 400, "top_k must be an integer >= 1, got True"),
    ({"prompt": "x", "temperature": float("nan")}, 400, "temperature must be a finite number >= 0, got nan"),
    ({"prompt": ["x"] * 3, "n": 2}, 400, "this request asks for 6 rows (prompts x n)"),
    ({"max_tokens": 1}, 400, "prompt is required"),
    ({"prompt": "x", "model": "other"}, 404, "does not exist"),
    ([1, 2], 400, "JSON object"),
])
def test_parse_completion_refuses(fbt_model, body, status, words):
    with pytest.raises(APIError) as caught:
        parse(body, fbt_model)
    assert caught.value.status == status and words in caught.value.message
    assert "\n" not in caught.value.message and len(caught.value.message) < 300  # one line, the value cut short
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body_class, body, status, words", [
    (TokenizeBody, {"prompt": "x", "bogus": 1}, 400, "unknown field(s): bogus (this endpoint takes model, prompt"),
    (TokenizeBody, {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs is not supported"),
    (TokenizeBody, {"messages": [{"role": "user", "content": "hi"}]}, 400, "/tokenize takes a prompt, not messages"),
    (TokenizeBody, {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}, 400,
     "/tokenize takes a prompt, not messages"),  # as vLLM's clients send the chat form
    (TokenizeBody, {"prompt": "x", "chat_template": "{{ x }}"}, 400,
     "unknown field(s): chat_template (this endpoint takes model, prompt"),  # not read: not silently ignored
    (TokenizeBody, {"prompt": "x", "model": "other"}, 404, "does not exist: this server serves 'm'"),
    (TokenizeBody, {"prompt": 5}, 400, "prompt must be a string, got 5"),
    (DetokenizeBody, {"tokens": [1], "text": "x"}, 400, "unknown field(s): text (this endpoint takes model, tokens)"),
    (DetokenizeBody, {"tokens": [999]}, 400, "tokens must be a list of token ids in [0, "),
])
def test_the_tokenizer_endpoints_refuse_what_they_would_not_answer(fbt_model, body_class, body, status, words):
    """/tokenize and /detokenize ignored fields they do not take: `return_token_strs` or vLLM's chat form
    (`messages`) got an answer to another question (or "prompt is required"), a misspelt field nothing."""
    with pytest.raises(APIError) as caught:
        validate(body_class, body, body_context(fbt_model, LIMITS, "m"))
    assert caught.value.status == status and words in caught.value.message, caught.value.message


def test_the_tokenizer_endpoints_take_what_clients_send(fbt_model):
    """lm-eval's remote tokenizer sends prompt and add_special_tokens; vLLM's clients the model's name too."""
    context = body_context(fbt_model, LIMITS, "m")
    body = validate(TokenizeBody, {"model": "m", "prompt": "x", "add_special_tokens": False,
                                   "return_token_strs": False}, context)
    assert (body.prompt, body.add_special_tokens) == ("x", False)
    assert validate(DetokenizeBody, {"model": "m", "tokens": [1, 2]}, context).tokens == [1, 2]


def test_neutral_logit_bias_is_accepted_as_the_docs_say(fbt_model):
    for bias in ({}, {"5": 0}, {"5": 0.0, "7": 0}):
        assert parse({"prompt": "x", "logit_bias": bias}, fbt_model).max_tokens == 16


def test_an_option_error_names_the_option_it_is_about():
    """`steps` is inside `draft_steps`: the error about draft_steps named `steps` as its param."""
    model = ll.build("rgpt", preset="test", sequence_len=64)
    with pytest.raises(APIError) as caught:
        parse({"prompt": "x", "steps": 2, "draft_steps": 8}, model)
    assert caught.value.param == "draft_steps", caught.value.body()


def test_a_chat_reply_runs_to_the_context_by_default_and_takes_max_completion_tokens(fbt_model):
    """OpenAI's chat has no 16-token default (completions' own), and names its budget
    max_completion_tokens (max_tokens its deprecated alias): a reply was cut at 16 tokens and the
    current field refused as unknown."""
    messages = [{"role": "user", "content": "hi"}]

    def chat(**fields):
        return parse_completion({"messages": messages, **fields}, fbt_model, CHAT_TOK, LIMITS, "m", chat=True)

    prompt = len(chat(max_tokens=1).prompts[0])
    assert chat().max_tokens == min(LIMITS.max_tokens_cap, LIMITS.context - prompt)
    assert chat(max_completion_tokens=5).max_tokens == 5 == chat(max_tokens=5, max_completion_tokens=5).max_tokens
    for fields, words in [({"max_tokens": 4, "max_completion_tokens": 5}, "differ: send one"),
                          ({"max_completion_tokens": 33}, "max_completion_tokens must be an integer in [0, 32]")]:
        with pytest.raises(APIError) as caught:
            chat(**fields)
        assert caught.value.status == 400 and words in caught.value.message, caught.value.message


def feed(text: RowText, pieces: list[bytes]) -> list[tuple[str, bool]]:
    """Each one-byte token in turn; (released text, stopped) after each."""
    out = []
    for piece in pieces:
        stopped = text.add(piece[0])
        out.append((text.release()[0], stopped))
    return out


def test_row_text_holds_back_stop_prefixes_and_cuts_at_the_stop():
    specials = special_names(TOK)
    text = RowText(TOK, specials, stops=("END",))
    steps = feed(text, [bytes([b]) for b in b"abEN"])
    assert [s for s, _ in steps] == ["a", "b", "", ""]  # "E", "EN" could begin "END"
    assert text.add(ord("D"))  # the stop string is complete
    rest, tokens = text.release(final=True)
    assert rest == "" and [t.token for t in tokens] == []  # nothing of the stop string is returned
    text = RowText(TOK, specials, stops=("END",))
    feed(text, [bytes([b]) for b in b"aEx"])
    assert text.release(final=True)[0] == "" and text.text == "aEx"  # "E" was released with "x"
    # a two-byte character comes out whole, once both bytes are in; its tokens with it
    text = RowText(TOK, specials, base_offset=3)
    first = text.add(0xC3) or text.release()
    assert first == ("", [])
    text.add(0xA9)
    released, tokens = text.release()
    assert released == "é" and [t.token for t in tokens] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert [t.offset for t in tokens] == [3, 3]
    # a lead byte no byte continues: its U+FFFD is its own, at its place; the next token's comes after
    # (the next token's offset was the lead byte's, 12-07 review)
    text = RowText(TOK, specials, base_offset=5)
    text.add(0xEA)
    text.add(ord("N"))
    released, tokens = text.release(final=True)
    assert released == "\ufffdN" and [t.offset for t in tokens] == [5, 6]
    assert [t.text for t in tokens] == ["\ufffd", "N"]
    # an echoed prompt's tokens are placed alike (echo=true: [0, 0, 2] before)
    from latentloop.serve.protocol import decode_with_offsets
    assert decode_with_offsets(TOK, [0xC3, ord("x"), ord("y")]) == ("\ufffdxy", [0, 1, 2])
    assert token_string(TOK, TOK.bos_id, specials) == "<|bos|>" and token_string(TOK, 65, specials) == "A"


# --------------------------------------------------------------------------------------------
# Real servers
# --------------------------------------------------------------------------------------------


class Server(ServeProcess):
    """`python -m latentloop serve RUN` in a subprocess on a free loopback port."""

    def stats(self, **headers) -> dict:
        return httpx.get(self.url + "/v1/stats", headers=headers, timeout=CALL_TIMEOUT_S).json()


def template_run(folder: Path, template: str) -> Path:
    """A random-init gpt run whose tokenizer is a small byte-level BPE with ChatML's special
    tokens and `template` as its chat template (as an imported model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from latentloop.data import HFTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["hello world, the loop"], trainer=trainer)
    tok = HFTokenizer(bpe.to_str(), 0, 0, 0, chat_template=template)  # <|endoftext|>: BOS, EOS and PAD
    model = ll.build("gpt", preset="test", sequence_len=CONTEXT, vocab_size=tok.vocab_size, bos_id=tok.bos_id)
    return save_run(model, tok, folder).parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("serve_runs")
    out = {}
    for seed, arch in enumerate(ARCHS):
        torch.manual_seed(seed)
        out[arch] = save_run(ll.build(arch, preset="test", sequence_len=CONTEXT), TOK, folder / arch).parents[1]
    torch.manual_seed(len(ARCHS))  # a model with the chat format (as `train --stage sft` leaves one)
    out["chat"] = save_run(ll.build("fbt", preset="test", sequence_len=CONTEXT, vocab_size=CHAT_TOK.vocab_size),
                           CHAT_TOK, folder / "chat").parents[1]
    out["template"] = template_run(folder / "template", SLOW_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def models(runs):
    return {arch: ll.load(run)[0] for arch, run in runs.items()}


API_KEY = "test-key"
LIMITS_THREADS = 3  # the limits server's --threads: neither torch's choice here (2) nor a test env's 1


@pytest.fixture(scope="module")
def servers(runs, tmp_path_factory):
    """One server per arch, a small-limits one with an API key, and one that the shutdown test
    stops; all started at once so that their imports overlap."""
    logs = tmp_path_factory.mktemp("serve_logs")
    specs = {arch: (runs[arch],) for arch in ARCHS}
    specs["fbt"] += ("--batch-window-ms", "300")  # the concurrency test's requests meet in one round
    # one thread: with two, a job beside the suite on the 2 cores left the server's OpenMP threads
    # waiting on each other (a first token in 2 s instead of 0.2 s), past RGPT_TIMEOUT_S
    specs["rgpt"] += ("--request-timeout", str(RGPT_TIMEOUT_S), "--threads", "1")
    specs["limits"] = (runs["gpt"], "--max-queue", "1", "--max-tokens-cap", "32", "--max-batch-size", "4",
                       "--batch-window-ms", "1500", "--api-key", API_KEY,
                       "--threads", str(LIMITS_THREADS))
    specs["doomed"] = (runs["rgpt"],)
    specs["rounds"] = (runs["fbt"], "--batching", "rounds", "--batch-window-ms", "300")  # the round scheduler
    specs["chat"] = (runs["chat"],)
    specs["chat-rounds"] = (runs["chat"], "--batching", "rounds")  # a chat's history through the round scheduler
    if HAS_JINJA:  # chat templates render with jinja2 (the hf extra); stopped by its test
        specs["template"] = (runs["template"], "--request-timeout", str(TEMPLATE_TIMEOUT_S))
    # the one that SIGTERM stops starts as a user starts it (python -m latentloop serve); the rest are forked
    with serving({name: Server(run, logs / f"{name}.log", *flags, entry_point=name == "doomed")
                  for name, (run, *flags) in specs.items()}) as started:
        yield started


def expected_greedy(model, prompt: str, new_tokens: int, **options) -> tuple[list[int], dict]:
    """The engine's greedy tokens for the prompt as `latentloop generate` reads it, and the last
    step's info (each row's own values where the model gives them per row)."""
    ids = [TOK.bos_id] + TOK.encode(prompt)
    steps = list(ll.stream(model, ids, new_tokens, temperature=0.0, stop_tokens=STOPS, **options))
    assert steps == [] or ll.generate(model, ids, new_tokens, temperature=0.0, stop_tokens=STOPS, **options) == \
        [s.tokens[0] for s in steps]
    return [s.tokens[0] for s in steps], row_info(steps[-1].info, 0) if steps else {}


def strings(ids: list[int]) -> list[str]:
    specials = special_names(TOK)
    return [token_string(TOK, t, specials) for t in ids]


CASES = [("gpt", {}), ("fbt", {"regime": "standard"}), ("fbt", {"regime": "soft"}),
         ("fbt", {"regime": "fused", "passes": 3}), ("fbt", {"regime": "fused", "passes": "auto"}),
         ("lrt", {"prefill": "sequential"}), ("lrt", {"prefill": "interleaved"}),
         ("rgpt", {"steps": 2}), ("rgpt", {"steps": 3, "cache_mode": "mean", "exit_threshold": 0.01}),
         ("rgpt", {"cache_mode": "last"})]


@pytest.mark.parametrize("arch, options", CASES, ids=[f"{a}-{'-'.join(map(str, o.values())) or 'plain'}"
                                                      for a, o in CASES])
def test_openai_client_gives_the_engines_greedy_tokens(servers, models, arch, options):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=servers[arch].url + "/v1", api_key="unused", max_retries=0,
                           timeout=CALL_TIMEOUT_S)
    expected, info = expected_greedy(models[arch], PROMPT, NEW_TOKENS, **options)
    kwargs = dict(model=arch, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, logprobs=0, extra_body=options)
    plain = client.completions.create(**kwargs)
    choice = plain.choices[0]
    assert choice.logprobs.tokens == strings(expected)
    assert choice.text == TOK.decode(expected)
    assert choice.finish_reason == ("length" if len(expected) == NEW_TOKENS else "stop")
    assert plain.usage.prompt_tokens == 1 + len(PROMPT)
    assert plain.usage.completion_tokens == len(expected) + (choice.finish_reason == "stop")  # the stop token too
    report = plain.model_extra["latentloop"]
    assert report["arch"] == arch and all(report["options"][k] == v for k, v in options.items())
    for name, value in info.items():  # what the regime did: prefill passes, mean exit depth
        assert report["choices"][0][name] == pytest.approx(value), name
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens] == strings(expected)
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_concurrent_requests_batch_and_each_matches_its_single_result(servers, models):
    """16 requests at once, of different lengths and options, greedy and seeded sampling: each
    gets what the engine gives it alone, and the server decoded rows together."""
    server, model = servers["fbt"], models["fbt"]
    text = "import os\nclass Loop:\n    def step(self, state):\n        return state"
    regimes = [{}, {"regime": "standard"}, {"regime": "fused", "passes": 2}, {"regime": "soft"}]
    jobs = []
    for i in range(16):
        body = {"prompt": text[:5 + 3 * i], "max_tokens": 4 + i % 7, "temperature": 0, **regimes[i % 4]}
        if i in (5, 11):  # seeded sampling: its own engine call, so it reproduces `generate` with that seed
            body.update(temperature=0.9, top_k=40, seed=100 + i)
        if i in (6, 13):  # passes="auto" settles for the whole batch: decoded alone, as its passes show
            body.update(regime="fused", passes="auto")
        jobs.append(body)
    before = server.stats()["batches"]

    def send(body):
        return httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 0}, timeout=CALL_TIMEOUT_S)

    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(send, jobs))
    for body, reply in zip(jobs, replies):
        assert reply.status_code == 200, reply.text
        options = {k: v for k, v in body.items() if k in ("regime", "passes")}
        ids = [TOK.bos_id] + TOK.encode(body["prompt"])
        expected = ll.generate(model, ids, body["max_tokens"], temperature=body["temperature"],
                               top_k=body.get("top_k"), seed=body.get("seed"), stop_tokens=STOPS, **options)
        assert reply.json()["choices"][0]["logprobs"]["tokens"] == strings(expected), body
        if options.get("passes") == "auto":
            alone = list(ll.stream(model, ids, 1, temperature=0.0, **options))[0].info["prefill_passes"]
            assert reply.json()["latentloop"]["choices"][0]["prefill_passes"] == alone
    stats = server.stats()
    assert stats["max_batch_rows"] > 1 and stats["batches"] - before < len(jobs)
    assert max(r.json()["latentloop"]["batch_rows"] for r in replies) > 1
    assert stats["active_rows"] == 0 and stats["queued"] == 0


# Requests that differ in sampling settings and seeds: (prompt, max_tokens, sampling fields, n)
SAMPLED = [("import", 5, {"temperature": 0.9, "top_k": 20, "seed": 1}, 1),
           ("class Loop:", 6, {"temperature": 1.1, "top_p": 0.8, "seed": 2}, 2),
           ("x", 4, {"temperature": 0.7, "seed": 3}, 1),
           ("return state", 6, {"temperature": 0}, 1),
           ("for i in", 5, {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 4}, 1)]
# The request already decoding when the others arrive (greedy): long enough to still be decoding when
# they do (20 steps of a tiny gpt end within milliseconds on a quiet machine, before any joined);
# rgpt's slower steps overlap at 20, and more of them outlast its server's --request-timeout on a
# loaded machine
LONG_TOKENS = {"rgpt": 20}
LONG_TOKENS_DEFAULT = 96  # with PROMPT and BOS, within CONTEXT
# ... and rgpt's requests all run this many recurrence steps (the same options: one batch), so that
# its 20 steps last: at its default depth the long request could stop early at a stop token and end
# within ~60 ms on a quiet machine, before any request joined (a failure seen once in three runs)
JOIN_OPTIONS = {"rgpt": {"steps": SLOW_STEPS}}
# The whole exchange is tried again (each time exact) when the long request ended before any other
# joined it: how soon the others arrive depends on the machine's load (a whole suite beside them; the
# long request lasts 60-130 ms on a quiet machine, and mor's once ended first in all of 3 attempts)
JOIN_ATTEMPTS = 10
# ... and the full-queue exchange, when the test stalled past the 1.5 s batch window before its second request
QUEUE_ATTEMPTS = 3
LONG_PROMPTS = (PROMPT, "class Loop:\n    ", "import os\n", "x = [1, ", "while True:\n    ", "# a note\n")
SCHEDULERS = {**{arch: arch for arch in ARCHS}, "rounds": "fbt"}  # server -> its model's arch


@pytest.mark.parametrize("server_name", list(SCHEDULERS))
def test_concurrent_requests_with_different_sampling_each_equal_alone(servers, models, server_name):
    """While one request decodes, requests with other prompts, lengths, temperatures, top_k, top_p,
    seeds and n arrive together: each gets exactly what the engine gives it alone (the continuous
    scheduler joins them to the running batch; the round scheduler runs them in the next round)."""
    server, model = servers[server_name], models[SCHEDULERS[server_name]]
    long_tokens_wanted = LONG_TOKENS.get(SCHEDULERS[server_name], LONG_TOKENS_DEFAULT)
    options = JOIN_OPTIONS.get(SCHEDULERS[server_name], {})
    cases = [(prompt, max_tokens, {**sampling, **options}, n) for prompt, max_tokens, sampling, n in SAMPLED]
    before = server.stats()

    def expected(prompt: str, max_tokens: int, sampling: dict, n: int) -> list[list[int]]:
        ids = [TOK.bos_id] + TOK.encode(prompt)
        return ll.generate(model, [ids] * n, max_tokens, stop_tokens=STOPS, **{"temperature": 1.0, **sampling})

    # one client per request, connected before the long request starts: the requests then arrive within
    # milliseconds of its first token (opening the connections then let a fast long request end first)
    clients = [httpx.Client(base_url=server.url, timeout=CALL_TIMEOUT_S) for _ in cases]
    for client in clients:
        client.get("/health")

    def send(client_and_case) -> httpx.Response:
        client, (prompt, max_tokens, sampling, n) = client_and_case
        return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "n": n,
                                                    "logprobs": 0, **sampling})

    # random weights stop early at a stop token for some prompts (mor: after 27 tokens, 12 ms): the first
    # prompt whose greedy decode runs its whole budget
    greedy = {"temperature": 0, **options}
    budget = long_tokens_wanted
    runs_its_budget = [p for p in LONG_PROMPTS if len(expected(p, budget, greedy, 1)[0]) == budget]
    long_prompt = (runs_its_budget or LONG_PROMPTS)[0]
    long_body = {"prompt": long_prompt, "max_tokens": long_tokens_wanted, "temperature": 0, "logprobs": 0,
                 "stream": True, **options}

    def exchange() -> tuple[list[dict], list[httpx.Response]]:
        """The long request's stream, and the others sent once its first token came, each from a thread
        started before the long request (a pool starts its threads on demand)."""
        with ThreadPoolExecutor(len(cases)) as pool:
            started = threading.Barrier(len(cases))
            list(pool.map(lambda _: started.wait(CALL_TIMEOUT_S), range(len(cases))))
            with httpx.stream("POST", server.url + "/v1/completions", json=long_body, timeout=CALL_TIMEOUT_S) \
                    as reply:
                lines = reply.iter_lines()
                chunks = [json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])]
                replies = list(pool.map(send, zip(clients, cases)))
                chunks += [json.loads(line[len("data: "):]) for line in lines
                           if line.startswith("data: ") and line != "data: [DONE]"]
        return chunks, replies

    try:
        for _ in range(JOIN_ATTEMPTS):
            chunks, replies = exchange()
            assert all("choices" in c for c in chunks), chunks[-1]
            long_tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
            assert long_tokens == strings(expected(long_prompt, long_tokens_wanted, greedy, 1)[0]), "the long request"
            for case, reply in zip(cases, replies):
                assert reply.status_code == 200, reply.text
                choices = reply.json()["choices"]
                assert [c["logprobs"]["tokens"] for c in choices] == [strings(ids) for ids in expected(*case)], case
            stats = server.stats()
            assert stats["active_rows"] == 0 and stats["queued"] == 0, stats
            if server_name == "rounds" or stats["rows_joined_running"] > before["rows_joined_running"]:
                break
    finally:
        for client in clients:
            client.close()
    if server_name != "rounds":  # (a failure here: in every attempt the long request ended before the others arrived)
        assert stats["rows_joined_running"] > before["rows_joined_running"], (before, stats, len(long_tokens))


@pytest.mark.parametrize("server_name", ["fbt", "rounds"])
def test_a_seeded_request_of_several_prompts_draws_each_prompts_own_tokens(servers, models, server_name):
    """A seeded request reproduces `ll.generate(..., seed=S)` row by row under both schedulers: the
    round scheduler sorted a request's rows longest prompt first, so with its prompts in another
    order each prompt got another's draws (12-06 review)."""
    prompts = ["b", "a much longer prompt"]  # shortest first: the sort reversed them
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 1.0, "seed": 5, "logprobs": 0}
    reply = post(servers[server_name], body)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    want = ll.generate(models[SCHEDULERS[server_name]], [[TOK.bos_id] + TOK.encode(p) for p in prompts], 8,
                       stop_tokens=STOPS, temperature=1.0, seed=5)
    assert [c["logprobs"]["tokens"] for c in choices] == [strings(ids) for ids in want]


def test_echo_logprobs_score_the_prompt(servers, models):
    """echo + logprobs + max_tokens 0 gives each prompt token's log-probability (what lm-eval's
    loglikelihood reads), equal to the model's own scoring of the text."""
    server, model = servers["gpt"], models["gpt"]

    def echo(prompt):
        return httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                                                "logprobs": 1}, timeout=CALL_TIMEOUT_S).json()

    reply = echo(PROMPT)
    (first,) = reply["choices"]
    assert first["text"] == PROMPT and first["logprobs"]["tokens"] == strings(TOK.encode(PROMPT))
    ids = [TOK.bos_id] + TOK.encode(PROMPT)
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    direct = [float(logp[j - 1, ids[j]]) for j in range(1, len(ids))]
    assert first["logprobs"]["token_logprobs"] == pytest.approx(direct, abs=1e-4)
    top = first["logprobs"]["top_logprobs"]
    assert all(len(t) == 1 and max(t.values()) >= lp - 1e-6 for t, lp in zip(top, direct))
    assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    # a token prompt that starts with BOS is read as sent: BOS is echoed, with no logprob
    (second,) = echo([TOK.bos_id] + TOK.encode(PROMPT))["choices"]
    assert second["logprobs"]["tokens"] == ["<|bos|>"] + first["logprobs"]["tokens"]
    assert second["logprobs"]["token_logprobs"] == [None] + first["logprobs"]["token_logprobs"]


def test_lm_eval_local_completions_equals_the_in_process_adapter(servers, runs, monkeypatch):
    """lm-eval's own OpenAI-compatible client against the server gives the in-process adapter's
    numbers: per-request loglikelihoods (COPA) and generations (arithmetic)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (lm_eval[api])
    eval_dir = shared_data("eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from latentloop.eval import lm_eval_adapter

    manager = TaskManager(include_path=str(lm_eval_adapter.TASKS_DIR), include_defaults=False,
                          metadata={"eval_dir": str(eval_dir)})
    tasks, limit = ["latentloop_copa", "latentloop_arithmetic"], 4
    url = servers["gpt"].url
    remote = simple_evaluate(model="local-completions", tasks=tasks, task_manager=manager, limit=limit,
                             log_samples=True, model_args=f"base_url={url}/v1/completions,model=gpt,"
                                                          f"tokenizer_backend=remote,max_length={CONTEXT - 1},"
                                                          f"max_retries=1,num_concurrent=1")
    local = simple_evaluate(model="latentloop", model_args=f"pretrained={runs['gpt']}", tasks=tasks,
                            task_manager=manager, limit=limit, log_samples=True, device="cpu", batch_size=8)
    for task in tasks:
        assert remote["results"][task] == pytest.approx(local["results"][task]), task
        ours = {s["doc_id"]: s["resps"] for s in local["samples"][task]}
        theirs = {s["doc_id"]: s["resps"] for s in remote["samples"][task]}
        assert set(ours) == set(theirs) and len(ours) == limit
        for doc, responses in ours.items():
            for mine, other in zip(responses, theirs[doc]):
                if task == "latentloop_copa":  # (loglikelihood, is_greedy) of each choice
                    assert other[0][0] == pytest.approx(mine[0][0], abs=1e-4) and other[0][1] == mine[0][1]
                else:
                    assert other == mine


def post(server: Server, body, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + "/v1/completions", content=content, timeout=CALL_TIMEOUT_S,
                      headers={"Content-Type": "application/json", **headers})


KEY = {"Authorization": f"Bearer {API_KEY}"}


def test_bad_requests_get_400_and_the_server_keeps_serving(servers):
    server = servers["limits"]
    cases = [({"prompt": "x" * 200, "max_tokens": 1}, "context"),
             ({"prompt": "x", "max_tokens": 33}, "--max-tokens-cap"),
             ({"prompt": "x", "bogus": True}, "unknown field(s): bogus"),
             ({"prompt": "x", "regime": "soft"}, "arch 'gpt' does not support option(s): regime"),
             ({"prompt": "x", "max_tokens": "many"}, "max_tokens must be an integer"),
             ({"prompt": "x", "n": 0}, "n must be an integer"),
             ({"prompt": "x", "temperature": -1}, "temperature must be"),
             (b"{not json", "not valid JSON"),
             # past Python's integer conversion limit: a ValueError json names no position for, a 500
             (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "a number of more than"),
             (b"[1, 2]", "JSON object")]
    for body, words in cases:
        reply = post(server, body, **KEY)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error"
    assert post(server, {"prompt": "x"}).status_code == 401  # no key
    assert post(server, {"prompt": "x"}, Authorization="Bearer wrong").status_code == 401
    assert httpx.get(server.url + "/health", timeout=CALL_TIMEOUT_S).status_code == 200  # open to probes
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=KEY, timeout=CALL_TIMEOUT_S)
    assert chat.status_code == 400 and "no chat format" in chat.json()["error"]["message"]
    missing = httpx.post(server.url + "/v1/embeddings", json={}, headers=KEY, timeout=CALL_TIMEOUT_S)
    assert missing.status_code == 404 and "not an endpoint" in missing.json()["error"]["message"]
    assert "POST /tokenize" in missing.json()["error"]["message"]  # every endpoint listed
    # a trailing slash: a 307 with an empty body (clients do not resend the body); a long path, echoed whole
    slash = httpx.post(server.url + "/v1/completions/", json={"prompt": "x"}, headers=KEY, timeout=CALL_TIMEOUT_S)
    assert slash.status_code == 404 and "not an endpoint" in slash.json()["error"]["message"]
    long = httpx.get(server.url + "/" + "a" * 20_000, headers=KEY, timeout=CALL_TIMEOUT_S)
    assert long.status_code == 404 and len(long.text) < 2_000 and "20,001 characters" in long.text
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=CALL_TIMEOUT_S)
    with pytest.raises(openai.BadRequestError, match="--max-tokens-cap"):
        client.completions.create(model="gpt", prompt="x", max_tokens=100)
    assert [m.id for m in client.models.list().data] == ["gpt"]
    reply = post(server, {"prompt": "x", "max_tokens": 2, "temperature": 0}, **KEY)
    assert reply.status_code == 200 and reply.json()["usage"]["total_tokens"] <= 4


def test_full_queue_gets_429(servers):
    """--max-queue 1 and a 1.5 s batch window: the first request waits in the queue, the second
    is refused, the first still completes."""
    server = servers["limits"]
    for _ in range(QUEUE_ATTEMPTS):
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, server, {"prompt": "x", "max_tokens": 2}, **KEY)
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while server.stats(**KEY)["queued"] < 1 and time.monotonic() < deadline and not first.done():
                time.sleep(POLL_S)
            refused = post(server, {"prompt": "y", "max_tokens": 2}, **KEY)
            assert first.result(CALL_TIMEOUT_S).status_code == 200
        if refused.status_code != 200:  # 200: the first had left the queue already (a stall of the test's)
            break
    assert refused.status_code == 429 and "--max-queue" in refused.json()["error"]["message"]
    assert server.stats(**KEY)["rejected_queue_full"] >= 1


def test_a_client_that_hangs_up_frees_its_row(servers):
    server = servers["rgpt"]
    counted = server.stats()
    before = counted["rows_freed"]
    body = {"prompt": "x", "max_tokens": 100, "temperature": 0, "steps": SLOW_STEPS, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=CALL_TIMEOUT_S) as reply:
        first = next(line for line in reply.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
    # the connection is closed here, mid-stream
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while server.stats()["rows_freed"] == before and time.monotonic() < deadline:
        time.sleep(POLL_S)
    stats = server.stats()
    assert stats["rows_freed"] == before + 1
    while server.stats()["active_rows"] and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert server.stats()["active_rows"] == 0  # the batch was closed, not run to its end
    while server.stats()["cancelled"] == counted["cancelled"] and time.monotonic() < deadline:
        time.sleep(POLL_S)
    stats = server.stats()  # the job ended (kept, the scheduler spun a core for good) and the hang-up counted
    assert stats["cancelled"] == counted["cancelled"] + 1 and stats["disconnects"] == counted["disconnects"] + 1
    later = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=CALL_TIMEOUT_S)
    assert later.status_code == 200


def test_a_request_past_its_timeout_gets_504_and_frees_its_row(servers):
    server = servers["rgpt"]
    before = server.stats()
    start = time.monotonic()
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": CONTEXT - 2,
                                                             "temperature": 0, "steps": LONG_STEPS},
                       timeout=CALL_TIMEOUT_S)
    assert reply.status_code == 504 and "--request-timeout" in reply.json()["error"]["message"]
    assert RGPT_TIMEOUT_S <= time.monotonic() - start < CALL_TIMEOUT_S
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while server.stats()["active_rows"] and time.monotonic() < deadline:
        time.sleep(POLL_S)
    stats = server.stats()
    assert stats["timeouts"] == before["timeouts"] + 1 and stats["rows_freed"] == before["rows_freed"] + 1
    assert stats["active_rows"] == 0


def test_sigterm_ends_requests_in_flight_with_an_error_and_exits(servers):
    server = servers["doomed"]
    body = {"prompt": "x", "max_tokens": 100, "temperature": 0, "steps": SLOW_STEPS}
    results: dict[str, object] = {}

    def plain():
        results["plain"] = post(server, body)

    def streamed():
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=CALL_TIMEOUT_S) as reply:
            results["stream"] = [line for line in reply.iter_lines() if line]

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:  # one request decoding, the other waiting for the next round
        stats = server.stats()
        if stats["active_rows"] >= 1 and stats["active_rows"] + stats["queued"] >= 2:
            break
        time.sleep(POLL_S)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(EXIT_TIMEOUT_S)
        assert not thread.is_alive()
    server.proc.wait(EXIT_TIMEOUT_S)
    assert time.monotonic() - start < EXIT_TIMEOUT_S
    assert results["plain"].status_code == 503 and "shutting down" in results["plain"].json()["error"]["message"]
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(events[-2][len("data: "):])["error"]["message"]


def test_cli_refuses_an_open_host_without_a_key(runs, capsys, monkeypatch):
    monkeypatch.delenv("LATENTLOOP_API_KEY", raising=False)
    assert main(["serve", str(runs["gpt"]), "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_threads_sets_the_servers_cpu_threads(servers):
    """--threads reaches torch before the model loads, and the banner says the count (the other
    servers keep torch's choice)."""
    assert f"on cpu, {LIMITS_THREADS} threads;" in servers["limits"].log.read_text()
    assert f"on cpu, {LIMITS_THREADS} threads;" not in servers["gpt"].log.read_text()


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
@pytest.mark.parametrize("threads", ["0", "100000", "99999999999"])  # the last two: a segfault, an OverflowError
def test_threads_must_be_positive_and_bounded(command, threads, runs, capsys):
    extra = ["--prompt", "x"] if command == "generate" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(runs["gpt"]), *extra, "--threads", threads])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--threads" in err and "Traceback" not in err


@pytest.mark.parametrize("flag, value", [("--batch-window-ms", "inf"), ("--batch-window-ms", "1e300"),
                                         ("--batch-window-ms", "nan"), ("--request-timeout", "inf"),
                                         ("--request-timeout", "nan"), ("--request-timeout", "-1")])
def test_serve_refuses_time_settings_that_are_not_finite_and_bounded(flag, value, runs, capsys):
    """inf or 1e300 ms overflowed the scheduler's timed wait at the first request (its thread died,
    every request then got 503); nan passed every check and switched the setting off."""
    assert main(["serve", str(runs["gpt"]), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} must be in" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_refuses_the_compiled_path_with_rounds(runs, capsys):
    assert main(["serve", str(runs["gpt"]), "--decode", "compiled", "--batching", "rounds"]) == 2
    err = capsys.readouterr().err
    assert "--batching continuous" in err and "Traceback" not in err


@pytest.mark.parametrize("flags, words", [
    (["--decode", "eager"], "--decode compiled or auto"),
    (["--batching", "rounds"], "--batching continuous"),
])
def test_cli_refuses_a_cache_dtype_where_no_compiled_batch_runs(flags, words, runs, capsys):
    """`serve --kv-dtype` is the compiled path's cache: eager decoding and the round scheduler
    refuse it in one line, before the run is loaded."""
    assert main(["serve", str(runs["gpt"]), "--kv-dtype", "float16", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_a_compiled_server_gives_the_engines_tokens(arch, runs, tmp_path):
    """`serve --decode compiled` for every registered architecture: its step for 1, 2 and 4 rows
    compiles before the server answers (MoR's stays eager), and concurrent greedy and seeded
    requests get the engine's tokens (compiled and eager steps sum in another order: greedy ties
    on random weights could flip, so the prompts are few and short)."""
    model = ll.load(runs[arch])[0]
    with serving({arch: Server(runs[arch], tmp_path / "log", "--decode", "compiled", "--max-batch-size", "4")},
                 start_timeout=SERVER_START_COMPILED_S) as started:
        server = started[arch]
        cases = [(PROMPT, 8, {"temperature": 0}), ("x = ", 5, {"temperature": 0.9, "seed": 3}),
                 ("class", 6, {"temperature": 0})]

        def send(case):
            prompt, max_tokens, sampling = case
            return httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                                    "logprobs": 0, **sampling}, timeout=CALL_TIMEOUT_S)

        with ThreadPoolExecutor(len(cases)) as pool:
            replies = list(pool.map(send, cases))
        for (prompt, max_tokens, sampling), reply in zip(cases, replies):
            assert reply.status_code == 200, reply.text
            ids = [TOK.bos_id] + TOK.encode(prompt)
            want = ll.generate(model, ids, max_tokens, stop_tokens=STOPS, **sampling)
            assert reply.json()["choices"][0]["logprobs"]["tokens"] == strings(want), (prompt, sampling)
    log = (tmp_path / "log").read_text()
    assert ("4 rows: decode step compiled" in log) == (arch != "mor"), log[-2000:]


def test_chat_completions_render_the_sft_format_and_match_the_engine(servers, runs):
    """/v1/chat/completions renders the conversation as SFT trained it, stops at <|end|>, and gives
    the engine's greedy tokens for those ids, plain and streamed, through the official client."""
    openai = pytest.importorskip("openai")
    from latentloop.data.chat import prompt_written, render_prompt

    server, model = servers["chat"], ll.load(runs["chat"])[0]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    ids = render_prompt(CHAT_TOK, messages)
    stops = [CHAT_TOK.eos_id, CHAT_TOK.bos_id, CHAT_TOK.chat_tokens.end]
    for regime in ("standard", "soft"):
        expected = ll.generate(model, ids, NEW_TOKENS, temperature=0.0, stop_tokens=stops, regime=regime)
        text = CHAT_TOK.decode(expected)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=CALL_TIMEOUT_S)
        reply = client.chat.completions.create(model="chat", messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                                               extra_body={"regime": regime})
        assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == text and reply.usage.prompt_tokens == len(ids)
        assert reply.usage.completion_tokens == len(expected) + (reply.choices[0].finish_reason == "stop")
        pieces = list(client.chat.completions.create(model="chat", messages=messages, max_tokens=NEW_TOKENS,
                                                     temperature=0, stream=True, extra_body={"regime": regime}))
        assert pieces[0].choices[0].delta.role == "assistant"
        assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == text
    # a second turn: the first reply is the model's own, read fused as fbt wrote it and SFT trains it
    history = [*messages, {"role": "assistant", "content": "4, as 2+2 is 4"}, {"role": "user", "content": "3+3?"}]
    ids = render_prompt(CHAT_TOK, history)
    written = prompt_written(CHAT_TOK, history, ids)
    expected = ll.generate(model, ids, NEW_TOKENS, temperature=0.0, stop_tokens=stops, written=written)
    assert expected != ll.generate(model, ids, NEW_TOKENS, temperature=0.0, stop_tokens=stops)  # it tells
    for scheduled in (server, servers["chat-rounds"]):
        reply = httpx.post(scheduled.url + "/v1/chat/completions", json={"messages": history, "temperature": 0,
                                                                        "max_tokens": NEW_TOKENS},
                           timeout=CALL_TIMEOUT_S)
        assert reply.json()["choices"][0]["message"]["content"] == CHAT_TOK.decode(expected), scheduled
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]},
                     timeout=CALL_TIMEOUT_S)
    assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
    echo = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "echo": True},
                      timeout=CALL_TIMEOUT_S)
    assert echo.status_code == 400 and "echo" in echo.json()["error"]["message"]
    # what /tokenize's refusal of the chat form points to: a conversation's tokens, counted, none decoded
    counted = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 0},
                         timeout=CALL_TIMEOUT_S).json()
    assert counted["usage"]["prompt_tokens"] == len(render_prompt(CHAT_TOK, messages)), counted
    assert counted["usage"]["completion_tokens"] == 0
    refused = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=CALL_TIMEOUT_S)
    assert refused.status_code == 400 and "max_tokens 0" in refused.json()["error"]["message"]


# --------------------------------------------------------------------------------------------
# What a hostile client or a broken run cannot do: hold the event loop, the memory, the stack, the
# command line
# --------------------------------------------------------------------------------------------


def test_a_chat_template_that_renders_slowly_holds_up_nothing(servers):
    """A chat request whose template renders for ~30 s: /health and a chat request that renders
    at once are answered meanwhile, the slow one gets 504 at --request-timeout, and SIGTERM ends
    the server within seconds while a render runs (its client gets 503)."""
    if not HAS_JINJA:
        pytest.skip("chat templates need jinja2")
    server = servers["template"]
    slow = {"messages": [{"role": "user", "content": SLOW_CONTENT}], "max_tokens": 2}
    results: dict[str, object] = {}

    def send(key: str) -> None:
        start = time.monotonic()
        results[key] = httpx.post(server.url + "/v1/chat/completions", json=slow, timeout=CALL_TIMEOUT_S)
        results[key + "_s"] = time.monotonic() - start

    def wait_rendering(busy: bool = True) -> None:
        """Until a render is running (busy) or none is (the slow one ended at its time limit)."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while (httpx.get(server.url + "/v1/stats", timeout=RESPONSIVE_S).json()["rendering"] > 0) != busy:
            assert time.monotonic() < deadline, f"the slow render did not {'start' if busy else 'end'}"
            time.sleep(POLL_S)

    first = threading.Thread(target=send, args=("first",))
    first.start()
    wait_rendering()
    for _ in range(3):  # while the template renders, the loop answers
        assert httpx.get(server.url + "/health", timeout=RESPONSIVE_S).status_code == 200
    quick = httpx.post(server.url + "/v1/chat/completions", timeout=CALL_TIMEOUT_S,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert quick.status_code == 200 and quick.json()["object"] == "chat.completion"
    first.join(CALL_TIMEOUT_S)
    reply = results["first"]
    assert reply.status_code == 504, reply.text
    assert reply.json()["error"]["code"] == "timeout" and "--request-timeout" in reply.json()["error"]["message"]
    assert TEMPLATE_TIMEOUT_S <= results["first_s"] < TEMPLATE_TIMEOUT_S + RESPONSIVE_S
    # SIGTERM while a render runs: the process ends within seconds, the request with 503. The first
    # request's render outlives its 504 until the template's time limit: wait for its slot to free,
    # so the render waited for below is the second request's (else SIGTERM can beat its connection)
    wait_rendering(busy=False)
    second = threading.Thread(target=send, args=("second",))
    second.start()
    wait_rendering()
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(PROMPT_EXIT_S)
    assert time.monotonic() - start < PROMPT_EXIT_S
    second.join(CALL_TIMEOUT_S)
    assert results["second"].status_code == 503 and "shutting down" in results["second"].text


def raw_exchange(server: Server, head: bytes, pieces=()) -> bytes:
    """Send the head and the pieces on a socket of its own, then read until the server closes.
    A server that waits for more of the body never answers: the read times out."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=CALL_TIMEOUT_S) as conn:
        conn.sendall(head)
        for piece in pieces:
            conn.sendall(piece)
        reply = b""
        while chunk := conn.recv(2**16):
            reply += chunk
    return reply


def test_a_body_past_the_limit_is_refused_as_it_arrives(servers):
    """413 for an authenticated body over the limit, reading no more of it than the limit: a
    Content-Length past it is refused before any byte of the body; a chunked body gets its 413
    as soon as its bytes pass the limit, although it never ends; either way the connection closes."""
    from latentloop.serve.limits import MAX_BODY_BYTES

    server = servers["limits"]
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\n").encode()
    declared = raw_exchange(server, head + f"Content-Length: {30 * MAX_BODY_BYTES}\r\n\r\n".encode())
    assert declared.startswith(b"HTTP/1.1 413") and b"larger than" in declared
    piece = 2**20
    chunks = [b"%x\r\n" % piece + b"[" * piece + b"\r\n"] * (MAX_BODY_BYTES // piece)  # the limit exactly...
    chunks.append(b"1\r\n[\r\n")  # ... and one byte more; never the last chunk (0) that would end it
    chunked = raw_exchange(server, head + b"Transfer-Encoding: chunked\r\n\r\n", chunks)
    assert chunked.startswith(b"HTTP/1.1 413") and b"connection: close" in chunked.lower()
    assert httpx.get(server.url + "/health", timeout=CALL_TIMEOUT_S).status_code == 200


def test_a_body_that_does_not_arrive_in_time_gets_408(servers):
    """--request-timeout counts from the request's first byte: a client that sends part of its
    body and stalls gets 408 at the timeout (not a connection held open for ever)."""
    server = servers["rgpt"]
    start = time.monotonic()
    reply = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                                 b"\r\nContent-Length: 100\r\n\r\n", [b'{"prompt": "x", '])
    assert reply.startswith(b"HTTP/1.1 408") and b"--request-timeout" in reply
    assert RGPT_TIMEOUT_S <= time.monotonic() - start < CALL_TIMEOUT_S


def test_a_client_that_leaves_mid_body_is_no_server_error(servers):
    """A client that closes its connection before its body ends (a load test's client stopping) is
    counted as a disconnect: no traceback in the server's log (it was logged as an ASGI exception)."""
    server = servers["gpt"]
    before = server.stats()["disconnects"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=CALL_TIMEOUT_S) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"prompt": "x", ')
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while server.stats()["disconnects"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats()["disconnects"] == before + 1
    assert "Traceback" not in server.log.read_text()
    assert httpx.get(server.url + "/health", timeout=CALL_TIMEOUT_S).status_code == 200


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000,  # past the decoder's recursion (was 500)
                                  b'{"prompt": ' + b"[" * 900 + b"1" + b"]" * 900 + b"}"],  # decoded, past the limit
                         ids=["100k-deep", "900-deep-prompt"])
def test_a_deeply_nested_body_gets_400(servers, body):
    """Nesting is refused by its depth, before anything recurses over it (the decoder, the checks,
    an error message's repr)."""
    reply = post(servers["limits"], body, **KEY)
    assert reply.status_code == 400, reply.text
    assert "nests arrays and objects deeper than" in reply.json()["error"]["message"]


def test_cli_refuses_a_bad_or_busy_port_with_one_line(runs, capsys):
    assert main(["serve", str(runs["gpt"]), "--port", "99999"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port must be in [0, 65535]" in err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", str(runs["gpt"]), "--port", str(busy.getsockname()[1]), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen on 127.0.0.1" in err and "in use" in err


PROBE_LIMIT_S = 0.2  # serve's limit on the startup probe, in the test (a template that loops takes ~3 s)
# renders anything in ~1 s on an idle core (the probe renders three times): in the test, a loop
LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(150) %}{% endfor %}{% endfor %}" + CHATML


@pytest.mark.parametrize("template", [LOOPING_TEMPLATE, "{{ raise_exception('no probes here') }}"],
                         ids=["loops", "raises"])
def test_a_template_that_fails_the_startup_probe_stops_serve_with_one_line(tmp_path, capsys, monkeypatch,
                                                                           template):
    """serve renders a probe conversation with the chat template before it listens: one that
    fails or loops stops it (exit 2, one line) instead of a server that never listens."""
    if not HAS_JINJA:
        pytest.skip("chat templates need jinja2")
    import uvicorn

    from latentloop.serve import app

    monkeypatch.setattr(app, "CHAT_PROBE_TIMEOUT_S", PROBE_LIMIT_S)
    monkeypatch.setattr(uvicorn.Server, "run", lambda *args, **kwargs: pytest.fail("serve went on to listen"))
    run = template_run(tmp_path / "run", template)
    assert main(["serve", str(run), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "chat template" in err


def test_a_handlers_inbox_wakes_its_loop_once_per_burst_and_a_whole_response_only_at_its_end():
    """The scheduler thread posts; the handler reads on the loop. A streamed response is woken for
    its first pending event (a burst of events shares one wake-up, and a wake-up whose events were
    already read wakes nobody into an empty inbox); a response sent whole only by Done or Failed."""
    import asyncio

    from latentloop.serve.scheduler import Delta, Done
    from latentloop.serve.transport import Inbox

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        first, second, done = Delta(0, "a", []), Delta(0, "b", []), Done(3, 2, 1)
        streamed = Inbox(loop, whole=False)
        wakes = []
        real_wake = streamed._wake
        streamed._wake = lambda: (wakes.append(1), real_wake())
        # posted from this thread, the wake-up cannot run before the loop gets control back: deterministic
        streamed.post(first)
        streamed.post(second)  # the first's wake-up has not run yet: no second one
        assert await streamed.get(1.0) is first and await streamed.get(1.0) is second
        with pytest.raises(asyncio.TimeoutError):  # its wake-up comes now, and wakes nobody into an empty inbox
            await streamed.get(0.05)
        assert wakes == [1]

        whole = Inbox(loop, whole=True)
        waiter = asyncio.create_task(whole.get(CALL_TIMEOUT_S))  # outlives the sleeps and threads below
        await asyncio.sleep(0.01)  # waiting on an empty inbox
        await asyncio.to_thread(whole.post, first)
        await asyncio.sleep(0.05)
        assert not waiter.done()  # a delta of a whole response wakes nobody
        await asyncio.to_thread(whole.post, done)
        assert await waiter is first and await whole.get(1.0) is done

    asyncio.run(scenario())
