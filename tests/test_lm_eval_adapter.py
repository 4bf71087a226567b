"""The lm-evaluation-harness adapter: request handling against direct computation, and (when lm_eval
is installed and ../shared/data is present) a real lm-eval run over the local task YAMLs."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import shared_data

import latentloop
from latentloop.data import ByteTokenizer
from latentloop.engine import fit_prompt, generate, teacher_forced_logits
from latentloop.eval import lm_eval_adapter
from latentloop.eval.core import fit_row
from latentloop.eval.lm_eval_adapter import LatentloopLM
from latentloop.runs import load_run

BOS = ByteTokenizer.bos_id


def request(*args):
    return SimpleNamespace(args=args)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = latentloop.build("gpt", preset="test", n_layer=1)  # sequence_len 64
    return LatentloopLM(model=model, tokenizer=ByteTokenizer(), batch_size=4)


def sequence_logprob(model, ids: list[int], start: int) -> tuple[float, bool]:
    """Summed log-probability of ids[start:] given ids[:start], and whether greedy reproduces it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = logits.log_softmax(-1)
    targets = torch.tensor(ids[start:])
    picked = logprobs[start - 1:len(ids) - 1].gather(-1, targets[:, None]).sum()
    return float(picked), bool((logits[start - 1:len(ids) - 1].argmax(-1) == targets).all())


def window_logprob(model, context: list[int], targets: list[int]) -> float:
    """Summed log-probability of `targets` after `context` in one plain forward over the inputs
    context + targets[:-1] (the last target is never an input)."""
    with torch.no_grad():
        logprobs = model(torch.tensor([(context + targets)[:-1]])).logits[0].float().log_softmax(-1)
    return float(logprobs[len(context) - 1:].gather(-1, torch.tensor(targets)[:, None]).sum())


def test_encode_pair_moves_trailing_spaces(lm):
    assert lm.encode_pair("Hello ", "world") == ([BOS] + list(b"Hello"), list(b" world"))
    assert lm.encode_pair("", "xy") == ([BOS], list(b"xy"))


def test_loglikelihood_matches_direct_computation(lm):
    # an empty continuation first: every later result must still land on its own request
    results = lm.loglikelihood([request("x", ""), request("The cat", " sat"), request("", "ab")],
                               disable_tqdm=True)
    assert results[0] == (0.0, True)
    expected = sequence_logprob(lm.model, [BOS] + list(b"The cat sat"), 8)
    assert results[1][0] == pytest.approx(expected[0], abs=1e-4) and results[1][1] == expected[1]
    assert results[2][0] == pytest.approx(sequence_logprob(lm.model, [BOS] + list(b"ab"), 1)[0], abs=1e-4)


class MergingTokenizer(ByteTokenizer):
    """Bytes, except that "og" is one token (MERGED): "do" + "g" tokenizes across the boundary."""

    MERGED = 300

    def encode(self, text: str) -> list[int]:
        ids, raw, i = [], text.encode(), 0
        while i < len(raw):
            if raw[i:i + 2] == b"og":
                ids.append(self.MERGED)
                i += 2
            else:
                ids.append(raw[i])
                i += 1
        return ids


def test_a_continuation_merged_across_the_boundary_is_tokenized_alone():
    """Where the joint tokenization does not extend the context's (the context's last token merged with
    the continuation's first), the continuation is its own tokenization, never the joint one's tail (which
    would drop what merged: lm-eval's Hugging Face model scores [" ran"] for "do" + "g ran")."""
    model = latentloop.build("gpt", preset="test", n_layer=1)
    adapter = LatentloopLM(model=model, tokenizer=MergingTokenizer(), batch_size=4)
    assert adapter.encode_pair("a do", "g ran") == ([BOS] + list(b"a do"), list(b"g ran"))
    assert adapter.encode_pair("a cat", " ran") == ([BOS] + list(b"a cat"), list(b" ran"))  # no merge: the tail


