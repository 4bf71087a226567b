"""Generation tasks: scoring on hand-made examples through the real engine with a scripted model stub,
answer extraction, pass@k, and one end-to-end run with a real (untrained) model."""

import json
import math
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from conftest import shared_data
from torch import nn

import latentloop as ll
from latentloop.data import ByteTokenizer
from latentloop.data.tasks import get_task, parse_task_spec, spec_baselines
from latentloop.errors import ConfigError, DataError
from latentloop.eval.generation import (
    GENERATION_TASKS,
    extract_number,
    format_by_length,
    generate_texts,
    numbers_match,
    pass_at_k,
    read_jsonl,
    run_generation_tasks,
    split_task_names,
)
from latentloop.eval.stats import wilson_interval
from latentloop.eval.suite import format_suite
from latentloop.models.options import DecodeOption

TOKENIZER = ByteTokenizer()


class ScriptedModel(nn.Module):
    """Writes `respond(prompt_text)` token by token (then EOS) with one-hot logits, via the engine."""

    def __init__(self, respond, sequence_len=4096, allowed_options=()):
        super().__init__()
        self.respond = respond
        self.config = SimpleNamespace(sequence_len=sequence_len, vocab_size=TOKENIZER.vocab_size, arch="scripted")
        self.anchor = nn.Parameter(torch.zeros(1))
        self.OPTIONS = tuple(DecodeOption(name, str, None, "a test option") for name in sorted(allowed_options))
        self.prompts: list[str] = []
        self.options_seen: list[dict] = []

    def new_cache(self, batch_size, max_len=None, **options):
        return SimpleNamespace()

    def prefill(self, idx, cache, pad_mask=None, last_logits=False, **options):  # logits of every column
        return self.decode(idx, cache, pad_mask, **options)

    def decode(self, idx, cache, pad_mask=None, **options):
        self.options_seen.append(options)
        if getattr(cache, "scripts", None) is None:  # prefill: read each row's prompt
            cache.scripts, cache.position = [], 0
            for row in range(idx.shape[0]):
                ids = idx[row][pad_mask[row]] if pad_mask is not None else idx[row]
                text = TOKENIZER.decode(ids.tolist())
                self.prompts.append(text)
                cache.scripts.append(TOKENIZER.encode(self.respond(text)) + [TOKENIZER.eos_id])
        logits = torch.full((idx.shape[0], 1, TOKENIZER.vocab_size), -1e4)
        for row, script in enumerate(cache.scripts):
            logits[row, 0, script[min(cache.position, len(script) - 1)]] = 0.0
        cache.position += 1
        return SimpleNamespace(logits=logits, info={})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- pure functions --------------------------------------------------------------------------------
def test_pass_at_k_matches_hand_computation():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(3, 1, 1) == pytest.approx(1 / 3)
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 10, 1) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


@pytest.mark.parametrize("text, number", [
    ("She has 3 + 4 = 7 eggs #### 7", "7"),
    ("so the total is 1,200 dollars. #### 1,250\nQuestion: 99", "1250"),
    ("The answer is $42.", "42"),
    ("first 3 then -3.5 then", "-3.5"),
    ("no digits here", None),
    ("#### .5", ".5"),
])
def test_extract_number(text, number):
    assert extract_number(text) == number


def test_numbers_match():
    assert numbers_match("18.0", "18") and numbers_match("1000", "1,000") and numbers_match("-3", "-3.00")
    assert not numbers_match("17", "18") and not numbers_match(None, "1") and not numbers_match("x", "1")


def test_split_task_names_keeps_knobs_together():
    assert split_task_names("gsm8k, addition:digits=3,test=4-5,s5") == ["gsm8k", "addition:digits=3,test=4-5", "s5"]


