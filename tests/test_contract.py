"""The architecture contract, driven by the registry: every architecture in `ARCHS`, under each of its
declared option sets, through every front-end: the command line's `generate`, `eval` and `chat`, the
decoding API (cache == reference == scoring, ragged batches), the OpenAI-compatible server, the
Hugging Face export, upcycling from a gpt run, resumed training, the FLOPs the trainer charges and
a two-process torchrun run loaded in one process.

No architecture is named here: registering one adds it to every check, and each of its config's
declared VARIANTS (another mechanism under one arch, a routing choice say) is checked as a kind of
its own. Option sets come from the declarations (`DecodeOption`): the defaults, each choice of
every choice-option, and the minimum of every numeric one (with the choice of the option it depends
on that makes it apply). A case is skipped only for what a declaration says (an approximate cache,
rows coupled in a batch, step 0 not exact after upcycling, an option the exported code does not
take); an arch that declares no upcycling must refuse it with one line.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import json
import math
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ServeProcess, contract_kinds, count_prefill_rows, option_sets, serving, write_corpus
from safetensors.torch import load_file
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from latentloop import build
from latentloop.archs import ARCHS, build_model, build_objective, get_arch
from latentloop.checkpoint import list_checkpoints
from latentloop.cli import main
from latentloop.config import ModelConfig, RunConfig, TrainConfig
from latentloop.data.tokenizers import ByteTokenizer
from latentloop.engine import generate, model_options, stream, teacher_forced_logits
from latentloop.errors import CheckpointError, ConfigError
from latentloop.interop import initialise_from, upcycle_config
from latentloop.models.flops import BACKWARD_FACTOR
from latentloop.runs import load_run, save_run

REPO = Path(__file__).resolve().parents[1]

PROMPT = "hi"
NEW_TOKENS = 4


def _flags(given: dict) -> list[str]:
    return [part for name, value in given.items() for part in (f"--{name.replace('_', '-')}", str(value))]


KINDS = contract_kinds()  # name -> (arch, model fields): every arch, and each declared variant of it


def _arch(kind: str) -> str:
    return KINDS[kind][0]


def _build(kind: str):
    """A random `test`-preset model of this kind."""
    arch, fields = KINDS[kind]
    return build(arch, preset="test", **fields)


def _set_flags(kind: str) -> list[str]:
    """The `--set` flags that make a run of this kind (its variant's fields)."""
    return [part for name, value in KINDS[kind][1].items() for part in ("--set", f"{name}={value}")]


CASES = [(kind, label, given) for kind, (arch, _) in KINDS.items()
         for label, given in option_sets(get_arch(arch).options).items()]
# Processes started here (servers) get one thread too: at these sizes a second one buys nothing, and on
# busy cores OpenMP threads that wait for each other make a training step 10-20x slower (measured)
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread in this process, for the reason above."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per architecture: a random `test`-preset run and a short SFT of it (chat tokens)."""
    root = tmp_path_factory.mktemp("contract")
    made = {}
    for kind in KINDS:
        torch.manual_seed(0)
        base = root / f"{kind}-base"
        save_run(_build(kind), ByteTokenizer(), base)
        sft = root / f"{kind}-sft"
        assert main(["train", "--stage", "sft", "--init-from", str(base), "--data", "chat:task:addition_steps:n=64",
                     "--steps", "2", "--batch-size", "2", "--out", str(sft), "--no-progress",
                     "--set", "eval_batches=1"]) == 0, kind
        made[kind] = (base, sft)
    return made


def test_option_sets_cover_every_declared_choice():
    for arch, spec in ARCHS.items():
        labels = option_sets(spec.options)
        for option in spec.options:
            for choice in option.choices:
                assert any(given.get(option.name) == choice for given in labels.values()), (arch, option.name)


@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_cli_generate_equals_the_api_for_every_option_set(kind, label, given, runs, capsys):
    base, _ = runs[kind]
    capsys.readouterr()
    code = main(["generate", str(base), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                 "--temperature", "0", "--json", *_flags(given)])
    out = capsys.readouterr()
    assert code == 0, out.err
    ids = json.loads(out.out)["ids"]
    assert ids == _api_greedy(base, given)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_cli_generate_takes_a_cache_dtype_for_the_compiled_step_and_refuses_it_eagerly(kind, runs, capsys):
    """`--kv-dtype` reaches the engine for every architecture: refused with `--decode eager` (the
    engine's own check: one line, exit 2); with `--decode auto`, taken where the arch's step compiles
    (the eager steps of so short a decode give the API's tokens), refused where it never does (mor:
    the cache kept the model's dtype without a word)."""
    from latentloop.inference.fast import fallback_reason
    from latentloop.runs import load_run

    base, _ = runs[kind]
    capsys.readouterr()
    argv = ["generate", str(base), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0",
            "--json", "--kv-dtype", "float16"]
    assert main([*argv, "--decode", "eager"]) == 2
    err = capsys.readouterr().err
    assert "compiled step's cache" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    model = load_run(base)[0]
    reason = fallback_reason(model, model_options(model, {}))
    if reason is not None:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "this decoding does not compile" in err and reason in err and len(err.strip().splitlines()) == 1
        return
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == _api_greedy(base, {})[0]


@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_cli_eval_scores_every_option_set_as_score_run(kind, label, given, runs, text_corpus, capsys):
    """`latentloop eval` with each option set's flags (none: the arch's default scoring modes) prints
    exactly what `score_run` gives for those options, intervals included."""
    from latentloop.eval import score_run, text_batches
    from latentloop.runtime import eval_data

    base, _ = runs[kind]
    capsys.readouterr()
    code = main(["eval", str(base), "--json", "--no-progress", "--batches", "1", "--batch-size", "2",
                 "--data", f"text:{text_corpus}", *_flags(given)])
    out = capsys.readouterr()
    assert code == 0, out.err
    printed = json.loads(out.out)
    model, tokenizer, config, _ = load_run(base)
    tokens = eval_data(config, tokenizer, f"text:{text_corpus}").val
    expected = score_run(model, text_batches(tokens, 2, config.model.sequence_len, 1, bos_id=tokenizer.bos_id),
                         tokenizer.token_byte_lengths(), {"given": given} if given else None)
    shown = printed.get("by_option") or {printed["scored_as"]: {k: printed[k] for k in next(iter(expected.values()))}}
    assert shown == expected


@pytest.mark.parametrize("kind", list(KINDS))
def test_cli_eval_curves_are_the_specs_or_refused(kind, runs, text_corpus, capsys):
    """`latentloop eval --passes-curve` prints the curve the arch's spec offers, summed by
    `score_curve` over the same batches; an arch whose spec offers none refuses it in one line."""
    from latentloop.eval.loss import score_curve
    from latentloop.runtime import eval_data

    base, _ = runs[kind]
    capsys.readouterr()
    code = main(["eval", str(base), "--json", "--batches", "1", "--batch-size", "2",
                 "--data", f"text:{text_corpus}", "--passes-curve"])
    out = capsys.readouterr()
    model, tokenizer, config, _ = load_run(base)
    curve = get_arch(config.model.arch).curves.get("passes_curve")
    assert ("eval curve batches" in out.err) is (curve is not None)  # its bar: T passes a batch take long
    if curve is None:
        assert code == 2 and "--passes-curve needs a run of" in out.err and "Traceback" not in out.err
        return
    assert code == 0, out.err
    tokens = eval_data(config, tokenizer, f"text:{text_corpus}").val
    expected = score_curve(model, curve, tokens, tokenizer.token_byte_lengths(), 2, config.model.sequence_len, 1)
    assert json.loads(out.out)["passes_curve"] == expected and "fixed_point" in expected


def _api_greedy(run: Path, given: dict) -> tuple[list[int], object]:
    """The API's greedy tokens for PROMPT as the front-ends read it ([BOS] + text, stopping at EOS or
    BOS), and the run's tokenizer."""
    model, tokenizer, _, _ = load_run(run)
    prompt_ids = [tokenizer.bos_id] + tokenizer.encode(PROMPT)
    return generate(model, prompt_ids, NEW_TOKENS, temperature=0.0,
                    stop_tokens=[tokenizer.eos_id, tokenizer.bos_id], **given), tokenizer


@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_cli_chat_after_sft_answers_for_every_option_set(kind, label, given, runs, capsys, monkeypatch):
    _, sft = runs[kind]
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("what is 2+2?\n/reset\nand 3+4?\n/quit\n"))
    code = main(["chat", str(sft), "--max-new-tokens", "3", *_flags(given)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.count("> ") >= 3 and "[new conversation]" in out.out


# -- the decoding contract, through the API ---------------------------------------------------------
# fp32: two paths computing the same function (the decoding protocol's bar), absolute plus relative to
# the value: log-probabilities of size ~3 computed through a recurrent depth in each of T Jacobi passes
# (rfbt's soft reference) against one-token cached steps differ by rounding up to 1.1e-5 (measured)
TOL, RTOL = 1e-5, 1e-5
BOS = 256  # the byte tokenizer's
PROMPTS = ([BOS, *b"hello"], [BOS, *b"a latent"])  # of different lengths: a ragged batch
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def models():
    made = {}
    for kind in KINDS:
        torch.manual_seed(0)
        made[kind] = _build(kind).eval()
    return made


def _decode(model, prompt, given, **kwargs):
    steps = list(stream(model, prompt, DECODE_STEPS, temperature=0.0, logprobs=True, **given, **kwargs))
    return [s.tokens[0] for s in steps], torch.tensor([s.logprobs[0] for s in steps])


def _exact_cache(model, given) -> bool:
    """Whether the declarations call the cache exact with these options. An approximate cache (rgpt's
    mean / last) makes decoding depend on how tokens are grouped into calls, so neither the reference
    path nor teacher-forced scoring (the rest of a text in one call) computes what token-by-token
    decoding does."""
    filled = model_options(model, given)
    return all(option.exact_with_cache(filled[option.name]) for option in model.OPTIONS)


def _has_a_reference(model, given) -> bool:
    """Whether the uncached reference path is defined for these options (some need the cache)."""
    try:
        model_options(model, given, cached=False)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_cached_decoding_equals_the_reference_path_and_scoring(kind, label, given, models):
    model = models[kind]
    prompt = PROMPTS[0]
    tokens, logprobs = _decode(model, prompt, given)
    if not _exact_cache(model, given):
        pytest.skip(f"{label}: the declaration calls this cache approximate")
    if _has_a_reference(model, given):
        ref_tokens, ref_logprobs = _decode(model, prompt, given, use_cache=False)
        assert tokens == ref_tokens
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=RTOL, atol=TOL)
    full = torch.tensor([prompt + tokens])
    scored = teacher_forced_logits(model, full, prompt_len=len(prompt), **given)  # (1, T, V)
    scored = torch.log_softmax(scored[0, len(prompt) - 1:-1].float(), -1)
    torch.testing.assert_close(scored.gather(-1, torch.tensor(tokens)[:, None])[:, 0], logprobs, rtol=RTOL,
                               atol=TOL)


@torch.no_grad()
@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_rows_that_share_a_prompt_score_as_each_alone(kind, label, given, models, monkeypatch):
    """Scoring (`teacher_forced_logits(share_prompts=True)`, CORE's multiple choice): rows that repeat a prompt (a
    question's choices) prefill it once and copy its cache rows; each row's logits equal its own
    alone, left-padded prompts included. Where the declarations say the rows of a prefill are coupled,
    each row is prefilled."""
    from latentloop.engine import left_pad
    from latentloop.models.options import couples_rows

    model = models[kind]
    question, other = [BOS, *b"which one?"], [BOS, *b"no"]
    doubled = [BOS, *question]  # the question's tokens once it is padded with BOS: a prompt of its own
    choices = [b" yes.", b" no!", b" maybe", b" it is"]
    rows = [question + list(c) for c in choices[:3]] + [other + list(choices[3])] + [question + list(choices[3])]
    rows.append(doubled + list(choices[0]))
    prompt_lengths = [len(question)] * 3 + [len(other)] + [len(question)] + [len(doubled)]
    # contexts left-padded with BOS to one column (as CORE lays a batch out), continuations after it
    contexts, mask = left_pad([row[:n] for row, n in zip(rows, prompt_lengths)], BOS, torch.device("cpu"))
    P = contexts.shape[1]
    tails = [row[n:] for row, n in zip(rows, prompt_lengths)]
    width = max(len(t) for t in tails)
    continuation = torch.tensor([t + [0] * (width - len(t)) for t in tails])
    idx = torch.cat([contexts, continuation], 1)
    mask = torch.cat([mask, torch.ones_like(continuation, dtype=torch.bool)], 1)
    prefill = model.prefill
    prefilled = count_prefill_rows(monkeypatch, model)
    batched = teacher_forced_logits(model, idx, mask, prompt_len=P, share_prompts=True, **given)
    coupled = couples_rows(model.OPTIONS, model_options(model, given))
    assert prefilled == [len(rows) if coupled else 3]  # the question, the other prompt, the BOS-doubled one
    monkeypatch.setattr(model, "prefill", prefill)
    for r, (row, n) in enumerate(zip(rows, prompt_lengths)):
        alone = teacher_forced_logits(model, torch.tensor([row]), prompt_len=n, **given)[0]  # (len(row), V)
        scored = len(row) - n + 1  # the prompt's last position predicts the first continuation token
        # fp32, a ragged batch against a row alone: up to 1.1e-5 (rfbt), the same with every row prefilled
        torch.testing.assert_close(batched[r, P - 1:P - 1 + scored], alone[n - 1:], rtol=RTOL, atol=5e-5)


@torch.no_grad()
@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_the_state_a_token_carries_to_the_next_is_declared(kind, label, given, models):
    """Every `cache.state` entry whose value changes the next token's logits is in the model's
    CARRIED_STATE (what self-speculative decoding must restore when it takes tokens back; the
    registry refuses a drafting model that carries state without restoring it). Perturbing each
    entry after a decoded token shows which the next token reads."""
    model = models[kind]
    options = model_options(model, given)
    prompt = torch.tensor([PROMPTS[0]])

    def next_logits(perturbed: str | None) -> tuple[Tensor, set[str]]:
        cache = model.new_cache(1, 32, **options)
        model.prefill(prompt, cache, **options)
        model.decode(torch.tensor([[7]]), cache, **options)
        if perturbed is not None:
            value = cache.state[perturbed]
            cache.state[perturbed] = value + 1.0 if value.is_floating_point() else value + 1
        return model.decode(torch.tensor([[9]]), cache, **options).logits, set(cache.state)

    plain, keys = next_logits(None)
    read = {key for key in keys if not torch.equal(next_logits(key)[0], plain)}
    assert read <= set(model.CARRIED_STATE), f"{kind} {label}: the next token reads {sorted(read)}"


@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_a_ragged_batch_decodes_each_row_as_alone(kind, label, given, models):
    model = models[kind]
    declared = {option.name: option for option in model.OPTIONS}
    filled = model_options(model, given)
    if any(declared[name].couples_rows is not None and declared[name].couples_rows(value)
           for name, value in filled.items()):
        pytest.skip(f"{label}: the declaration says a row may decode differently in a batch")
    together = generate(model, list(PROMPTS), DECODE_STEPS, temperature=0.0, **given)
    alone = [generate(model, prompt, DECODE_STEPS, temperature=0.0, **given) for prompt in PROMPTS]
    assert together == alone


# -- the server: greedy /v1/completions == the API's generate ---------------------------------------
SERVER_CALL_S = 60  # any one request


class _Server(ServeProcess):
    """A server of one arch's run, with one torch thread (see ONE_THREAD_ENV)."""

    def __init__(self, run: Path, log: Path):
        super().__init__(run, log, env=ONE_THREAD_ENV)

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=SERVER_CALL_S) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as error:
            pytest.fail(f"{path} answered {error.code}: {error.read().decode(errors='replace')}")