def test_rolling_loglikelihood_windows(lm):
    short = "a short document"
    (total,) = lm.loglikelihood_rolling([request(short)], disable_tqdm=True)
    assert total == pytest.approx(sequence_logprob(lm.model, [BOS] + list(short.encode()), 1)[0], abs=1e-4)
    text = bytes(range(97, 123)).decode() * 6  # 156 tokens: windows of 64 predicted tokens
    tokens = list(text.encode())
    windows = lm.rolling_windows(tokens)
    assert [len(w[1]) for w in windows] == [64, 64, 28] and windows[1][0] == [tokens[63]]
    assert windows[2][0] == tokens[91:128]  # the last window reads 64 inputs: 37 tokens of context
    assert [t for _, targets in windows for t in targets] == tokens
    assert all(len(before) + len(targets) - 1 <= 64 for before, targets in windows)
    (total,) = lm.loglikelihood_rolling([request(text)], disable_tqdm=True)
    direct = sum(window_logprob(lm.model, before, targets) for before, targets in windows)
    torch.testing.assert_close(total, direct, rtol=0, atol=1e-3)  # 156 summed float32 log-probabilities


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 15, 16, 17, 20, 23, 24, 31])
@pytest.mark.parametrize("max_length", [2, 3, 8])
def test_rolling_windows_are_lm_evals(length, max_length):
    """The same (context, continuation) windows as lm-eval's own `get_rolling_token_windows(...,
    context_len=1)` made disjoint by `make_disjoint_window` (its Hugging Face model's convention)."""
    utils = pytest.importorskip("lm_eval.utils")
    adapter = LatentloopLM.__new__(LatentloopLM)  # only the tokenizer's BOS and the length are read
    adapter.tokenizer, adapter.max_length = ByteTokenizer(), max_length
    tokens = [(7 * i) % 251 for i in range(length)]
    theirs = [tuple(map(list, utils.make_disjoint_window(window)))
              for window in utils.get_rolling_token_windows(tokens, prefix_token=BOS, max_seq_len=max_length,
                                                             context_len=1)]
    assert [tuple(window) for window in adapter.rolling_windows(tokens)] == theirs


def test_rolling_totals_equal_one_direct_forward_per_lm_eval_window(lm):
    """Each window's total is the log-probability of its targets in one forward over its inputs
    (context + targets[:-1], at most T = 64 of them), as lm-eval's Hugging Face model computes it."""
    utils = pytest.importorskip("lm_eval.utils")
    model, T = lm.model, lm.max_length
    texts = ["x" * 64, "y" * 65, "Hello, world! " * 11, bytes(range(33, 127)).decode() * 2]
    totals = lm.loglikelihood_rolling([request(text) for text in texts], disable_tqdm=True)
    for text, total in zip(texts, totals):
        direct = 0.0
        for window in utils.get_rolling_token_windows(list(text.encode()), prefix_token=BOS, max_seq_len=T,
                                                      context_len=1):
            context, targets = utils.make_disjoint_window(window)
            assert len(context) + len(targets) - 1 <= T
            direct += window_logprob(model, context, targets)
        torch.testing.assert_close(total, direct, rtol=0, atol=1e-3)  # summed float32 log-probabilities


def test_generate_until_is_greedy_and_stops(lm):
    prompt = "Once upon"
    ids = generate(lm.model, [BOS] + list(prompt.encode()), 6, temperature=0.0, stop_tokens=[BOS, 257])
    full = ByteTokenizer().decode(ids)
    out = lm.generate_until([request(prompt, {"max_gen_toks": 6}), request(prompt, {"max_gen_toks": 6})],
                            disable_tqdm=True)
    assert out == [full, full]
    if full:
        cut = lm.generate_until([request(prompt, {"until": [full[-1]], "max_gen_toks": 6})], disable_tqdm=True)
        assert cut == [full[:full.index(full[-1])]]


def test_sampled_generations_are_the_same_whatever_the_batch_size(lm):
    """Sampled requests drew from one generator per batch: lm-eval's --batch_size changed them."""
    sampled = {"max_gen_toks": 8, "do_sample": True, "temperature": 1.0, "seed": 3}
    requests = [request(text, sampled) for text in ("Once upon", "Once upon", "The cat", "A")]
    by_four = lm.generate_until(requests, disable_tqdm=True)
    one_at_a_time = LatentloopLM(model=lm.model, tokenizer=lm.tokenizer, batch_size=1)
    assert one_at_a_time.generate_until(requests, disable_tqdm=True) == by_four
    assert by_four[0] != by_four[1]  # a repeated request: samples of its own


def test_options_reach_the_model():
    model = latentloop.build("fbt", preset="test", n_layer=1)
    adapter = LatentloopLM(model=model, tokenizer=ByteTokenizer(), regime="fused", passes="2")
    assert adapter.options == {"regime": "fused", "passes": 2}
    with pytest.raises(latentloop.ConfigError):
        LatentloopLM(model=model, tokenizer=ByteTokenizer(), regime="bogus")
    with pytest.raises(latentloop.ConfigError, match="pretrained"):
        LatentloopLM()


