"""Built-in reasoning tasks: answers checked by independent computations, splits (held out by
construction, for every registered task), baselines checked by hand, specs, the Source."""

import hashlib
import itertools
import re

import numpy as np
import pytest

from latentloop.data import ByteTokenizer, parse_source, prepare_tokens
from latentloop.data.chat import iter_conversations
from latentloop.data.tasks import (
    HELD_OUT_FRACTION,
    SPLIT_SALT,
    TASKS,
    Example,
    final_answer,
    get_task,
    get_task_source,
    majority_answer,
    parse_task_spec,
    task_baselines,
)
from latentloop.errors import DataError

N = 300


def examples(name, split="train", n=N, seed=0, spec=None):
    return get_task(spec or name).examples(split, n, seed)


# -- independent checks, one per task ------------------------------------------------------------
def test_addition_answers_are_python_sums():
    for split in ("train", "test"):
        for ex in examples("addition", split):
            a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", ex.prompt).groups())
            assert ex.answer == str(a + b) and ex.work == "" and ex.completion == ex.answer
            assert ex.steps == max(len(str(a)), len(str(b)))


def test_addition_steps_columns_rebuild_the_sum():
    for ex in examples("addition_steps", "test") + examples("addition_steps"):
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", ex.prompt).groups())
        assert ex.answer == str(a + b)
        columns = ex.work.split(",")
        assert len(columns) == ex.steps == max(len(str(a)), len(str(b)))
        digits, carry = [], 0
        for i, column in enumerate(columns):
            da, db, c, s = map(int, re.fullmatch(r"(\d)\+(\d)\+(\d)=(\d+)", column).groups())
            # the i-th digits from the right, read off the strings (not by arithmetic)
            assert da == int((str(a)[::-1] + "0" * 80)[i]) and db == int((str(b)[::-1] + "0" * 80)[i])
            assert c == carry and s == da + db + c
            digits.append(str(s)[-1])
            carry = int(len(str(s)) == 2)
        rebuilt = ("1" if carry else "") + "".join(reversed(digits))
        assert (rebuilt.lstrip("0") or "0") == ex.answer
        assert ex.completion == f"{ex.work};{ex.answer}"


def test_multiplication_answers_and_written_partial_products():
    for ex in examples("multiplication", "test"):
        a, b = map(int, re.fullmatch(r"(\d+)\*(\d+)=", ex.prompt).groups())
        assert int(ex.answer) == a * b
    for ex in examples("multiplication_steps") + examples("multiplication_steps", "test"):
        a, b = map(int, re.fullmatch(r"(\d+)\*(\d+)=", ex.prompt).groups())
        assert int(ex.answer) == a * b
        parts = ex.work.split(",")
        for part in parts:  # every written step is true arithmetic
            left, right = part.split("=")
            x, op, y = re.fullmatch(r"(\d+)([*+])(\d+)", left).groups()
            assert (int(x) * int(y) if op == "*" else int(x) + int(y)) == int(right)
        products = [p for p in parts if "*" in p]
        assert len(products) == ex.steps == len(str(b))
        assert int(parts[-1].split("=")[1]) == a * b


def test_modarith_matches_python_eval():
    for ex in examples("modarith") + examples("modarith", "test") + examples("modarith", spec="modarith:mod=97"):
        expression, mod = re.fullmatch(r"(.+) mod (\d+)=", ex.prompt).groups()
        assert re.fullmatch(r"[\d+\-*()]+", expression)
        assert int(ex.answer) == eval(expression) % int(mod)  # Python's own precedence and arithmetic
        assert ex.steps == len(re.findall(r"[+\-*]", expression))


def test_s5_matches_permutation_matrix_products():
    for ex in examples("s5") + examples("s5", "test"):
        body = re.fullmatch(r"s5:([0-4,]+)=", ex.prompt).group(1)
        perms = [[int(c) for c in p] for p in body.split(",")]
        assert len(perms) == ex.steps and all(sorted(p) == list(range(5)) for p in perms)
        product = np.eye(5, dtype=int)
        for p in perms:
            matrix = np.zeros((5, 5), dtype=int)
            matrix[np.arange(5), p] = 1  # (matrix @ state)[i] = state[p[i]]
            product = matrix @ product
        assert ex.answer == "".join(map(str, product @ np.arange(5)))


