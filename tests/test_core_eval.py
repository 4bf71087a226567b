"""CORE evaluation: prompts, scoring arithmetic on a stub with known logits, batching, centring,
data folders (local, environment, offline download), the suite's result files and the CLI."""

from __future__ import annotations

import json
import math
import random
import re
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import count_prefill_rows, shared_data
from torch import nn

import latentloop
from latentloop.archs import ARCHS
from latentloop.cli import main
from latentloop.data import ByteTokenizer
from latentloop.engine import teacher_forced_logits
from latentloop.errors import ConfigError, DataError
from latentloop.eval import core, suite
from latentloop.eval.core import (
    CORE_TASKS,
    LANGUAGE_MODELING,
    MULTIPLE_CHOICE,
    SCHEMA,
    ContinuationScore,
    centered,
    fewshot_indices,
    render_prompts,
    score_continuations,
    split_requests,
)

BOS = ByteTokenizer.bos_id
V = ByteTokenizer.vocab_size


class BigramStub(nn.Module):
    """logits[b, t] = table[idx[b, t]]: the next-token distribution depends on the current token only."""

    def __init__(self, table: torch.Tensor, sequence_len: int = 64):
        super().__init__()
        self.table = nn.Parameter(table, requires_grad=False)
        self.config = SimpleNamespace(sequence_len=sequence_len, bos_id=BOS, vocab_size=table.shape[0], arch="stub")
        self.calls: list[tuple[str, tuple[int, int]]] = []

    OPTIONS = ()  # the decoding protocol of latentloop.models.backbone, with no options

    def new_cache(self, batch_size, max_len=None, **options):
        return SimpleNamespace()

    def teacher_forced_prompt_len(self, seq_len, options):
        return seq_len

    def prefill(self, idx, cache, pad_mask=None, last_logits=False, **options):  # logits of every column
        self.calls.append(("prefill", tuple(idx.shape)))
        return SimpleNamespace(logits=self.table[idx], info={})

    def decode(self, idx, cache, **options):
        self.calls.append(("decode", tuple(idx.shape)))
        return SimpleNamespace(logits=self.table[idx], info={})

    def reference(self, idx, pad_mask=None, prompt_len=0, **options):
        self.calls.append(("reference", tuple(idx.shape)))
        return SimpleNamespace(logits=self.table[idx], info={})


def prefer(pairs: dict[str, str], strength: float = 5.0) -> torch.Tensor:
    """A bigram table favouring each `after` character after `before` (uniform elsewhere)."""
    table = torch.zeros(V, V)
    for before, after in pairs.items():
        table[ord(before), ord(after)] = strength
    return table


def logprob(table: torch.Tensor, before: str, after: str) -> float:
    return float(table[ord(before)].log_softmax(-1)[ord(after)])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- the task table, centring -----------------------------------------------------------------


def test_core_table_and_centring():
    assert len(CORE_TASKS) == 22
    assert {n: (t.num_fewshot, t.random_baseline) for n, t in CORE_TASKS.items() if n in
            ("hellaswag", "hellaswag_zeroshot", "copa", "boolq", "agi_eval_lsat_ar", "jeopardy")} == {
        "hellaswag": (10, 0.25), "hellaswag_zeroshot": (0, 0.25), "copa": (0, 0.5), "boolq": (10, 0.62),
        "agi_eval_lsat_ar": (3, 0.2), "jeopardy": (10, 0.0)}
    assert CORE_TASKS["winograd"].kind == SCHEMA and CORE_TASKS["lambada_openai"].kind == LANGUAGE_MODELING
    assert CORE_TASKS["arc_easy"].delimiter == "\nAnswer: " and CORE_TASKS["copa"].delimiter == " "
    assert centered(0.25, 0.25) == 0.0 and centered(1.0, 0.25) == 1.0
    assert centered(0.625, 0.25) == pytest.approx(0.5)
    assert centered(0.5, 0.62) == pytest.approx((0.5 - 0.62) / 0.38)
    assert centered(0.3, 0.0) == pytest.approx(0.3)


def test_task_names():
    assert core.resolve_task_names("core") == list(CORE_TASKS)
    assert core.resolve_task_names("copa, arc_easy,copa") == ["copa", "arc_easy"]
    with pytest.raises(ConfigError, match="unknown CORE task 'nope'"):
        core.resolve_task_names("copa,nope")


# -- prompts ----------------------------------------------------------------------------------


def test_fewshot_prompts_are_deterministic_and_exclude_the_example():
    for i in range(10):
        shots = fewshot_indices(10, i, 3)
        assert len(set(shots)) == 3 and i not in shots
        assert shots == fewshot_indices(10, i, 3)
        assert shots == random.Random(1234 + i).sample([j for j in range(10) if j != i], 3)
    assert sorted(fewshot_indices(3, 0, 10)) == [1, 2]  # all the others when there are too few
    assert fewshot_indices(10, 4, 0) == []