def test_main_without_lm_eval(monkeypatch, capsys):
    monkeypatch.setattr(lm_eval_adapter, "HAVE_LM_EVAL", False)
    assert lm_eval_adapter.main(["--help"]) == 2
    assert "lm_eval is not installed" in capsys.readouterr().err


def _row_score(model, context: list[int], continuation: list[int], options: dict) -> tuple[float, bool]:
    """Log-probability and greedy match of one continuation, alone, straight from the engine's
    teacher-forced logits (the pair cut to the context by the documented rule, `fit_row`)."""
    context, continuation = fit_row(context, continuation, model.config.sequence_len)
    inputs = (context + continuation)[:-1]  # the last token is a target only
    logits = teacher_forced_logits(model, torch.tensor([inputs]), prompt_len=len(context), **options)
    predicting = logits[0, len(context) - 1:].float()
    targets = torch.tensor(continuation)
    return float(predicting.log_softmax(-1).gather(-1, targets[:, None]).sum()), \
        bool((predicting.argmax(-1) == targets).all())


def _expected_scores(run, eval_dir, limit: int, options: dict) -> dict[str, float]:
    """What the four local tasks must report for the first `limit` rows of their files, computed here
    from the task definitions (prompt, delimiter, metric) without lm-eval or the adapter."""
    model, tokenizer, _, _ = load_run(run, torch.device("cpu"))
    encode = tokenizer.encode

    def rows(name):
        lines = (eval_dir / name).read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()][:limit]

    copa = [max(range(len(row["choices"])), key=lambda i, row=row: _row_score(
        model, [BOS] + encode(row["query"]), encode(" " + row["choices"][i]), options)[0]) == row["gold"]
            for row in rows("copa.jsonl")]
    lambada = [_row_score(model, [BOS] + encode(row["context"].strip()), encode(" " + row["continuation"]), options)
               for row in rows("lambada_openai.jsonl")]
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    rolling, rolling_bytes = 0.0, 0
    for row in rows("lambada_openai.jsonl"):  # lm-eval's rolling windows (context_len=1), made disjoint
        text = row["context"].strip() + " " + row["continuation"]
        windows = get_rolling_token_windows(encode(text), prefix_token=BOS, max_seq_len=model.config.sequence_len,
                                            context_len=1)
        rolling += sum(_row_score(model, *map(list, make_disjoint_window(window)), options)[0] for window in windows)
        rolling_bytes += len(text.encode())
    new_tokens = 8  # the task's max_gen_toks
    arithmetic = []
    for row in rows("simple_arithmetic_nospaces.jsonl"):
        prompt, _ = fit_prompt([BOS] + encode(row["context"]), model.config.sequence_len - new_tokens, BOS)
        ids = generate(model, prompt, new_tokens, temperature=0.0, stop_tokens=[BOS, tokenizer.eos_id, *encode("\n")],
                       **options)
        arithmetic.append(tokenizer.decode(ids).split("\n")[0] == row["continuation"])
    return {"copa_acc": sum(copa) / limit,
            "lambada_perplexity": math.exp(-sum(lp for lp, _ in lambada) / limit),
            "lambada_acc": sum(greedy for _, greedy in lambada) / limit,
            "rolling_bits_per_byte": -rolling / rolling_bytes / math.log(2),
            "arithmetic_exact_match": sum(arithmetic) / limit}


LM_EVAL_LIMIT = 2