# -- generation plumbing ---------------------------------------------------------------------------
def test_generate_texts_cuts_at_stop_strings_and_counts_trace_tokens():
    responses = {"a": "12 #### 3\n\nQuestion: more", "bb": "no stop here", "ccc": "x\ny"}
    model = ScriptedModel(lambda prompt: responses[prompt])
    prompts = [[TOKENIZER.bos_id] + TOKENIZER.encode(p) for p in responses]
    out = generate_texts(model, TOKENIZER, prompts, 40, stops=("\n\n", "Question:"), batch_size=2)
    assert [g.text for g in out] == ["12 #### 3", "no stop here", "x\ny"]
    assert [g.tokens for g in out] == [9, 12, 3]
    lines = generate_texts(model, TOKENIZER, prompts, 40, stops=("\n",))
    assert [g.text for g in lines] == ["12 #### 3", "no stop here", "x"]
    assert [g.tokens for g in lines] == [9, 12, 1]
    capped = generate_texts(model, TOKENIZER, prompts, 5)
    assert [g.text for g in capped] == ["12 ##", "no st", "x\ny"]


def test_sampled_generations_do_not_change_with_the_batch_size_or_the_other_prompts():
    """HumanEval's samples (samples > 1) were drawn with one generator per batch: they changed with
    --batch-size and --limit."""
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test").eval()
    prompts = [[TOKENIZER.bos_id] + TOKENIZER.encode(text) for text in ("def f(", "x = ", "def f(", "import ")]
    sampled = dict(temperature=0.9, seed=5, options={"compile": False})
    by_one = [g.text for g in generate_texts(model, TOKENIZER, prompts, 12, batch_size=1, **sampled)]
    assert by_one == [g.text for g in generate_texts(model, TOKENIZER, prompts, 12, batch_size=3, **sampled)]
    assert by_one[:2] == [g.text for g in generate_texts(model, TOKENIZER, prompts[:2], 12, batch_size=4, **sampled)]
    assert by_one[0] != by_one[2]  # two samples of one prompt: draws of their own


def test_reasoning_task_accuracy_trace_length_and_options():
    task = get_task("addition")
    examples = task.examples("test", 8, 0)
    right = {ex.prompt: ex.completion for ex in examples[:6]}

    def respond(prompt):  # 6 of 8 right; a newline ends the answer, whatever follows is ignored
        return (right[prompt] if prompt in right else "0") + "\n999"

    model = ScriptedModel(respond, allowed_options={"regime"})
    result = GENERATION_TASKS["addition"](model, TOKENIZER, None, {"regime": "soft"}, 8, False)
    assert result["n"] == 8 and result["accuracy"] == pytest.approx(6 / 8)
    expected = [len(ex.completion) for ex in examples[:6]] + [1, 1]
    assert result["mean_trace_tokens"] == pytest.approx(sum(expected) / 8)
    assert all(options == {"regime": "soft"} for options in model.options_seen)
    assert sorted(model.prompts) == sorted(ex.prompt for ex in examples)
    steps = {str(ex.steps) for ex in examples}
    assert set(result["accuracy_by_steps"]) == steps
    assert {"seconds", "max_new_tokens", "examples"} <= set(result)
    with pytest.raises(ConfigError, match="regime"):
        GENERATION_TASKS["addition"](ScriptedModel(respond), TOKENIZER, None, {"regime": "soft"}, 2, False)


def test_reasoning_task_with_written_steps_checks_the_final_answer():
    examples = get_task("multiplication_steps").examples("test", 4, 0)
    answers = {ex.prompt: ex for ex in examples}

    def respond(prompt):  # right work and answer for two; right work but a wrong answer for the others
        ex = answers[prompt]
        return ex.completion if ex is examples[0] or ex is examples[1] else ex.work + ";1"

    result = run_generation_tasks(ScriptedModel(respond), TOKENIZER, ["multiplication_steps"], None, {}, 4, False)
    assert result["multiplication_steps"]["accuracy"] == 0.5


def test_reasoning_task_spec_with_knobs():
    task = get_task("binding:hops=2,test=7")
    examples = task.examples("test", 5, 0)
    model = ScriptedModel(lambda prompt: next(ex.answer for ex in examples if ex.prompt == prompt))
    result = run_generation_tasks(model, TOKENIZER, "task:binding:hops=2,test=7", None, {}, 5, False)
    (report,) = result.values()
    assert report["accuracy"] == 1.0 and report["accuracy_by_steps"] == {"7": 1.0}


