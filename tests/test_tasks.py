"""Built-in reasoning tasks: answers checked by independent computations, splits, specs, the Source."""

import re

import numpy as np
import pytest

from latentloop.data import ByteTokenizer, parse_source, prepare_tokens
from latentloop.data.tasks import TASKS, Example, final_answer, get_task, get_task_source, parse_task_spec
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


def test_exhausted_difficulty_has_no_val_split():
    source = get_task_source("addition:digits=1,n=5000", 0.1)  # only 100 distinct 1-digit sums
    with pytest.raises(DataError, match="nothing to validate"):
        list(source.iter_documents("val"))


def test_parse_task_spec_defaults():
    parsed = parse_task_spec("binding")
    assert parsed.name == "binding" and parsed.n == 20_000 and parsed.seed == 0 and parsed.spec == "task:binding"