@pytest.fixture(scope="module")
def servers(runs, tmp_path_factory):
    """One server per arch over its base run, all started at once so that their imports overlap."""
    pytest.importorskip("fastapi")  # the serve extra
    pytest.importorskip("uvicorn")
    logs = tmp_path_factory.mktemp("serve-logs")
    with serving({kind: _Server(runs[kind][0], logs / f"{kind}.log") for kind in KINDS}) as started:
        yield started


@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_server_greedy_completions_equal_the_api(kind, label, given, runs, servers):
    """The option set's values as request fields (the server derives them from the declarations)."""
    from latentloop.serve.protocol import special_names, token_string

    base, _ = runs[kind]
    reply = servers[kind].post("/v1/completions", {"model": base.name, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                   "temperature": 0, "logprobs": 0, **given})
    expected, tokenizer = _api_greedy(base, given)
    specials = special_names(tokenizer)
    (choice,) = reply["choices"]
    assert choice["logprobs"]["tokens"] == [token_string(tokenizer, t, specials) for t in expected]
    assert choice["text"] == tokenizer.decode(expected)
    # a stop token (never in the text) counts as generated, as OpenAI-compatible servers count it
    assert reply["usage"]["completion_tokens"] == len(expected) + (choice["finish_reason"] == "stop")
    report = reply["latentloop"]  # the options it decoded with, defaults filled in: every field given was read
    assert report["arch"] == _arch(kind) and {name: report["options"].get(name) for name in given} == given