def test_render_prompts():
    mc = {"query": "Q1?", "choices": ["yes", "no"], "gold": 1}
    shot = {"query": "Q0?", "choices": ["a", "b"], "gold": 0}
    assert render_prompts(MULTIPLE_CHOICE, mc, "\nAnswer: ", [shot]) == [
        "Q0?\nAnswer: a\n\nQ1?\nAnswer: yes", "Q0?\nAnswer: a\n\nQ1?\nAnswer: no"]
    schema = {"context_options": ["Tom ate", "Ann ate"], "continuation": "the cake.", "gold": 0}
    assert render_prompts(SCHEMA, schema, " ", [schema]) == [
        "Tom ate the cake.\n\nTom ate the cake.", "Tom ate the cake.\n\nAnn ate the cake."]
    lm = {"context": "  Capital of France: ", "continuation": "Paris"}
    shot_lm = {"context": "2+2= ", "continuation": "4"}
    assert render_prompts(LANGUAGE_MODELING, lm, " ", [shot_lm]) == [
        "2+2= 4\n\nCapital of France:", "2+2= 4\n\nCapital of France: Paris"]


def test_split_requests_finds_the_continuations():
    tok = ByteTokenizer()
    mc = core._encode_all(tok, ["Q: x y", "Q: x zz"])
    assert [(len(c), bytes(x).decode()) for c, x in split_requests(MULTIPLE_CHOICE, mc)] == [(6, "y"), (6, "zz")]
    schema = core._encode_all(tok, ["A went home.", "Bob went home."])
    pairs = split_requests(SCHEMA, schema)
    assert [bytes(c[1:]).decode() for c, _ in pairs] == ["A", "Bob"] and pairs[0][1] == pairs[1][1]
    lm = core._encode_all(tok, ["2+2=", "2+2= 4"])
    assert split_requests(LANGUAGE_MODELING, lm) == [([BOS] + list(b"2+2="), list(b" 4"))]
    same = core._encode_all(tok, ["Q a", "Q a"])  # identical choices still score one token each
    assert all(len(cont) == 1 for _, cont in split_requests(MULTIPLE_CHOICE, same))


def test_hellaswag_original_format_is_converted():
    row = {"ctx_a": "A man sits on a roof.", "ctx_b": "he", "activity_label": "Roofing", "label": "2",
           "endings": ["is using wrap [title] Step one.", "falls.", "starts  pulling up roofing.", "x"]}
    item = core.normalize_row(row, MULTIPLE_CHOICE)
    assert item == {"query": "Roofing: A man sits on a roof. He", "gold": 2,
                    "choices": ["is using wrap. Step one.", "falls.", "starts pulling up roofing.", "x"]}


def test_bad_rows_name_file_and_line(tmp_path):
    path = tmp_path / "copa.jsonl"
    path.write_text('{"query": "q", "choices": ["a"], "gold": 0}\n{"query": "q"}\n')
    with pytest.raises(DataError, match=r"copa.jsonl:2: .*choices, gold"):
        core.load_examples(path, MULTIPLE_CHOICE)
    path.write_text("not json\n")
    with pytest.raises(DataError, match="copa.jsonl:1: invalid JSON"):
        core.load_examples(path, MULTIPLE_CHOICE)


MC_ROW = {"query": "q", "choices": ["a", "b"], "gold": 1}
SCHEMA_ROW = {"context_options": ["A", "B"], "continuation": "c", "gold": 0}
LM_ROW = {"context": "c", "continuation": "d"}
HELLASWAG_ROW = {"ctx_a": "a", "ctx_b": "b", "activity_label": "x", "label": "1", "endings": ["e", "f"]}