def test_binding_resolves_by_substitution():
    for ex in examples("binding") + examples("binding", "test"):
        statements, query = re.fullmatch(r"(.+);([a-z])=", ex.prompt).groups()
        pairs = [s.split("=") for s in statements.split(",")]
        table = dict(pairs)
        assert len(table) == len(pairs)  # each variable assigned once
        value, hops = query, 0
        while not value.isdigit():
            value, hops = table[value], hops + 1
        assert value == ex.answer and hops - 1 == ex.steps


def test_iteration_matches_permutation_powers_by_squaring():
    def power(table, k):
        result, base = list(range(len(table))), table
        while k:
            if k & 1:
                result = [base[i] for i in result]
            base = [base[i] for i in base]
            k >>= 1
        return result

    for ex in examples("iteration") + examples("iteration", "test"):
        table, x, k = re.fullmatch(r"f=(\d+),x=(\d),k=(\d+):", ex.prompt).groups()
        table = [int(c) for c in table]
        assert int(ex.answer) == power(table, int(k))[int(x)] and ex.steps == int(k)
        assert ex.completion == "." * int(k) + ";" + ex.answer  # only filler before the answer
    no_filler = examples("iteration", spec="iteration:fill=0")[0]
    assert no_filler.completion == no_filler.answer
    assert all(ex.work == "." * 3 * ex.steps for ex in examples("iteration", spec="iteration:fill=3"))