# -- export -> transformers -> the same logits ------------------------------------------------------
# The runs here are freshly initialised: a gpt's logits are ~1e-2 (nearly uniform), so tolerances are
# absolute and small. The same function computed by separately written fp32 code (the exported module,
# or transformers' own Llama classes for a plain export) differs by rounding, ~1e-8 at most (measured:
# the exported module gives the package's bits); a wrong operation moves logits by 1e-4 and more (the
# smallest measured: an upcycled model mixing 1.8% of a previous state in, 4e-4)
EXPORT_TOL = 1e-6
EXPORT_ROWS, EXPORT_LEN = 2, 24
BYTES = 256  # the byte tokenizer's ordinary tokens (ids below BOS)


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory) -> Callable[[str], object]:
    """kind -> its base run exported with `latentloop export RUN --format hf` and loaded back with
    transformers from the local folder (once per kind, on first use)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("export")
    loaded = {}

    def load(kind: str):
        if kind not in loaded:
            out = folder / kind
            assert main(["export", str(runs[kind][0]), "--format", "hf", "--out", str(out)]) == 0, kind
            # latentloop's own modeling code ships with the folder exactly when config.json maps to it
            remote = "auto_map" in json.loads((out / "config.json").read_text())
            loaded[kind] = transformers.AutoModelForCausalLM.from_pretrained(
                str(out), trust_remote_code=remote, local_files_only=True).eval()
        return loaded[kind]

    return load


def _text_rows(bos_id: int) -> torch.Tensor:
    """(EXPORT_ROWS, EXPORT_LEN) documents to score: BOS, then random bytes (the same every call)."""
    generator = torch.Generator().manual_seed(0)
    return torch.cat([torch.full((EXPORT_ROWS, 1), bos_id),
                      torch.randint(0, BYTES, (EXPORT_ROWS, EXPORT_LEN - 1), generator=generator)], dim=1)


def _named_parameters(fn) -> set[str]:
    """The keyword arguments `fn` names (a catch-all **kwargs names none: what lands there is ignored)."""
    return {name for name, p in inspect.signature(fn).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


@pytest.mark.parametrize("kind, label, given", CASES, ids=[f"{k}-{label}" for k, label, _ in CASES])
def test_export_loads_in_transformers_with_the_same_logits(kind, label, given, runs, exported, torch_products):
    """The exported forward scores a text as the package's teacher-forced scoring does, with the
    option set's values as forward arguments (the same products on both sides: `torch_products`)."""
    hf = exported(kind)
    missing = sorted(set(given) - _named_parameters(hf.forward))
    if missing:
        pytest.skip(f"{label}: the exported model's forward takes no {', '.join(missing)}")
    model, tokenizer, _, _ = load_run(runs[kind][0])
    idx = _text_rows(tokenizer.bos_id)
    with torch.no_grad():
        theirs = hf(idx, **given).logits
    torch.testing.assert_close(theirs, teacher_forced_logits(model, idx, **given), rtol=0, atol=EXPORT_TOL)


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_export_in_bfloat16_is_the_float32_folder_loaded_in_bfloat16(kind, runs, tmp_path):
    """`export --dtype bfloat16`: transformers loads the folder in bfloat16 (its config says so) as the
    same model it makes of the float32 folder when asked for bfloat16: each weight rounded once, no
    buffer or option lost on the way (equal logits, bit for bit)."""
    transformers = pytest.importorskip("transformers")
    folders = {}
    for dtype in ("float32", "bfloat16"):
        folders[dtype] = tmp_path / dtype
        assert main(["export", str(runs[kind][0]), "--out", str(folders[dtype]), "--dtype", dtype,
                     "--no-progress"]) == 0, kind
    remote = "auto_map" in json.loads((folders["float32"] / "config.json").read_text())
    load = functools.partial(transformers.AutoModelForCausalLM.from_pretrained, trust_remote_code=remote,
                             local_files_only=True)
    written, asked = load(str(folders["bfloat16"])).eval(), load(str(folders["float32"]), dtype=torch.bfloat16).eval()
    assert next(written.parameters()).dtype == torch.bfloat16
    idx = _text_rows(load_run(runs[kind][0])[1].bos_id)
    with torch.no_grad():
        torch.testing.assert_close(written(idx).logits, asked(idx).logits, rtol=0, atol=0)