@pytest.mark.parametrize("kind, row, message", [
    (MULTIPLE_CHOICE, {**MC_ROW, "choices": []}, "'choices' is an empty list"),
    (MULTIPLE_CHOICE, {**MC_ROW, "choices": "ab"}, "'choices' must be a list of strings, got a string"),
    (MULTIPLE_CHOICE, {**MC_ROW, "choices": ["a", 5]}, r"'choices'\[1\] must be a string"),
    (MULTIPLE_CHOICE, {**MC_ROW, "gold": 2}, "'gold' is 2, out of range for the 2 item"),
    (MULTIPLE_CHOICE, {**MC_ROW, "gold": -1}, "'gold' is -1, out of range"),
    (MULTIPLE_CHOICE, {**MC_ROW, "gold": 0.5}, "'gold' must be an integer index"),
    (MULTIPLE_CHOICE, {**MC_ROW, "gold": True}, "'gold' must be an integer index"),
    (MULTIPLE_CHOICE, {**MC_ROW, "query": ["q"]}, "'query' must be a string, got a list"),
    (MULTIPLE_CHOICE, {**HELLASWAG_ROW, "label": "2"}, "'label' is 2, out of range"),
    (MULTIPLE_CHOICE, {**HELLASWAG_ROW, "endings": []}, "'endings' is an empty list"),
    (MULTIPLE_CHOICE, ["q", "a"], "expected a JSON object, got a list"),
    (SCHEMA, {**SCHEMA_ROW, "context_options": []}, "'context_options' is an empty list"),
    (SCHEMA, {**SCHEMA_ROW, "context_options": "A"}, "'context_options' must be a list of strings"),
    (SCHEMA, {**SCHEMA_ROW, "gold": 5}, "'gold' is 5, out of range for the 2 item"),
    (SCHEMA, {**SCHEMA_ROW, "continuation": None}, "'continuation' must be a string, got null"),
    (LANGUAGE_MODELING, {**LM_ROW, "context": 3}, "'context' must be a string, got a number"),
    (LANGUAGE_MODELING, {**LM_ROW, "context": ["c"]}, "'context' must be a string, got a list"),
    (LANGUAGE_MODELING, {**LM_ROW, "continuation": ""}, "'continuation' is empty"),
])
def test_malformed_rows_are_one_line_data_errors_naming_file_and_line(tmp_path, kind, row, message):
    path = tmp_path / "task.jsonl"
    good = {MULTIPLE_CHOICE: MC_ROW, SCHEMA: SCHEMA_ROW, LANGUAGE_MODELING: LM_ROW}[kind]
    write_jsonl(path, [good, row])
    with pytest.raises(DataError) as caught:
        core.load_examples(path, kind)
    text = str(caught.value)
    assert text.startswith(f"{path}:2: malformed {kind} row: ") and "\n" not in text
    assert re.search(message, text), text
    write_jsonl(path, [good, HELLASWAG_ROW if kind == MULTIPLE_CHOICE else good])
    assert len(core.load_examples(path, kind)) == 2  # the good rows read