def test_reasoning_task_report_puts_baselines_beside_accuracy_per_length():
    """Chance, copy (x itself) and majority, computed here on the very items scored, in the JSON and
    in the printed table."""
    spec = "task:iteration:k=2,test=1-3,n=500"
    task = get_task(spec)
    examples = task.examples("test", 30, 0)
    right = {ex.prompt for ex in examples[::3]}
    model = ScriptedModel(lambda prompt: next((ex.completion if ex.prompt in right else "..;x")
                                              for ex in examples if ex.prompt == prompt))
    report = run_generation_tasks(model, TOKENIZER, spec, None, {}, 30, False)[spec]
    json.dumps(report)  # what `eval --json` prints
    training = task.examples("train", 500, 0)

    def most_frequent(answers):
        counts = Counter(answers)
        return sorted(counts, key=lambda answer: (-counts[answer], answer))[0]

    majority = most_frequent(ex.answer for ex in training)
    lengths = {ex.steps for ex in training}
    at_length = {str(k): most_frequent(ex.answer for ex in training if ex.steps == k) for k in lengths}
    assert report["baselines"]["majority_answer"] == majority
    assert report["baselines"]["majority_by_length"] == at_length
    assert set(report["by_length"]) == {str(ex.steps) for ex in examples} == set(report["accuracy_by_steps"])
    for length, row in report["by_length"].items():
        items = [ex for ex in examples if str(ex.steps) == length]
        x = [re.search(r",x=(\d),", ex.prompt).group(1) for ex in items]
        assert row["n"] == len(items) and row["distinct"] == len({ex.prompt for ex in items})
        assert row["accuracy"] == pytest.approx(sum(ex.prompt in right for ex in items) / len(items))
        assert row["accuracy"] == report["accuracy_by_steps"][length]
        assert row["chance"] == pytest.approx(1 / 10)
        assert row["copy"] == pytest.approx(sum(v == ex.answer for v, ex in zip(x, items)) / len(items))
        answer = at_length.get(length, majority)  # the length's own majority; the overall one beyond the range
        assert row["majority"] == pytest.approx(sum(ex.answer == answer for ex in items) / len(items))
        # the interval counts distinct prompts (repeats decode alike), each right or not as its items are
        distinct_right = sum(prompt in right for prompt in {ex.prompt for ex in items})
        assert row["accuracy_ci"] == pytest.approx(list(wilson_interval(distinct_right, row["distinct"])))
    printed = format_suite({"tasks": {spec: report}, "missing": [], "core": None})
    header, *rows = [line for line in printed.splitlines() if line.startswith("  ")]
    assert header.split() == ["length", "n", "distinct", "accuracy", "95%", "Wilson", "chance", "copy", "majority"]
    first = report["by_length"]["1"]
    low, high = first["accuracy_ci"]
    assert rows[0].split() == ["1", str(first["n"]), str(first["distinct"]), f"{first['accuracy']:.4f}",
                               f"[{low:.3f},", f"{high:.3f}]"] + [
        f"{first[k]:.4f}" for k in ("chance", "copy", "majority")]
    assert any("copy: x itself" in line for line in rows)
    overall_right = sum(prompt in right for prompt in {ex.prompt for ex in examples})
    assert report["distinct"] == len({ex.prompt for ex in examples})
    assert report["accuracy_ci"] == pytest.approx(list(wilson_interval(overall_right, report["distinct"])))
    products = run_generation_tasks(ScriptedModel(lambda prompt: "0"), TOKENIZER, "multiplication", None, {}, 4,
                                    False)["multiplication"]
    assert all(row["chance"] is None for row in products["by_length"].values())
    assert "closed form" in "\n".join(format_by_length(products))