# -- upcycling from a gpt run: exact at step 0 where declared -------------------------------------
# `initialise_from` upcycles from runs of this arch only: it is the front-end's source, not an arch under test
UPCYCLE_SOURCE = "gpt"
UPCYCLE_LAYERS = 4  # room for every split a target may make of the source's blocks (prelude, core, coda)
# "exact": the target computes the source's operations, plus terms that are exactly zero at step 0;
# fp32 rounding of a different grouping is all that may differ (1.3e-8 measured; see EXPORT_TOL)
UPCYCLE_TOL = 1e-6


@pytest.fixture(scope="module")
def upcycle_source(tmp_path_factory):
    torch.manual_seed(0)
    model = build(UPCYCLE_SOURCE, preset="test", n_layer=UPCYCLE_LAYERS).eval()
    run = tmp_path_factory.mktemp("upcycle") / "source"
    save_run(model, ByteTokenizer(), run)
    return run, model


def _declared_exact(declared: str | None, model) -> Callable[[dict], bool] | None:
    """Which option sets (complete, defaults filled in) the upcycling report calls exact at step 0,
    from its `exact_at_step0`: absent (the same arch: every tensor is the source's) or "all ...":
    every set; "no ...": none (None); else "name=value[, name=value]" of declared options."""
    if declared is None or declared.startswith("all"):
        return lambda filled: True
    if declared.startswith("no"):
        return None
    options = {option.name: option for option in model.OPTIONS}
    required = {}
    for part in declared.split(","):
        name, _, value = part.strip().partition("=")
        assert name in options and value, f"exact_at_step0 {declared!r} names no declared option of the arch"
        required[name] = options[name].parse(value)
    return lambda filled: all(filled[name] == value for name, value in required.items())