def test_cli_eval_reports_a_malformed_row_in_one_line(tiny_run, small_eval_dir, capsys):
    trained_run = tiny_run("gpt")
    capsys.readouterr()
    rows = [json.loads(line) for line in (small_eval_dir / "copa.jsonl").read_text().splitlines()]
    bad = [({**rows[0], "choices": []}, "'choices' is an empty list"),
           ({**rows[0], "gold": 7}, "'gold' is 7, out of range"),
           ({**rows[0], "query": 12}, "'query' must be a string")]
    for row, message in bad:
        write_jsonl(small_eval_dir / "copa.jsonl", [*rows[:2], row])
        assert main(["eval", str(trained_run), "--tasks", "copa", "--eval-dir", str(small_eval_dir)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        errors = [line for line in err.splitlines() if line.startswith("latentloop: error:")]
        assert len(errors) == 1 and err.endswith(errors[0] + "\n")  # the last line, and the only one
        where = small_eval_dir / "copa.jsonl"
        assert errors[0].startswith(f"latentloop: error: {where}:3: malformed multiple_choice row")
        assert message in errors[0]


# -- scoring arithmetic on a stub with known logits -------------------------------------------


def test_continuation_logprob_and_greedy_are_exact():
    table = prefer({"a": "b", "b": "c"})
    model = BigramStub(table)
    ctx = [BOS] + list(b"a")
    good, bad = score_continuations(model, [(ctx, list(b"bc")), (ctx, list(b"bd"))])
    assert good.logprob == pytest.approx(logprob(table, "a", "b") + logprob(table, "b", "c"), abs=1e-5)
    assert bad.logprob == pytest.approx(logprob(table, "a", "b") + logprob(table, "b", "d"), abs=1e-5)
    assert good.greedy and not bad.greedy and good.tokens == 2
    assert good.mean_loss == pytest.approx(-good.logprob / 2)


def test_a_shorter_rows_padding_is_not_part_of_its_greedy_check():
    """Rows of different lengths in one batch: a short row's padding positions are neither scored nor
    compared with the model's argmax (the short row is greedy, as alone)."""
    model = BigramStub(prefer({"a": "b", "b": "c", "c": "d"}))
    short, long = score_continuations(model, [([BOS, 97], [98]), ([BOS, 97], [98, 99, 100])], batch_size=8)
    assert short.greedy and long.greedy and (short.tokens, long.tokens) == (1, 3)
    alone, = score_continuations(model, [([BOS, 97], [98])])
    assert short.logprob == pytest.approx(alone.logprob, abs=1e-6)


def test_a_merge_across_the_boundary_scores_from_where_the_two_encodings_differ():
    """Language modelling: where the tokenizer merged the context's last token with the continuation's
    first, the continuation starts at the first token the two encodings differ in."""
    without, with_continuation = [BOS, 1, 2], [BOS, 1, 9, 4]  # 2 and the continuation's first merged into 9
    assert core.split_requests(LANGUAGE_MODELING, [without, with_continuation]) == [([BOS, 1], [9, 4])]
    assert core.split_requests(LANGUAGE_MODELING, [[BOS, 1], [BOS, 1, 5, 6]]) == [([BOS, 1], [5, 6])]


def test_schema_options_that_share_everything_keep_a_context():
    """Schema rows (a context per option, one continuation): options as long as the shared suffix keep
    their first token as the context, never an empty one."""
    rows = core.split_requests(core.SCHEMA, [[BOS, 5, 6], [BOS, 5, 6]])
    assert rows == [([BOS], [5, 6]), ([BOS], [5, 6])]
    assert core.split_requests(core.SCHEMA, [[BOS, 1, 7, 8], [BOS, 2, 7, 8]]) == [([BOS, 1], [7, 8]),
                                                                                 ([BOS, 2], [7, 8])]


def test_an_example_whose_continuation_outruns_the_context_is_counted_wrong(tmp_path):
    """A continuation longer than the model's context is scored in part (its score is not `whole`): the
    task counts that example wrong, though its first tokens are greedy, and says how many it counted so."""
    table = prefer({"=": " ", " ": "y", "y": "y"}, strength=8.0)
    model = BigramStub(table, sequence_len=32)
    task = core.Task("lm", ("lm.jsonl",), LANGUAGE_MODELING, 0, 0.0)
    examples = [{"context": "k=", "continuation": "y"}, {"context": "k=", "continuation": "n"},
                {"context": "k=", "continuation": "y" * 40}]  # greedy throughout, but only 32 tokens scored
    scores = score_continuations(model, [([BOS, 1], [2] * 40), ([BOS, 1], [2] * 5)])
    assert [s.whole for s in scores] == [False, True] and scores[0].tokens == 32
    result = core.evaluate_task(model, ByteTokenizer(), task, examples, progress=False)
    assert result["n"] == 3 and result["n_too_long"] == 1 and result["accuracy"] == pytest.approx(1 / 3)
    assert "1 of 3 examples counted wrong" in result["note"]
    table_text = core.format_results({"tasks": {"lm": result}, "missing": [], "core": 0.0, "seconds": 1.0,
                                      "evaluated": 1})
    assert "note: 1 of 3 examples counted wrong" in table_text
    whole = core.evaluate_task(model, ByteTokenizer(), task, examples[:2], progress=False)
    assert whole["n_too_long"] == 0 and "note" not in whole and whole["accuracy"] == 0.5


def test_multiple_choice_uses_the_mean_loss():
    long_cheap = [ContinuationScore(-2.0, 2, False)]  # mean loss 1.0, total 2.0
    short_costly = [ContinuationScore(-1.5, 1, False)]  # mean loss 1.5, total 1.5
    assert core.judge(MULTIPLE_CHOICE, long_cheap + short_costly, 0)
    assert not core.judge(MULTIPLE_CHOICE, long_cheap + short_costly, 1)
    assert core.judge(LANGUAGE_MODELING, [ContinuationScore(-9.0, 3, True)], None)
    assert not core.judge(LANGUAGE_MODELING, [ContinuationScore(-0.1, 3, False)], None)


def test_an_example_scored_nan_or_inf_is_wrong_and_counted_not_the_first_choice(monkeypatch):
    """A model whose logits overflow scores every choice NaN: `min` over them picked choice 0, so such a
    model scored the share of items whose answer is 0 (here 2 of 3, above copa's chance). Now such an
    example is wrong, however its gold, and the task says how many there were."""
    model = BigramStub(prefer({}, strength=1.0), sequence_len=64)
    task = core.Task("copa", ("copa.jsonl",), MULTIPLE_CHOICE, 0, 0.5)
    examples = [{"query": "q?", "choices": ["a", "b"], "gold": gold} for gold in (0, 0, 1)]
    overflowed = [float("nan"), float("inf"), float("-inf")]
    monkeypatch.setattr(core, "score_continuations", lambda model, rows, options, batch_size, on_batch: [
        ContinuationScore(overflowed[i % 3], 1, False) for i in range(len(rows))])
    result = core.evaluate_task(model, ByteTokenizer(), task, examples, progress=False)
    assert result["accuracy"] == 0.0 and result["n_not_finite"] == 3
    assert "3 of 3 examples counted wrong: the model's loss on them is not finite" in result["note"]
    assert not core.judge(LANGUAGE_MODELING, [ContinuationScore(float("nan"), 2, True)], None)


def test_tasks_scored_end_to_end_on_hand_made_examples(tmp_path):
    # the stub prefers "y" after a space, a space after "=" and after "Z": the right answers are known
    table = prefer({" ": "y", "=": " ", "Z": " "}, strength=8.0)
    model = BigramStub(table, sequence_len=256)
    data = tmp_path / "eval"
    data.mkdir()
    write_jsonl(data / "copa.jsonl", [{"query": "q?", "choices": ["n", "y"], "gold": 1},
                                      {"query": "q?", "choices": ["y", "n"], "gold": 0},
                                      {"query": "q?", "choices": ["y", "n"], "gold": 1}])  # 2 of 3 right
    write_jsonl(data / "winograd_wsc.jsonl", [{"context_options": ["aA", "aZ"], "continuation": "!", "gold": 1},
                                              {"context_options": ["aZ", "aA"], "continuation": "!", "gold": 0}])
    write_jsonl(data / "lambada_openai.jsonl", [{"context": "k=", "continuation": "y"},
                                                {"context": "k=", "continuation": "n"}])
    result = core.run_core(model, ByteTokenizer(), ["copa", "winograd", "lambada_openai", "squad"], data,
                           progress=False)
    tasks = result["tasks"]
    assert tasks["copa"]["accuracy"] == pytest.approx(2 / 3) and tasks["copa"]["n"] == 3
    assert tasks["copa"]["centered"] == pytest.approx((2 / 3 - 0.5) / 0.5)
    assert tasks["winograd"]["accuracy"] == 1.0
    assert tasks["lambada_openai"]["accuracy"] == 0.5  # " y" is the greedy continuation of "k=", " n" is not
    assert result["missing"] == ["squad"] and result["evaluated"] == 3
    assert result["core"] == pytest.approx(sum(t["centered"] for t in tasks.values()) / 3)
    # each accuracy carries its binomial interval: Wilson's for 2 of 3 (the published 0.2077-0.9385)
    assert tasks["copa"]["accuracy_ci"] == pytest.approx([0.2077, 0.9385], abs=1e-4)
    assert "[0.208, 0.939]" in core.format_results(result).splitlines()[1]


def test_limit_and_fewshot_from_the_whole_file(tmp_path):
    rows = [{"context": f"c{i}", "continuation": f"x{i}"} for i in range(30)]
    task = core.Task("t", ("t.jsonl",), LANGUAGE_MODELING, 3, 0.0)
    data = core.shuffled(rows)
    requests, groups = core.build_task_requests(task, data, ByteTokenizer(), limit=5)
    assert len(groups) == 5 and len(requests) == 5
    text = bytes(requests[4][0][1:]).decode()
    shots = [data[j] for j in fewshot_indices(30, 4, 3)]
    assert text == "\n\n".join(f"{s['context']} {s['continuation']}" for s in shots) + f"\n\n{data[4]['context']}"


# -- truncation and batching ------------------------------------------------------------------


def test_fit_row_keeps_the_last_max_len_inputs():
    ctx = [BOS] + list(range(100))
    c1, k1 = core.fit_row(ctx, [1] * 5, 64)
    assert c1 == list(range(40, 100)) and k1 == [1] * 5  # 60 + 5 - 1 = 64 inputs, no further bucket cut
    c2, _ = core.fit_row(ctx, [1] * 9, 64)
    assert len(c2) + 9 - 1 == 64 and c2[-1] == 99
    short, cont = core.fit_row([BOS, 5, 6], list(range(80)), 64)
    assert cont == list(range(64)) and short == [6]
    # a row needs len(context) + len(continuation) - 1 inputs: one that needs exactly 64 is not cut
    exact = ([BOS] + list(range(60)), [1, 2, 3, 4])
    assert core.fit_row(*exact, 64) == exact
    assert core.fit_row([BOS, 1], [2], 64) == ([BOS, 1], [2])


@pytest.mark.parametrize("mode", ["auto", "full"])
def test_rows_near_the_context_limit_score_as_one_forward_over_their_last_inputs(mode):
    """A row that needs more than T = 64 inputs scores exactly as one plain forward over its last T
    inputs (as lm-eval's Hugging Face model and nanochat cut), batched or alone."""
    torch.manual_seed(0)
    model = latentloop.build("gpt", preset="test", n_layer=1)
    T = model.config.sequence_len
    rng = random.Random(0)
    shapes = [(16, 3), (62, 3), (63, 2), (64, 1), (64, 3), (65, 1), (80, 5), (100, 17), (40, 25), (3, 64)]
    rows = [([BOS] + [rng.randrange(256) for _ in range(c - 1)], [rng.randrange(256) for _ in range(k)])
            for c, k in shapes]

    def direct(context, continuation):
        ids = (context + continuation)[-(T + 1):]
        with torch.no_grad():
            logprobs = model(torch.tensor([ids[:-1]])).logits[0].float().log_softmax(-1)
        return float(logprobs[-len(continuation):].gather(-1, torch.tensor(continuation)[:, None]).sum())

    expected = torch.tensor([direct(c, k) for c, k in rows])
    for batch_size in (1, 4):
        scores = score_continuations(model, rows, batch_size=batch_size, mode=mode)
        got = torch.tensor([s.logprob for s in scores])
        assert [s.tokens for s in scores] == [k for _, k in shapes]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)  # float32 sums of up to 64 log-probs


def test_a_questions_choices_prefill_its_context_once_and_score_as_each_alone(monkeypatch):
    """`score_continuations`: the choices of one question in a batch prefill its context once
    (`share_prompts`, the default), with the scores of every row prefilled (`share_prompts=False`)."""
    torch.manual_seed(0)
    model = latentloop.build("gpt", preset="test", n_layer=1)
    question, other = [BOS, *b"which one?"], [BOS, *b"no"]
    rows = [(question, list(b" yes.")), (question, list(b" no!")), (other, list(b" ok")), (question, list(b" it"))]
    prefilled = count_prefill_rows(monkeypatch, model)
    shared = score_continuations(model, rows, batch_size=8)
    assert prefilled == [2]
    every = score_continuations(model, rows, batch_size=8, share_prompts=False)
    assert prefilled == [2, 4]
    for a, b in zip(shared, every):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and (a.greedy, a.tokens) == (b.greedy, b.tokens)


def test_stub_rows_align_contexts_at_one_column():
    model = BigramStub(prefer({"a": "b"}), sequence_len=32)
    rows = [([BOS] + [97] * n, [98] * m) for n, m in ((1, 3), (7, 1), (4, 2))]
    score_continuations(model, rows, batch_size=8)
    # longest context 8 prefilled, then the longest continuation's first 2 tokens decoded teacher-forced in one
    # call (its last token is a target only, never an input)
    assert model.calls == [("prefill", (3, 8)), ("decode", (3, 2))]


@pytest.mark.parametrize("arch,options,modes", [
    ("gpt", {}, ("full", "stepwise")), ("fbt", {"regime": "soft"}, ("full", "stepwise")),
    ("fbt", {"regime": "fused", "passes": 2}, ("full", "stepwise")), ("fbt", {"regime": "standard"}, ("full",)),
    ("lrt", {}, ("full", "stepwise")), ("rgpt", {"steps": 2}, ("full", "stepwise"))])
def test_batched_scores_equal_one_by_one(arch, options, modes):
    torch.manual_seed(0)
    model = latentloop.build(arch, preset="test", n_layer=1 if arch != "rgpt" else 2, sequence_len=24)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for n, m in ((3, 4), (11, 1), (6, 5), (1, 2), (30, 3)):  # the last one is cut to the context of 24
        rows.append(([BOS] + torch.randint(0, 256, (n,), generator=generator).tolist(),
                     torch.randint(0, 256, (m,), generator=generator).tolist()))
    alone = [score_continuations(model, [row], options, batch_size=1)[0] for row in rows]
    for mode in modes:
        batched = score_continuations(model, rows, options, batch_size=64, mode=mode)
        assert [b.logprob for b in batched] == pytest.approx([a.logprob for a in alone], abs=1e-4)
        assert [b.greedy for b in batched] == [a.greedy for a in alone]
    assert model.training  # restored after scoring


RAGGED_ROWS = ((3, 4), (11, 1), (6, 5), (1, 2), (15, 3))  # (context, continuation) lengths: all fit in 24


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_ragged_batch_scores_as_the_engine_scores_each_row_alone(arch):
    """The contexts are left-padded by the engine's own `left_pad`: each row of one padded batch gets
    the log-probability and greedy match that `teacher_forced_logits` gives the row alone, unpadded."""
    torch.manual_seed(0)
    model = latentloop.build(arch, preset="test", sequence_len=24).eval()
    generator = torch.Generator().manual_seed(1)
    rows = [([BOS] + torch.randint(0, 256, (n,), generator=generator).tolist(),
             torch.randint(0, 256, (m,), generator=generator).tolist()) for n, m in RAGGED_ROWS]
    batched = score_continuations(model, rows, batch_size=len(rows))
    for (context, continuation), score in zip(rows, batched):
        targets = torch.tensor(continuation)
        logits = teacher_forced_logits(model, torch.tensor([context + continuation]), prompt_len=len(context))
        predicting = logits[0, len(context) - 1:-1].float()  # (C, V): the logits of each continuation token
        logprob = predicting.log_softmax(-1).gather(-1, targets[:, None]).sum()
        torch.testing.assert_close(torch.tensor(score.logprob), logprob, rtol=0, atol=1e-4)
        assert score.greedy == bool((predicting.argmax(-1) == targets).all())


def test_options_are_checked():
    model = latentloop.build("gpt", preset="test", n_layer=1)
    with pytest.raises(ConfigError, match="does not support"):
        score_continuations(model, [([BOS], [1])], {"regime": "soft"})
    with pytest.raises(ConfigError, match="scoring mode"):
        score_continuations(model, [([BOS], [1])], mode="fast")


# -- data folders and the official bundle -----------------------------------------------------


def test_eval_dir_from_argument_environment_and_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(core.EVAL_DIR_ENV, raising=False)
    monkeypatch.setenv("LATENTLOOP_CACHE", str(tmp_path / "cache"))
    given = tmp_path / "given"
    given.mkdir()
    assert core.resolve_eval_dir(given) == given
    with pytest.raises(DataError, match="does not exist"):
        core.resolve_eval_dir(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match="is a file, not a folder"):  # it said "does not exist"
        core.resolve_eval_dir(tmp_path / "afile")
    monkeypatch.setenv(core.EVAL_DIR_ENV, str(given))
    assert core.resolve_eval_dir(None) == given
    monkeypatch.delenv(core.EVAL_DIR_ENV)
    with pytest.raises(DataError, match="--eval-dir"):
        core.resolve_eval_dir(None, download=False)
    bundle = tmp_path / "cache" / "eval_bundle" / "eval_data" / "commonsense_reasoning"
    bundle.mkdir(parents=True)
    write_jsonl(bundle / "copa.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 0}])
    assert core.resolve_eval_dir(None) == tmp_path / "cache" / "eval_bundle"
    assert core.find_task_file(core.resolve_eval_dir(None), CORE_TASKS["copa"]) == bundle / "copa.jsonl"
    # where each came from, as `eval --tasks` prints it
    assert core.locate_eval_dir(given)[1] == "from --eval-dir"
    assert core.locate_eval_dir(None)[1].startswith("the bundle fetched earlier into the cache")
    monkeypatch.setenv(core.EVAL_DIR_ENV, str(given))
    assert core.locate_eval_dir(None) == (given, f"from ${core.EVAL_DIR_ENV}")


def test_download_offline_is_a_clear_error(tmp_path, monkeypatch):
    refused = "http://127.0.0.1:9/eval_bundle.zip"  # the discard port: nothing listens, refused at once
    with pytest.raises(DataError, match="cannot download the eval bundle from http://127.0.0.1:9"):
        core.download_eval_bundle(tmp_path / "bundle", url=refused, timeout=5)
    assert not (tmp_path / "bundle").exists() and list(tmp_path.iterdir()) == []
    monkeypatch.delenv(core.EVAL_DIR_ENV, raising=False)
    monkeypatch.setenv("LATENTLOOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(core, "EVAL_BUNDLE_URL", refused)
    with pytest.raises(DataError, match=r"no evaluation data: pass --eval-dir PATH .*cannot download"):
        core.resolve_eval_dir(None)


def test_download_unpacks_a_bundle(tmp_path):
    archive = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("eval_bundle/core.yaml", "icl_tasks: []\n")
        zf.writestr("eval_bundle/eval_data/language_understanding/winograd_wsc.jsonl",
                    json.dumps({"context_options": ["a", "b"], "continuation": "c", "gold": 0}) + "\n")
    dest = core.download_eval_bundle(tmp_path / "cache" / "eval_bundle", url=archive.as_uri())
    assert (dest / "core.yaml").is_file()
    assert core.find_task_file(dest, CORE_TASKS["winograd"]).name == "winograd_wsc.jsonl"
    (tmp_path / "bad.zip").write_text("not a zip")
    with pytest.raises(DataError, match="not a zip"):
        core.download_eval_bundle(tmp_path / "other", url=(tmp_path / "bad.zip").as_uri())


# -- the real files, when present -------------------------------------------------------------


def test_core_on_the_shared_files():
    folder = shared_data("eval")
    torch.manual_seed(0)
    model = latentloop.build("gpt", preset="test", n_layer=1)
    result = core.run_core(model, ByteTokenizer(), "core", folder, limit=2, progress=False)
    assert result["missing"] == ["squad", "coqa"] and result["evaluated"] == 20
    assert all(r["n"] == 2 for r in result["tasks"].values())
    assert result["tasks"]["hellaswag"]["file"].endswith("hellaswag_val1k.jsonl")
    assert -5 < result["core"] < 1


# -- the suite: result files and the CLI ------------------------------------------------------


@pytest.fixture
def small_eval_dir(tmp_path) -> Path:
    folder = tmp_path / "eval"
    folder.mkdir()
    write_jsonl(folder / "copa.jsonl", [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(6)])
    write_jsonl(folder / "lambada_openai.jsonl", [{"context": f"c{i}", "continuation": "d"} for i in range(4)])
    return folder


def test_suite_writes_results_into_the_run_folder(tmp_path, small_eval_dir):
    model = latentloop.build("fbt", preset="test", n_layer=1)
    run = tmp_path / "run"
    result = suite.run_tasks(model, ByteTokenizer(), "copa,lambada_openai", small_eval_dir,
                             {"regime": "fused", "passes": 2}, limit=3, progress=False, run_dir=run)
    assert result["tag"] == "fused-passes2-limit3"  # a limited run's files are its own
    written = sorted(p.name for p in (run / "evals").iterdir())
    assert written == ["copa-fused-passes2-limit3.json", "lambada_openai-fused-passes2-limit3.json"]
    payload = json.loads((run / "evals" / "copa-fused-passes2-limit3.json").read_text())
    assert payload["task"] == "copa" and payload["limit"] == 3 and payload["result"]["n"] == 3
    assert payload["options"] == {"regime": "fused", "passes": 2}
    whole = suite.run_tasks(model, ByteTokenizer(), "core", small_eval_dir, None, limit=2, progress=False,
                            run_dir=run)
    aggregate = json.loads((run / "evals" / "core-default-limit2.json").read_text())
    assert aggregate["kind"] == "core_aggregate" and aggregate["result"]["evaluated"] == 2
    assert aggregate["result"]["core"] == pytest.approx(whole["core"]["core"])
    assert len(aggregate["result"]["missing"]) == 20
    assert suite.options_tag({"steps": 8}) == "default-steps8" and suite.options_tag(None) == "default"
    with pytest.raises(ConfigError, match="unknown task 'nonsense'"):
        suite.run_tasks(model, ByteTokenizer(), "copa,nonsense", small_eval_dir, progress=False)


def test_cli_eval_tasks(tiny_run_copy, small_eval_dir, capsys):
    trained_run = tiny_run_copy("gpt")  # eval --tasks writes RUN/evals/
    capsys.readouterr()
    assert main(["eval", str(trained_run), "--tasks", "copa,lambada_openai", "--eval-dir", str(small_eval_dir),
                 "--limit", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tasks"]["copa"]["n"] == 4 and out["tag"] == "default-limit4"
    assert (trained_run / "evals" / "copa-default-limit4.json").is_file()
    assert main(["eval", str(trained_run), "--tasks", "copa", "--eval-dir", str(small_eval_dir), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "copa" in text and "mean centred" in text and "results:" in text
    assert f"CORE data: {small_eval_dir} (from --eval-dir)" in text.splitlines()
    assert main(["eval", str(trained_run), "--tasks", "copa", "--eval-dir", str(small_eval_dir), "--limit", "2"]) == 0
    assert f"CORE data: {small_eval_dir} (from --eval-dir)" in capsys.readouterr().err.splitlines()  # before it runs


def test_cli_eval_task_errors_are_one_line(tiny_run, small_eval_dir, capsys):
    trained_run = tiny_run("gpt")
    capsys.readouterr()
    assert main(["eval", str(trained_run), "--limit", "3"]) == 2
    assert capsys.readouterr().err.strip() == "latentloop: error: --limit and --eval-dir apply to --tasks only"
    assert main(["eval", str(trained_run), "--tasks", "nope", "--eval-dir", str(small_eval_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("latentloop: error: unknown task 'nope'") and err.count("\n") == 1
    assert main(["eval", str(trained_run), "--tasks", "copa", "--eval-dir", str(small_eval_dir / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", str(trained_run), "--tasks", "copa", "--regime", "soft",
                 "--eval-dir", str(small_eval_dir)]) == 2
    assert "does not support" in capsys.readouterr().err


def test_math_helpers():
    assert core.common_prefix_length([[1, 2, 3], [1, 2, 4]]) == 2
    assert core.common_suffix_length([[9, 2, 3], [1, 2, 3]]) == 2
    assert core.common_prefix_length([[1, 2], [1, 2, 3]]) == 2
    assert math.isclose(core._bucket(1), core.TRUNCATION_STEP) and core._bucket(core.TRUNCATION_STEP) == 16