# -- held out by construction ----------------------------------------------------------------------
def _held_out_by_sha256(key):
    """The split rule, computed here on its own: SHA-256 of salt, NUL, key; the first 8 bytes as a fraction."""
    digest = hashlib.sha256(SPLIT_SALT.encode() + b"\0" + key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < HELD_OUT_FRACTION


def _configurations(name):
    """Specs of one task at several lengths and knobs, named only through what the task declares:
    its difficulty knob (small ranges, test ranges overlapping training, beyond it) and every
    task-specific knob at its smallest and a middle value."""
    task = TASKS[name]
    knob, (_, high) = task.knob, task.train_range
    specs = [name, f"{name}:{knob}=2,test=1-3", f"{name}:{knob}=1-3,test=2-{high + 1}",
             f"{name}:{knob}={high},test=1-{high}"]
    for param, (low, top) in task.param_limits.items():
        specs += [f"{name}:{param}={low},{knob}=3,test=1-4", f"{name}:{param}={(low + top) // 2},test=1-{high}"]
    return specs


@pytest.mark.parametrize("name", list(TASKS))
def test_no_val_or_test_problem_is_ever_trained_on(name):
    """For every registered task: train and val/test share no problem (canonical keys), within each
    configuration and across all of them (a model trained with one knob setting and evaluated with
    another), and the split is the sha256 rule, recomputed here."""
    trained, held = set(), set()
    for spec in _configurations(name):
        parsed = parse_task_spec(spec)
        task = parsed.task
        for n, seed in ((300, 0), (2000, 1)):
            train = {task.problem_key(e.prompt) for e in task.iter_examples("train", n, seed)}
            val = {task.problem_key(e.prompt) for e in task.iter_examples("val", n // 4, seed)}
            test = {task.problem_key(e.prompt) for e in task.iter_examples("test", n // 4, seed)}
            assert not train & (val | test), spec
            assert not any(_held_out_by_sha256(key) for key in train), spec
            assert all(_held_out_by_sha256(key) for key in val | test), spec
            trained |= train
            held |= val | test
        source = get_task_source(spec + (",n=400" if ":" in spec else ":n=400"), 0.25)
        source_train = {task.problem_key(e.prompt) for e in source.iter_examples("train")}
        source_rest = {task.problem_key(e.prompt) for split in ("val", "test") for e in source.iter_examples(split)}
        assert not source_train & source_rest, spec
    assert not trained & held


@pytest.mark.parametrize("name", list(TASKS))
def test_chat_sft_data_never_holds_an_evaluated_problem(name):
    """`chat:task:` SFT conversations against the items `chat:TASK` evaluates (the test split), with
    the test range inside the training range too (as experiments/post_training.py evaluates)."""
    task = TASKS[name]
    for knobs in ("n=400", f"n=400,{task.knob}=2,test=1-2"):
        parsed = parse_task_spec(f"{name}:{knobs}")
        sft = {parsed.task.problem_key(messages[0]["content"])
               for _, messages in iter_conversations(f"chat:task:{name}:{knobs}")}
        evaluated = {parsed.task.problem_key(e.prompt) for e in parsed.task.examples("test", 200, parsed.seed)}
        assert len(sft) > 1 and evaluated and not sft & evaluated
        # by the rule itself, not only by luck where the problems are too many to collide
        assert not any(map(_held_out_by_sha256, sft)) and all(map(_held_out_by_sha256, evaluated))


def test_binding_key_ignores_statement_order():
    task = TASKS["binding"]
    assert task.problem_key("a=7,b=a,c=2;b=") == task.problem_key("c=2,b=a,a=7;b=")
    assert task.problem_key("a=7,b=a,c=2;b=") != task.problem_key("a=7,b=a,c=2;a=")
    assert task.is_held_out("a=7,b=a,c=2;b=") == task.is_held_out("b=a,c=2,a=7;b=")


# -- baselines, each kind on a case checked by hand -------------------------------------------------
def test_chance_is_one_over_the_answers_a_length_can_have():
    addition = TASKS["addition"]
    for level in (1, 2):  # every sum of two numbers whose longer one has `level` digits
        numbers = range(10 ** level)
        sums = {a + b for a in numbers for b in numbers if max(len(str(a)), len(str(b))) == level}
        assert addition.answer_space(level) == len(sums)
    s3 = get_task("s5:size=3")
    assert s3.answer_space(4) == len(list(itertools.permutations("012"))) == 6
    assert get_task("modarith:mod=7").answer_space(5) == 7
    assert TASKS["iteration"].answer_space(9) == 10 and TASKS["binding"].answer_space(2) == 10
    test = [Example("1+2=", "3", 1), Example("12+3=", "15", 2), Example("4+5=", "9", 1)]
    report = task_baselines(addition, test, ["3"])
    assert report["by_length"]["1"]["chance"] == pytest.approx(1 / 19)
    assert report["by_length"]["2"]["chance"] == pytest.approx(1 / 189)  # sums 10..198
    assert report["overall"]["chance"] == pytest.approx((2 / 19 + 1 / 189) / 3)
    multiplication = task_baselines(TASKS["multiplication"], [Example("2*3=", "6", 1)], ["6"])
    # the majority answer is the test item's own length's, the overall one where training has none
    train = [Example("1+1=", "2", 1)] * 2 + [Example("10+5=", "15", 2)] * 3
    by_length = task_baselines(addition, [Example("1+1=", "2", 1), Example("11+4=", "15", 2),
                                          Example("100+1=", "101", 3)], train)
    assert by_length["majority_by_length"] == {"1": "2", "2": "15"} and by_length["majority_answer"] == "15"
    assert [by_length["by_length"][k]["majority"] for k in ("1", "2", "3")] == [1.0, 1.0, 0.0]
    assert multiplication["by_length"]["1"]["chance"] is None and "closed form" in multiplication["undefined"]["chance"]


def test_copy_baseline_answers_with_the_input_value():
    iteration = TASKS["iteration"]
    swap = "1023456789"  # f swaps 0 and 1 (a 2-cycle) and fixes the rest
    test = [Example(f"f={swap},x=0,k=1:", "1", 1), Example(f"f={swap},x=5,k=1:", "5", 1),
            Example(f"f={swap},x=0,k=2:", "0", 2), Example(f"f={swap},x=1,k=3:", "0", 3)]
    report = task_baselines(iteration, test, ["0"])
    assert report["by_length"]["1"]["copy"] == 0.5  # x=5 is fixed, x=0 is not
    assert report["by_length"]["2"]["copy"] == 1.0  # the 2-cycle returns after 2
    assert report["by_length"]["3"]["copy"] == 0.0
    # on generated items: copying x is right exactly when x's cycle length divides k
    for example in iteration.examples("test", 200):
        table, x, k = re.fullmatch(r"f=(\d+),x=(\d),k=(\d+):", example.prompt).groups()
        cycle, y = 1, int(table[int(x)])
        while y != int(x):
            cycle, y = cycle + 1, int(table[y])
        assert (iteration.copy_answer(example) == example.answer) == (int(k) % cycle == 0)
    s3 = get_task("s5:size=3")
    copied = task_baselines(s3, [Example("s3:102=", "102", 1), Example("s3:102,102=", "012", 2),
                                 Example("s3:102,021=", "120", 2)], ["012"])
    assert copied["by_length"]["1"]["copy"] == 1.0 and copied["by_length"]["2"]["copy"] == 0.0
    binding = task_baselines(TASKS["binding"], [Example("b=a,a=7,c=2;b=", "7", 1), Example("c=2,b=a,a=7;b=", "7", 1)],
                             ["7"])
    assert binding["by_length"]["1"]["copy"] == 0.5


def test_majority_is_the_most_frequent_training_answer_scored_on_test():
    assert majority_answer(["3", "5", "3", "7"]) == ("3", 4)
    assert majority_answer(["5", "3"]) == ("3", 2)  # a tie goes to the answer that sorts first
    test = [Example("1+2=", "3", 1), Example("2+2=", "4", 1), Example("3+0=", "3", 1), Example("10+3=", "13", 2)]
    report = task_baselines(TASKS["addition"], test, ["3", "3", "4", "9"])
    assert report["majority_answer"] == "3" and report["majority_train_examples"] == 4
    assert report["by_length"]["1"]["majority"] == pytest.approx(2 / 3)
    assert report["by_length"]["2"]["majority"] == 0.0
    assert report["overall"]["majority"] == 0.5
    assert report["by_length"]["1"]["copy"] == pytest.approx(1 / 3)  # only 3+0 is answered by its first operand
    assert report["by_length"]["1"]["n"] == 3 and report["by_length"]["1"]["distinct"] == 3


# -- splits ----------------------------------------------------------------------------------------
def _size(name, ex):
    """The difficulty an example was drawn at, read off the prompt."""
    if name.startswith(("addition", "multiplication")):
        return max(len(n) for n in re.findall(r"\d+", ex.prompt))
    return ex.steps


@pytest.mark.parametrize("name", list(TASKS))
def test_test_split_is_harder_and_longer_than_training(name):
    train, test = examples(name, n=200), examples(name, "test", n=200)
    assert max(_size(name, e) for e in train) < min(_size(name, e) for e in test)
    mean = lambda xs: sum(len(x.prompt) + len(x.completion) for x in xs) / len(xs)  # noqa: E731
    assert mean(test) > mean(train)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    task = TASKS[name]
    assert task.format(train[0]) == train[0].prompt + train[0].completion + "\n"
    assert "\n" not in train[0].prompt + train[0].completion


@pytest.mark.parametrize("name", list(TASKS))
def test_generation_is_seeded_and_splits_differ(name):
    task = TASKS[name]
    assert task.examples("train", 50, 3) == task.examples("train", 50, 3)
    assert task.examples("train", 50, 3) != task.examples("train", 50, 4)
    assert task.examples("train", 50, 3) != task.examples("val", 50, 3)


def test_knobs_move_the_ranges():
    task = get_task("addition:digits=2")
    assert task.split_range("train") == (1, 2) and task.split_range("test") == (3, 4)
    task = get_task("task:addition?digits=3-5&test=8")
    assert task.split_range("train") == (3, 5) and task.split_range("test") == (8, 8)
    assert {len(max(re.findall(r"\d+", e.prompt), key=len)) for e in task.examples("test", 20)} == {8}


def test_final_answer():
    assert final_answer("8+6+0=14,7+5+1=13;1134\nmore") == "1134"
    assert final_answer(" 42 ") == "42"
    assert final_answer("....;7") == "7"
    assert Example("p", "9", 1, "..").completion == "..;9"


# -- specs and the data source ---------------------------------------------------------------------
def test_task_source_splits_and_documents():
    source = parse_source("task:addition:digits=3,n=200", val_fraction=0.1)
    assert source.spec == "task:addition:digits=3,n=200" and source.val_fraction == 0.1
    train = list(source.iter_documents("train"))
    val = list(source.iter_documents("val"))
    assert len(train) == 200 and len(val) == 20
    assert all(re.fullmatch(r"\d+\+\d+=\d+\n", doc) for doc in train + val)
    assert not {d.split("=")[0] for d in train} & {d.split("=")[0] for d in val}  # held out
    assert train == list(source.iter_documents("train"))
    same = parse_source("task:addition?n=200&digits=3", val_fraction=0.1)
    assert same.fingerprint() == source.fingerprint()
    assert parse_source("task:addition:digits=3,n=201", 0.1).fingerprint() != source.fingerprint()
    assert parse_source("task:addition:digits=3,n=200", 0.2).fingerprint() != source.fingerprint()
    assert parse_source("task:addition:digits=3,n=200,seed=1", 0.1).fingerprint() != source.fingerprint()


def test_task_source_tokenizes(tmp_path):
    data = prepare_tokens(get_task_source("s5:length=2,n=64", 0.25), ByteTokenizer(), tmp_path, progress=False)
    assert data.meta["documents"] == {"train": 64, "val": 16}
    assert len(data.train) > 0 and len(data.val) > 0


def test_bad_specs_raise_data_errors_naming_the_choices():
    with pytest.raises(DataError, match="unknown task 'nope'") as info:
        parse_source("task:nope")
    message = str(info.value)
    assert "\n" not in message and all(name in message for name in TASKS)
    with pytest.raises(DataError, match="unknown knob 'colour'.*digits"):
        get_task_source("addition:colour=red")
    with pytest.raises(DataError, match="digits"):
        get_task_source("addition:digits=x")
    with pytest.raises(DataError, match="KEY=VALUE"):
        get_task_source("addition:digits")
    with pytest.raises(DataError, match="exceeds"):
        get_task_source("binding:hops=40")
    with pytest.raises(DataError, match="n must be"):
        get_task_source("addition:n=0")


def test_a_small_range_validates_on_exactly_its_held_out_problems():
    # Training 5000 examples on 1-digit sums used to cover all 100 of them, leaving no val split.
    # Now a hash-chosen share is never trained on: val is exactly those problems, each once.
    source = get_task_source("addition:digits=1,n=5000", 0.1)
    every = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    held_out = {prompt for prompt in every if _held_out_by_sha256(prompt)}
    assert 0 < len(held_out) < len(every)
    val = [example.prompt for example in source.iter_examples("val")]
    assert sorted(val) == sorted(held_out)
    assert {example.prompt for example in source.iter_examples("train")} == every - held_out


def test_a_range_without_held_out_problems_says_so():
    # S2 has 2 problems of length 1 and 4 of length 2; the hash holds none of these 6 out
    prompts = [f"s2:{','.join(seq)}=" for length in (1, 2) for seq in itertools.product(("01", "10"), repeat=length)]
    assert not any(_held_out_by_sha256(prompt) for prompt in prompts)
    with pytest.raises(DataError, match="no held-out problem at length 1-2"):
        get_task("s5:size=2,length=2").examples("val", 1)
    assert {e.steps for e in get_task("s5:size=2,length=2,test=1-3").examples("test", 50)} == {3}
    assert {e.steps for e in get_task("s5:size=2,length=2").examples("train", 50)} == {1, 2}


def test_parse_task_spec_defaults():
    parsed = parse_task_spec("binding")
    assert parsed.name == "binding" and parsed.n == 20_000 and parsed.seed == 0 and parsed.spec == "task:binding"