@torch.no_grad()
@pytest.mark.parametrize("kind", list(KINDS))
def test_upcycling_from_a_gpt_run_is_exact_at_step_0_where_declared(kind, upcycle_source):
    run, source = upcycle_source
    arch, fields = KINDS[kind]
    model = build_model(dataclasses.replace(upcycle_config(run, arch), **fields)).eval()
    if not ARCHS[arch].upcycles and arch != ModelConfig.arch:  # the spec says it cannot: refused
        with pytest.raises(CheckpointError, match=f"no upcycling from gpt into {arch}"):
            initialise_from(model, run)
        return
    report = initialise_from(model, run)
    exact = _declared_exact(report.get("exact_at_step0"), model)
    if exact is None:
        pytest.skip(f"the upcycling report says step 0 is not exact: {report['exact_at_step0']}")
    idx = _text_rows(model.config.bos_id)
    expected = source(idx).logits
    checked = []
    for label, given in option_sets(model.OPTIONS).items():
        if exact(model_options(model, given)):
            torch.testing.assert_close(teacher_forced_logits(model, idx, **given), expected, rtol=0, atol=UPCYCLE_TOL,
                                       msg=lambda m, label=label: f"{label}: {m}")
            checked.append(label)
    assert checked, f"declared exact ({report.get('exact_at_step0')}) under none of the declared option sets"