def test_lm_eval_runs_the_local_tasks(tiny_run, monkeypatch):
    pytest.importorskip("lm_eval")
    eval_dir = shared_data("eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    run = tiny_run("fbt")
    assert lm_eval_adapter.register(), lm_eval_adapter.LM_EVAL_IMPORT_ERROR  # (seen once in a whole-suite run)
    assert get_model("latentloop") is LatentloopLM
    assert get_model("dummy") is not None  # lm-eval's own models stay available
    manager = TaskManager(include_path=str(lm_eval_adapter.TASKS_DIR), include_defaults=False,
                          metadata={"eval_dir": str(eval_dir)})
    tasks = ["latentloop_copa", "latentloop_lambada", "latentloop_lambada_rolling", "latentloop_arithmetic"]
    results = simple_evaluate(model="latentloop", model_args=f"pretrained={run},regime=soft", tasks=tasks,
                              task_manager=manager, limit=LM_EVAL_LIMIT, device="cpu", batch_size=8)
    scores = results["results"]
    expected = _expected_scores(run, eval_dir, LM_EVAL_LIMIT, {"regime": "soft"})
    reported = {"copa_acc": scores["latentloop_copa"]["acc,none"],
                "lambada_perplexity": scores["latentloop_lambada"]["perplexity,none"],
                "lambada_acc": scores["latentloop_lambada"]["acc,none"],
                "rolling_bits_per_byte": scores["latentloop_lambada_rolling"]["bits_per_byte,none"],
                "arithmetic_exact_match": scores["latentloop_arithmetic"]["exact_match,none"]}
    assert reported == pytest.approx(expected, rel=1e-4)  # the batched adapter against rows alone: rounding


def test_bad_model_args_are_one_line_never_ignored():
    """A typo among model_args (regmie=standard) was dropped and the run scored under the default
    options; batch_size=-1 generated nothing, 0 and max_gen_toks=abc ended in tracebacks (12-06 review)."""
    model = latentloop.build("fbt", preset="test", n_layer=1)
    with pytest.raises(latentloop.ConfigError, match="unknown model_args regmie: .* the architecture's options"):
        LatentloopLM(model=model, tokenizer=ByteTokenizer(), regmie="standard")
    for given in ({"batch_size": "-1"}, {"batch_size": 0}, {"max_batch_size": "0"}, {"max_gen_toks": "abc"}):
        with pytest.raises(latentloop.ConfigError, match="must be a whole number >= 1"):
            LatentloopLM(model=model, tokenizer=ByteTokenizer(), **given)


def test_a_generation_budget_past_half_the_context_keeps_half_for_the_prompt(lm, monkeypatch, capsys):
    """max_gen_toks of the whole context (gsm8k's default 256 on a 256-token model) was clamped to the
    context, leaving the prompt one token, not even BOS; lm-eval's max_new_tokens was not read."""
    from latentloop.eval import generation

    seen = []
    real = generation.generate_texts
    monkeypatch.setattr(generation, "generate_texts", lambda model, tokenizer, prompts, new, **kw:
                        seen.append((prompts, new)) or real(model, tokenizer, prompts, new, **kw))
    context = lm.max_length
    lm.generate_until([request("Once upon a time " * 20, {"max_gen_toks": context})], disable_tqdm=True)
    prompts, new = seen[-1]
    assert new == context // 2 and len(prompts[0]) == context - context // 2 and prompts[0][0] == BOS
    assert "more than half the model's context" in capsys.readouterr().err
    lm.generate_until([request("Once upon", {"max_new_tokens": 3})], disable_tqdm=True)
    assert seen[-1][1] == 3


def test_a_continuation_longer_than_the_context_is_refused_not_scored_in_part(lm):
    with pytest.raises(latentloop.ConfigError, match="longer than the model's context"):
        lm.loglikelihood([request("a", "b" * (lm.max_length + 5))], disable_tqdm=True)


def test_the_entry_point_finds_the_bundled_tasks_and_names_bad_input_in_one_line(monkeypatch, capsys):
    """`latentloop-lm-eval`: the bundled tasks' folder is added as --include_path wherever the package
    is installed (the documented relative path found nothing outside a checkout), a user's own one
    replaces it; a run that is not there and a task lm-eval does not know are one line and exit 2
    (a CheckpointError's traceback before); any other error is lm-eval's own."""
    lm_eval_main = pytest.importorskip("lm_eval.__main__")
    from latentloop.errors import CheckpointError

    seen: list[list[str]] = []
    failure: list[BaseException] = []

    def cli_evaluate():
        seen.append(list(lm_eval_adapter.sys.argv[1:]))
        if failure:
            raise failure[0]

    monkeypatch.setattr(lm_eval_main, "cli_evaluate", cli_evaluate)
    monkeypatch.setattr(lm_eval_adapter.sys, "argv", ["latentloop-lm-eval"])
    assert lm_eval_adapter.main(["--model", "latentloop", "--tasks", "latentloop_copa"]) == 0
    assert seen[-1] == ["--model", "latentloop", "--tasks", "latentloop_copa", "--include_path",
                        str(lm_eval_adapter.TASKS_DIR)]
    assert any(lm_eval_adapter.TASKS_DIR.glob("*.yaml"))
    assert lm_eval_adapter.main(["--tasks", "mine", "--include_path=/my/tasks"]) == 0
    assert seen[-1] == ["--tasks", "mine", "--include_path=/my/tasks"]
    for error, words in ((CheckpointError("no run or checkpoint at runs/nosuch"), "no run or checkpoint"),
                         (ValueError("Tasks not found: nosuch"), "Tasks not found: nosuch")):
        failure[:] = [error]
        assert lm_eval_adapter.main(["--tasks", "nosuch"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and err.startswith("latentloop: error: ")
    failure[:] = [ValueError("something else")]
    with pytest.raises(ValueError, match="something else"):
        lm_eval_adapter.main(["--tasks", "x"])


def test_model_args_name_the_batch_size_and_device_beside_lm_evals_own(tiny_run, monkeypatch):
    """lm-eval passes its --batch_size / --device to the constructor as well: model_args naming them
    was a TypeError's traceback; now model_args wins and lm-eval's fill in the rest. Its default device
    cuda:0 falls back to the CPU where there is none; a named device that is not there is refused;
    --apply_chat_template is one line before any request; an unseeded sampled generation draws from
    the seed lm-eval's --seed gave torch."""
    pytest.importorskip("lm_eval")
    run = tiny_run("gpt")
    lm = LatentloopLM.create_from_arg_string(f"pretrained={run},batch_size=3,device=cpu",
                                             {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"})
    assert lm.batch_size_rows == 3 and next(lm.model.parameters()).device.type == "cpu"
    lm = LatentloopLM.create_from_arg_string(f"pretrained={run}", {"batch_size": 2, "device": "cuda:0"})
    assert lm.batch_size_rows == 2
    if not torch.cuda.is_available():
        with pytest.raises(latentloop.ConfigError, match="cuda:1"):
            LatentloopLM.create_from_arg_string(f"pretrained={run}", {"device": "cuda:1"})
    with pytest.raises(latentloop.ConfigError, match="--apply_chat_template is not supported"):
        lm.chat_template(True)
    assert lm.chat_template(False) == ""
    prompt = [("1+1=", {"until": ["\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0})]
    draws = {}
    for seed in (1, 2, 1):
        torch.manual_seed(seed)  # what lm-eval's --seed does
        draws.setdefault(seed, []).append(lm.generate_until([request(*p) for p in prompt]))
    assert draws[1][0] == draws[1][1] != draws[2][0]


def test_a_named_eval_dir_is_the_only_place_looked(tmp_path, monkeypatch):
    """--metadata eval_dir that lacks the file is an error naming it (the search went on to the cached
    bundle and scored other data, exit 0); without one, the fallbacks are searched."""
    from latentloop.errors import DataError
    from latentloop.eval.lm_eval_tasks import utils

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "copa.jsonl").write_text("{}\n")
    assert utils.eval_file("copa.jsonl", str(tmp_path / "mine")) == tmp_path / "mine" / "copa.jsonl"
    monkeypatch.setenv("LATENTLOOP_EVAL_DIR", str(tmp_path / "mine"))
    with pytest.raises(DataError, match="not found in eval_dir"):
        utils.eval_file("copa.jsonl", str(tmp_path / "empty"))
    assert utils.eval_file("copa.jsonl") == tmp_path / "mine" / "copa.jsonl"


def test_the_command_line_takes_batch_size_and_device_in_model_args(tiny_run, monkeypatch):
    """Through lm-eval's own command line, which builds the model from a dict (`create_from_arg_obj`):
    `batch_size=` and `device=` in --model_args beside lm-eval's --batch_size / --device (a TypeError's
    traceback there, though the string path had been mended)."""
    pytest.importorskip("lm_eval")
    eval_dir = shared_data("eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    made: list[LatentloopLM] = []
    real = LatentloopLM.create_from_arg_obj.__func__

    def spy(cls, arg_dict, additional_config=None):
        made.append(real(cls, arg_dict, additional_config))
        return made[-1]

    monkeypatch.setattr(LatentloopLM, "create_from_arg_obj", classmethod(spy))
    monkeypatch.setattr(lm_eval_adapter.sys, "argv", ["latentloop-lm-eval"])
    argv = ["--model", "latentloop", "--model_args", f"pretrained={tiny_run('gpt')},batch_size=3,device=cpu",
            "--device", "cpu", "--tasks", "latentloop_copa", "--limit", "2",
            "--metadata", json.dumps({"eval_dir": str(eval_dir)})]
    assert lm_eval_adapter.main(argv) == 0
    assert [lm.batch_size_rows for lm in made] == [3]