def test_cli_eval_prints_and_returns_baselines_per_length(tiny_run_copy, capsys):
    from latentloop.cli import main

    run = tiny_run_copy("gpt")  # eval --tasks writes RUN/evals/
    task = "task:iteration:k=2,test=1-3,n=200"
    capsys.readouterr()
    assert main(["eval", str(run), "--tasks", task, "--limit", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["tasks"][task]
    fields = {"n", "distinct", "accuracy", "accuracy_ci", "chance", "copy", "majority"}
    assert report["by_length"] and all(set(row) == fields for row in report["by_length"].values())
    assert main(["eval", str(run), "--tasks", task, "--limit", "6", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "distinct  accuracy      95% Wilson    chance      copy  majority" in printed and "copy: x itself" in printed


def test_chat_task_report_has_the_same_baselines():
    chat = ByteTokenizer(chat=True)
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test", vocab_size=chat.vocab_size)
    spec = "chat:addition_steps:digits=2,test=1-2,n=300"
    report = run_generation_tasks(model, chat, spec, None, {}, 6, False)[spec]
    parsed = parse_task_spec(spec.removeprefix("chat:"))
    expected = spec_baselines(parsed, parsed.task.examples("test", 6, parsed.seed))
    assert {length: {k: row[k] for k in ("n", "distinct", "chance", "copy", "majority")}
            for length, row in report["by_length"].items()} == expected["by_length"]
    assert report["baselines"]["majority_answer"] == expected["majority_answer"]


def test_word_problems_few_shot_prompt_and_scoring(tmp_path):
    rows = [{"context": f"Q{i} has {i} apples?", "chain_of_thought": f"It is <<{i}+0={i}>>{i}.\nSo {i}.",
             "answer": f"{i},000"} for i in range(1, 7)]
    write_jsonl(tmp_path / "gsm8k.jsonl", rows)

    def respond(prompt):
        index = int((re.findall(r"Q(\d+) has", prompt) or ["0"])[-1])
        answer = f"{index}000" if index <= 3 else "5"  # rows 1-3 right (commas ignored), 4-6 wrong
        return f" Because. #### {answer}\n\nQuestion: Q9 has"

    model = ScriptedModel(respond)
    result = GENERATION_TASKS["gsm8k"](model, TOKENIZER, tmp_path, {}, None, False, shots=3)
    assert result["n"] == 6 and result["accuracy"] == 0.5
    assert result["mean_trace_tokens"] == pytest.approx(sum(len(f" Because. #### {a}") for a in
                                                            ["1000", "2000", "3000", "5", "5", "5"]) / 6)
    for prompt in model.prompts:
        own = int(re.findall(r"Question: Q(\d+)", prompt)[-1])
        assert prompt.endswith(f"Question: Q{own} has {own} apples?\nAnswer:")
        shot = r"Question: Q(\d+) has \d+ apples\?\nAnswer: It is (\d+)\. So \d+\. #### ([\d,]+)\n\n"
        shots = re.findall(shot, prompt)
        assert len(shots) == 3 and all(int(q) != own for q, _, _ in shots)  # annotations removed, one line
        assert all(a == f"{q},000" for q, _, a in shots)
    # A short context drops the shots, then truncates the question from the left.
    small = ScriptedModel(respond, sequence_len=40)
    result = GENERATION_TASKS["gsm8k"](small, TOKENIZER, tmp_path, {}, 2, False)
    assert result["n"] == 2 and result["mean_shots_used"] == 0 and result["max_new_tokens"] == 20


def test_simple_arithmetic_and_svamp_files(tmp_path):
    write_jsonl(tmp_path / "simple_arithmetic_nospaces.jsonl",
                [{"context": "2+3=", "continuation": "5"}, {"context": "9-12=", "continuation": "-3"},
                 {"context": "4*4=", "continuation": "16"}])
    wrong = {"4*4="}
    model = ScriptedModel(lambda p: ("17" if p.endswith(tuple(wrong)) else str(eval(p.split("\n")[-1][:-1]))) + "\n1")
    result = run_generation_tasks(model, TOKENIZER, ["simple_arithmetic"], tmp_path, {}, None, False)
    assert result["simple_arithmetic"]["accuracy"] == pytest.approx(2 / 3)
    assert all(p.count("=") == 3 for p in model.prompts)  # two shots + the query
    write_jsonl(tmp_path / "svamp.jsonl", [{"context": "A?", "chain_of_thought": "( 8.0 - 7.0 )", "answer": "1"},
                                           {"context": "B?", "chain_of_thought": "( 2.0 + 2.0 )", "answer": "4"}])
    model = ScriptedModel(lambda p: " ( 8.0 - 7.0 ) #### 1.0\n\n")
    assert GENERATION_TASKS["svamp"](model, TOKENIZER, tmp_path, {}, None, False)["accuracy"] == 0.5


@pytest.mark.usefixtures("code_sandbox")
def test_humaneval_pass_at_k_runs_candidates_in_the_sandbox(tmp_path):
    problems = [
        {"task_id": "T/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "entry_point": "add",
         "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"},
        {"task_id": "T/1", "prompt": "def neg(a):\n    \"\"\"Negate.\"\"\"\n", "entry_point": "neg",
         "test": "def check(candidate):\n    assert candidate(2) == -2\n"},
    ]
    write_jsonl(tmp_path / "human_eval.jsonl", problems)
    bodies = {"add": "    return a + b\n\ndef helper():\n    raise SystemExit(0)\n", "neg": "    return a\n"}
    model = ScriptedModel(lambda p: bodies["add" if "def add" in p else "neg"])
    result = GENERATION_TASKS["humaneval"](model, TOKENIZER, tmp_path, {}, None, False)
    assert result["n"] == 2 and result["accuracy"] == 0.5 and result["pass@1"] == 0.5
    assert result["statuses"] == {"passed": 1, "failed": 1}
    assert result["examples"][0]["output"] == "    return a + b\n"  # cut before the next top-level def
    assert result["accuracy_ci"] == list(wilson_interval(1, 2))  # one sample: the interval of the figure reported
    sampled = GENERATION_TASKS["humaneval"](model, TOKENIZER, tmp_path, {}, None, False, samples=3)
    assert sampled["pass@1"] == 0.5 and "pass@10" not in sampled and sampled["temperature"] > 0
    # several samples: accuracy is the mean pass rate, which a Wilson interval of "any sample passed"
    # does not describe; no interval for it, that one under its own name
    assert sampled["accuracy"] == sampled["pass@1"] and sampled["accuracy_ci"] is None
    assert "mean pass rate" in sampled["accuracy_ci_note"]
    assert sampled["any_sample_passed"] == 0.5 and sampled["any_sample_passed_ci"] == list(wilson_interval(1, 2))


def test_errors_name_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="gsm8k.*humaneval.*addition"):
        run_generation_tasks(ScriptedModel(str), TOKENIZER, ["nope"], None, {}, 1, False)
    with pytest.raises(DataError, match="data_dir"):
        run_generation_tasks(ScriptedModel(str), TOKENIZER, ["gsm8k"], None, {}, 1, False)
    with pytest.raises(DataError, match="not found"):
        run_generation_tasks(ScriptedModel(str), TOKENIZER, ["svamp"], tmp_path, {}, 1, False)
    with pytest.raises(DataError, match="unknown knob"):
        run_generation_tasks(ScriptedModel(str), TOKENIZER, ["addition:colour=red"], None, {}, 1, False)


@pytest.mark.parametrize("task, filename, row, message", [
    ("gsm8k", "gsm8k.jsonl", {"context": ["q"], "chain_of_thought": "x", "answer": "1"},
     "'context' must be a string, got list"),
    ("gsm8k", "gsm8k.jsonl", {"context": "q", "chain_of_thought": None, "answer": "1"},
     "'chain_of_thought' must be a string, got null"),
    ("gsm8k", "gsm8k.jsonl", {"context": "q", "chain_of_thought": "x", "answer": [1]},
     "'answer' must be a string or a number, got list"),
    ("chat:gsm8k", "gsm8k.jsonl", {"context": 5, "answer": "1"}, "'context' must be a string, got int"),
    ("simple_arithmetic", "simple_arithmetic_nospaces.jsonl", {"context": {"a": 1}, "continuation": "2"},
     "'context' must be a string, got dict"),
    ("humaneval", "human_eval.jsonl", {"task_id": "t", "prompt": "p", "test": "t", "entry_point": 3},
     "'entry_point' must be a string, got int"),
    ("svamp", "svamp.jsonl", ["not", "an", "object"], "expected a JSON object, got list"),
])
def test_malformed_task_rows_are_data_errors_naming_file_and_line(tmp_path, task, filename, row, message):
    good = {"context": "1+1=", "chain_of_thought": "x", "answer": 2, "continuation": 2, "task_id": "t",
            "prompt": "def f():\n", "test": "", "entry_point": "f"}
    (tmp_path / filename).write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as caught:
        if task == "humaneval":  # the reader humaneval calls (the task itself first needs the sandbox)
            read_jsonl(tmp_path / filename, ("task_id", "prompt", "test", "entry_point"))
        else:
            run_generation_tasks(ScriptedModel(str), TOKENIZER, [task], tmp_path, {}, None, False)
    assert str(caught.value) == f"{tmp_path / filename}:2: {message}"


# -- shared data (skipped when absent) -------------------------------------------------------------
@pytest.mark.usefixtures("code_sandbox")
def test_real_humaneval_file_with_oracle_answers():
    folder = shared_data("eval")
    problems = [json.loads(line) for line in (folder / "human_eval.jsonl").open()][:3]
    solutions = {p["prompt"]: p["canonical_solution"] for p in problems}
    oracle = ScriptedModel(lambda prompt: solutions[prompt])
    result = GENERATION_TASKS["humaneval"](oracle, TOKENIZER, folder, {}, 3, False, max_new_tokens=2048)
    assert result["accuracy"] == 1.0, result["examples"]


def test_real_gsm8k_file_with_oracle_answers():
    folder = shared_data("eval")
    rows = [json.loads(line) for line in (folder / "gsm8k.jsonl").open()]
    answers = {row["context"].strip(): row["answer"] for row in rows}
    oracle = ScriptedModel(lambda prompt: f" #### {answers[prompt.split('Question: ')[-1].rsplit(chr(10), 1)[0]]}")
    assert GENERATION_TASKS["gsm8k"](oracle, TOKENIZER, folder, {}, 4, False)["accuracy"] == 1.0


# -- end to end ------------------------------------------------------------------------------------
def test_end_to_end_with_an_untrained_model():
    torch.manual_seed(0)
    model = ll.build("gpt", preset="test")
    result = run_generation_tasks(model, ByteTokenizer(), ["addition", "iteration"], None, {}, 2, False)
    for name in ("addition", "iteration"):
        report = result[name]
        assert report["n"] == 2 and 0.0 <= report["accuracy"] <= 1.0
        assert 0 <= report["mean_trace_tokens"] <= report["max_new_tokens"] and report["seconds"] >= 0


def test_a_test_split_that_repeats_prompts_gets_the_interval_of_its_distinct_prompts():
    """`addition:digits=1` has 27 distinct held-out prompts: 200 items repeat them, and repeats decode
    alike, so the interval over 200 "independent" items was [0, 0.019] for a model never right
    (12-06 review); over the distinct prompts it is as wide as they warrant."""
    spec = "task:addition:digits=1,test=1"
    report = run_generation_tasks(ScriptedModel(lambda prompt: "never"), TOKENIZER, spec, None, {}, 200,
                                  False)[spec]
    assert report["n"] == 200 and report["distinct"] < 40 and report["accuracy"] == 0
    assert report["accuracy_ci"] == pytest.approx(list(wilson_interval(0, report["distinct"])))
    assert report["accuracy_ci"][1] > 0.08