# -- training: resume is bit-exact ------------------------------------------------------------------
RESUME_STEPS = 4  # N: one run of N steps against N / 2 steps and a resume
TRAIN_LR = "1e-2"  # large enough that a few steps move the weights well past rounding
# Every step is in the warmup, whose learning rate does not depend on the run's total steps, so that
# a run of N / 2 steps extended to N (`--resume --steps N`) is the run of N (cosine decay would not be)
TRAIN_WARMUP = 2 * RESUME_STEPS
TRAIN_SEQ_LEN = 32
TRAIN_SETTINGS = {"sequence_len": TRAIN_SEQ_LEN, "eval_every": 0, "eval_batches": 1, "log_every": 1,
                  "save_every": RESUME_STEPS // 2, "warmup_steps": TRAIN_WARMUP}


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory) -> Path:
    """A folder of small text documents, enough for a few batches of every run here."""
    return write_corpus(tmp_path_factory.mktemp("corpus"), documents=20)


def _train_argv(kind: str, corpus: Path, out: Path, steps: int) -> list[str]:
    settings = [part for name, value in TRAIN_SETTINGS.items() for part in ("--set", f"{name}={value}")]
    return ["train", "--arch", _arch(kind), "--preset", "test", "--data", f"text:{corpus}", "--steps", str(steps),
            "--batch-size", "2", "--lr", TRAIN_LR, "--out", str(out), "--no-progress", *settings, *_set_flags(kind)]


@pytest.fixture(scope="module")
def straight_runs(text_corpus, tmp_path_factory) -> Callable[[str], Path]:
    """kind -> a run of RESUME_STEPS steps in one go (checkpoints at N / 2 and N), trained on first use."""
    folder = tmp_path_factory.mktemp("straight")
    made = {}

    def run(kind: str) -> Path:
        if kind not in made:
            assert main(_train_argv(kind, text_corpus, folder / kind, RESUME_STEPS)) == 0, kind
            made[kind] = folder / kind
        return made[kind]

    return run


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(list_checkpoints(run)[-1] / "model.safetensors"))


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.parametrize("how", ["cut", "extended"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_is_bit_exact(kind, how, straight_runs, text_corpus, tmp_path):
    """cut: the straight run's own checkpoint at N / 2 (as a crash leaves it) resumed with `--resume`;
    extended: a run of N / 2 steps resumed with `--resume --steps N`. Either ends with the straight
    run's weights, bit for bit, having logged its losses."""
    straight, resumed = straight_runs(kind), tmp_path / "resumed"
    if how == "cut":
        shutil.copytree(straight, resumed)
        for later in list_checkpoints(resumed)[1:]:
            shutil.rmtree(later)
        assert [p.name for p in list_checkpoints(resumed)] == [list_checkpoints(straight)[0].name]
        assert main(["train", "--out", str(resumed), "--resume", "--no-progress"]) == 0
    else:
        assert main(_train_argv(kind, text_corpus, resumed, RESUME_STEPS // 2)) == 0
        assert main(["train", "--out", str(resumed), "--resume", "--steps", str(RESUME_STEPS), "--no-progress"]) == 0
    expected, got = _final_weights(straight), _final_weights(resumed)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert _losses(resumed) == _losses(straight)
    assert sorted(_losses(straight)) == list(range(1, RESUME_STEPS + 1))


# -- FLOPs: what an arch reports == an independent count ----------------------------------------------
# FlopCounterMode charges attention for every (query, key) pair; causal attention needs half of them,
# which is what the reported count charges (seq_len / 2 keys per query on average, see models/flops.py)
CAUSAL_SHARE = 0.5
FLOPS_RTOL = 1e-9  # both are sums of integer products; only dividing by the tokens rounds
FLOPS_STEPS = range(3)  # the first optimizer steps: an objective may draw a different forward per step
FLOPS_ROWS = 2


def _cpu_attention_flops(query, key, value, *args, **kwargs) -> int:
    """torch's own SDPA formula for the CPU kernel, which its counter does not register (torch 2.13)."""
    return sdpa_flop_count(query, key, value)


def _counted_training_forward(objective, model, step: int) -> float:
    """Training FLOPs per token counted apart from the arch's own count: the objective's whole
    forward for `step` (what a training step runs, whatever it declares), at the model's full
    context, attention from the counter's SDPA formula; times the documented backward factor."""
    T = model.config.sequence_len
    generator = torch.Generator().manual_seed(step)
    x, y = (torch.randint(0, BYTES, (FLOPS_ROWS, T), generator=generator) for _ in range(2))
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}
    model.train()
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        objective(model, x, y, step)
    counts = counter.get_flop_counts().get("Global", {})
    attention = sum(n for op, n in counts.items() if "attention" in str(op))
    products = sum(n for op, n in counts.items() if "attention" not in str(op))
    assert products > 0
    return BACKWARD_FACTOR * (products + CAUSAL_SHARE * attention) / x.numel()


@pytest.mark.parametrize("kind", list(KINDS))
def test_reported_flops_equal_an_independent_count(kind):
    """What the trainer charges per token for a step (`Objective.flops_per_token`, counted by
    models/flops.py on the forwards the objective declares, with a probe of a few tokens and
    attention added per layer application) == FlopCounterMode over the objective's actual forward
    at the full context, attention by torch's formula."""
    torch.manual_seed(0)
    model = _build(kind)
    objective = build_objective(model.config, TrainConfig())
    for step in FLOPS_STEPS:
        reported = objective.flops_per_token(model, step)
        assert reported > 0
        assert reported == pytest.approx(_counted_training_forward(objective, model, step), rel=FLOPS_RTOL), step
    assert objective.flops_per_token(model, None) > 0  # the run's average, for reports


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_trainer_logs_the_flops_the_objective_reports(kind, straight_runs):
    """metrics.jsonl's cumulative FLOPs: each step's tokens times what the objective reports for that step."""
    run = straight_runs(kind)
    config = RunConfig.from_dict(json.loads((run / "config.json").read_text()))
    model, objective = build_model(config.model), build_objective(config.model, config.train)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]
    tokens_per_step = rows[0]["tokens"]
    expected = 0.0
    for row in rows:
        expected += objective.flops_per_token(model, row["step"] - 1) * tokens_per_step
        assert row["flops"] == pytest.approx(expected, rel=FLOPS_RTOL), row["step"]


# -- two processes (torchrun, DDP), then one process loads the run ------------------------------------
# Not marked slow: one torchrun job trains every arch in turn (each process imports torch once: one
# job per arch spent ~50 s of the suite's 2 cores importing it 21 times)
DDP_WORLD = 2
DDP_STEPS = 3
TORCHRUN_TIMEOUT_S = 300  # every arch's training in one job on 2 cores


@pytest.fixture(scope="module")
def ddp_runs(text_corpus, tmp_path_factory) -> dict[str, tuple[Path, int | None, str]]:
    """kind -> (run, exit code, the job's output) of `latentloop train ...` with no strategy flag
    (auto: ddp under torchrun, as nanoGPT / torchtitan do) in a two-process torchrun job that runs
    every kind's command line in turn (tests/cli_in_turn.py), bounded in time; a kind after a
    failed one has no exit code (None)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    folder = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, **ONE_THREAD_ENV,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    commands = {kind: _train_argv(kind, text_corpus, folder / kind, DDP_STEPS) for kind in KINDS}
    (folder / "commands.json").write_text(json.dumps(commands))
    # --standalone: a rendezvous on localhost at a port of its own choosing, so the job never collides
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(DDP_WORLD),
               str(Path(__file__).with_name("cli_in_turn.py")), str(folder / "commands.json"),
               str(folder / "codes.json")]
    try:
        job = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish within {TORCHRUN_TIMEOUT_S} s")
    codes = json.loads((folder / "codes.json").read_text()) if (folder / "codes.json").exists() else {}
    output = job.stdout + job.stderr  # every command's, each after its MARKER line
    return {kind: (folder / kind, codes.get(kind), output) for kind in KINDS}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_two_process_run_loads_in_one_process(kind, ddp_runs, text_corpus):
    run, code, log = ddp_runs[kind]
    assert code == 0, log[-3000:]
    checkpoint = list_checkpoints(run)[-1]
    state = json.loads((checkpoint / "state.json").read_text())
    assert (state["world_size"], state["strategy"], state["step"]) == (DDP_WORLD, "ddp", DDP_STEPS)
    model, tokenizer, config, loaded = load_run(run)
    assert loaded == checkpoint and config.model.arch == _arch(kind)
    saved, ours = load_file(str(checkpoint / "model.safetensors")), model.state_dict()
    assert saved.keys() == ours.keys()
    for name in saved:
        torch.testing.assert_close(ours[name], saved[name], rtol=0, atol=0)
    text = sorted(text_corpus.iterdir())[0].read_text()
    x = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(text)[:TRAIN_SEQ_LEN - 1]])
    with torch.no_grad():
        logits = model(x).logits
    assert logits.shape == (1, x.shape[1], config.model.vocab_size) and torch.isfinite(logits).all()
    # the weights that load are the trained ones: their loss is below the loss of step 1 (at init)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:]).item()
    assert loss < _losses(run)[1]


# bf16 autocast against fp32 on the first step's loss, same weights and batch: bf16 keeps ~3
# significant digits in the products, and the objective's loss is a mean over every target
BF16_LOSS_RTOL = 2e-2
BF16_STEPS = 2


@pytest.mark.parametrize("kind", list(KINDS))
def test_bf16_autocast_trains_with_an_fp32_residual_stream(kind):
    """Every arch trains under `train.dtype=bfloat16` (bf16 autocast; the default on CUDA): the steps
    run and stay finite, each block's output (the residual stream) stays fp32, the first loss is
    fp32's within BF16_LOSS_RTOL and the weights stay fp32 (autocast's products are bf16 copies)."""
    from latentloop.train import FiniteGuard, train_step

    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    losses, cpu = {}, torch.device("cpu")
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = _build(kind).train()
        train = TrainConfig(steps=BF16_STEPS, batch_size=2, device="cpu", dtype=dtype)
        objective = build_objective(model.config, train)
        optimizers = get_arch(model.config.arch).build_optimizers(model, train)
        stream_dtypes: set[torch.dtype] = set()
        hooks = [block.register_forward_hook(lambda _m, _i, out, seen=stream_dtypes: seen.add(
            (out[0] if isinstance(out, tuple) else out).dtype)) for block in model.blocks]
        losses[dtype] = [train_step(model, model, objective, lambda: (x, x.roll(-1, dims=1)), step, optimizers,
                                    train, cpu, FiniteGuard(cpu)).loss for step in range(BF16_STEPS)]
        for hook in hooks:
            hook.remove()
        assert stream_dtypes == {torch.float32}, (dtype, stream_dtypes)
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(map(math.isfinite, losses["bfloat16"]))
    assert losses["bfloat16"][0] == pytest.approx(losses["float32"][0], rel=BF16_LOSS_RTOL)
