"""Built-in reasoning tasks: generated from a seed, no files, usable for training and evaluation.

Every task writes one example per line: a prompt, then what the model should write after it (the
*completion*), then a newline. The completion is the bare answer, or, for tasks with written
work, the work followed by `;` and the answer (`final_answer` takes the part after the last `;`).

| name                  | prompt → completion                                   | difficulty knob (train / test) |
|-----------------------|-------------------------------------------------------|--------------------------------|
| addition              | `123+4567=` → `4690`                                  | digits per operand 1-4 / 5-6   |
| addition_steps        | `678+456=` → `8+6+0=14,7+5+1=13,6+4+1=11;1134`        | digits 1-4 / 5-6               |
| multiplication        | `23*45=` → `1035`                                     | digits 1-3 / 4-5               |
| multiplication_steps  | `23*45=` → `23*5=115,23*40=920,115+920=1035;1035`     | digits 1-3 / 4-5               |
| modarith              | `(3+5)*(2-4) mod 10=` → `4`                           | operations 1-4 / 5-8           |
| s5                    | `s5:21034,10243=` → `12043` (state tracking)          | permutations 1-6 / 7-12        |
| binding               | `c=7,a=b,b=c,x=4;a=` → `7` (follow the chain)         | hops 1-4 / 5-8                 |
| iteration             | `f=3709518264,x=4,k=3:` → `...;7` (filler, answer)    | iterations k 1-8 / 9-16        |

- addition / multiplication: each operand gets a number of digits drawn uniformly from the range
  (no leading zeros). With steps, addition writes one `a+b+carry=sum` per column, least
  significant first; multiplication writes one partial product per digit of the second operand and
  a running sum after each.
- modarith: a random expression tree of `+ - *` over residues, parenthesised below the top level,
  reduced modulo `mod` (default 10).
- s5: the state starts as `01234`; each permutation `p` rearranges it, `new[i] = old[p[i]]`; the
  answer is the final state (so the task is composition in S_size, `size` default 5).
- binding: one chain `v_h=v_(h-1), ..., v_1=v_0, v_0=DIGIT` plus `distract` distractor chains
  (default 3), statements shuffled; the query is `v_h`, `hops` links away from its digit.
- iteration: `f` is a random permutation of 0..size-1 written as its table (f(i) is the i-th
  digit); the answer is f applied k times to x. The model first writes `fill*k` filler dots, so
  the answer needs k serial steps while only filler tokens are emitted (`fill=0`: no filler).

`Example.steps` is the number of serial steps of each example (columns, partial products,
operations, permutations, hops, iterations).

Spec syntax (for `--data task:...` and for evaluation task names)::

    task:NAME                                   defaults
    task:NAME:KEY=VALUE,KEY=VALUE               knobs (no shell quoting needed)
    task:NAME?KEY=VALUE&KEY=VALUE               the same, URL style (quote it in a shell)

Knobs every task takes: `n` (training examples, default 20000), `seed` (default 0), the task's
difficulty knob as `D` (train range 1..D) or `A-B`, and `test` (`A-B` or `C`, the test split's
range; default just above training). Task knobs: `mod` (modarith), `size` (s5, iteration),
`distract` (binding: distractor chains), `fill` (iteration: filler dots per step). Example:
`task:addition:digits=3,test=4-5,n=50000`.

Held out by construction: every problem is assigned to one side of the split by a stable hash of
its canonical key (`problem_key`: the prompt, or for binding its statements sorted), SHA-256 over
`SPLIT_SALT` and the key, so the same in every process and Python version. A problem whose hash
falls below `HELD_OUT_FRACTION` (a quarter) is *held out*: "train" never draws it, "val" and "test"
draw only such problems, at every length (in the training range and beyond it). So no val or test
item of any configuration is ever a training item of any configuration of the same task family
(`addition` and `addition_steps` share prompts and so share the split), whatever the knobs, and
`chat:task:` SFT data (the train split) never holds a problem that `chat:TASK` evaluates (the test
split). Each length keeps about its share; a length with few problems may hold none out (then its
val/test items come from the other lengths) or only a few (test repeats them: evaluation reports
how many are distinct).

As a data source, train is `n` examples drawn with the seed, val is `round(n * val_fraction)`
(at least 1) distinct held-out problems of the training range, drawn with another seed. The
*test* split is for evaluation (`latentloop.eval.generation`), never for training.

Baselines (`task_baselines`): beside every accuracy, per length and on the very test items scored,
*chance* (1 / the number of possible answers at that length, where the task defines it, else None
with the reason), *copy* (the accuracy of answering with a value copied from the input, e.g. x
itself for iteration, where the task defines one) and *majority* (the most frequent answer of the
training split, scored on the test items).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from latentloop.data.base import Source
from latentloop.errors import DataError

# Bump whenever a generator changes what it writes, so that cached token shards are rebuilt
# (2: problems split by hash, train never draws a held-out one).
TASKS_VERSION = 2

TASK_SPLITS = ("train", "val", "test")
ANSWER_SEPARATOR = ";"
FILLER = "."
DEFAULT_TRAIN_EXAMPLES = 20_000
MAX_TRAIN_EXAMPLES = 50_000_000
VARIABLE_NAMES = "abcdefghijklmnopqrstuvwxyz"

# The share of every length's problems that training never sees (val and test draw from it): a
# quarter leaves training most of a small length (S3 length 1 has 6 problems) while larger lengths
# still give thousands of distinct held-out items.
HELD_OUT_FRACTION = 0.25
# Salted into the split hash; changing it re-deals which problems are held out (bump TASKS_VERSION).
SPLIT_SALT = "latentloop.tasks.split.v1"
# Draws of one length that all land on the other side of the split before that length is taken to
# have no problem on this side: at the smallest share a length can hold (1 of its problems, say 1/6)
# a wrong verdict has probability (5/6)**1000 < 1e-79.
MAX_DRAWS_PER_LENGTH = 1_000
# Training examples read to find the majority answer (the first ones of the train stream).
BASELINE_TRAIN_EXAMPLES = DEFAULT_TRAIN_EXAMPLES
# Bytes of the digest read as the split hash: 64 bits resolve HELD_OUT_FRACTION far below any use.
SPLIT_HASH_BYTES = 8


@dataclass(frozen=True)
class Example:
    """One task example. `answer` is what is checked; `work` the written steps (may be empty)."""

    prompt: str
    answer: str
    steps: int | None = None
    work: str = ""

    @property
    def completion(self) -> str:
        """What the model should write after the prompt (before the newline)."""
        return f"{self.work}{ANSWER_SEPARATOR}{self.answer}" if self.work else self.answer


def final_answer(generated: str) -> str:
    """The answer inside generated text: its first line, after the last `;`, stripped."""
    line = generated.split("\n", 1)[0]
    return line.rsplit(ANSWER_SEPARATOR, 1)[-1].strip()


def split_hash(key: str) -> float:
    """Where a problem falls in [0, 1): SHA-256 of the salt and its canonical key, so the split is
    the same in every process, machine and Python version (unlike the salted built-in `hash`)."""
    digest = hashlib.sha256(f"{SPLIT_SALT}\0{key}".encode()).digest()
    return int.from_bytes(digest[:SPLIT_HASH_BYTES], "big") / 2 ** (8 * SPLIT_HASH_BYTES)


def _parse_range(knob: str, value: str) -> tuple[int, int]:
    low, dash, high = value.partition("-")
    try:
        bounds = (int(low), int(high)) if dash else (1, int(low))
    except ValueError:
        raise DataError(f"task knob {knob}={value!r}: expected N or A-B (integers)") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise DataError(f"task knob {knob}={value!r}: need 1 <= A <= B")
    return bounds


class TaskGenerator:
    """Base class. Subclasses set `name`, `knob` (difficulty knob name), `train_range`, `extra`
    (how far past training the default test range reaches), `limit` (largest difficulty) and
    implement `make(rng, level) -> Example`."""

    name: str = ""
    knob: str = ""
    description: str = ""
    train_range: tuple[int, int] = (1, 1)
    test_range: tuple[int, int] | None = None  # None: (train_max + 1, train_max + extra)
    extra: int = 1
    limit: int = 1_000
    params: dict[str, int] = {}  # task-specific integer knobs and their defaults
    param_limits: dict[str, tuple[int, int]] = {}

    def __init__(self, **params: int):
        self.params = {**type(self).params, **params}

    # -- configuration ---------------------------------------------------------------------------
    def configure(self, knobs: dict[str, str]) -> TaskGenerator:
        """A copy with knobs (strings from a spec) applied; raises DataError on a bad knob."""
        task = copy.copy(self)
        task.params = dict(self.params)
        for key, value in knobs.items():
            if key == self.knob:
                task.train_range = _parse_range(key, value)
                if "test" not in knobs:
                    task.test_range = None
            elif key == "test":
                test = _parse_range(key, value)
                task.test_range = test if "-" in value else (test[1], test[1])
            elif key in task.params:
                try:
                    task.params[key] = int(value)
                except ValueError:
                    raise DataError(f"task knob {key}={value!r}: expected an integer") from None
            else:
                valid = ", ".join(["n", "seed", self.knob, "test", *self.params])
                raise DataError(f"unknown knob {key!r} for task {self.name!r}: valid knobs are {valid}")
        task.check()
        return task

    def check(self) -> None:
        for key, (low, high) in self.param_limits.items():
            if not low <= self.params[key] <= high:
                raise DataError(f"task {self.name!r}: {key} must be in {low}..{high}, got {self.params[key]}")
        for label, (low, high) in (("training", self.train_range), ("test", self.split_range("test"))):
            if high > self.limit:
                raise DataError(f"task {self.name!r}: {self.knob} {low}-{high} of the {label} split exceeds "
                                f"the largest supported value {self.limit}")

    def split_range(self, split: str) -> tuple[int, int]:
        if split == "test":
            if self.test_range is not None:
                return self.test_range
            high = self.train_range[1]
            return high + 1, high + self.extra
        return self.train_range

    def settings(self) -> dict[str, object]:
        """Everything that decides the examples (for fingerprints and reports)."""
        return {"task": self.name, "train": list(self.train_range), "test": list(self.split_range("test")),
                **self.params}

    # -- generation ------------------------------------------------------------------------------
    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        """`n` examples of `split` ("train", "val" or "test"), the same for the same arguments."""
        return list(self.iter_examples(split, n, seed))

    def iter_examples(self, split: str, n: int, seed: int = 0) -> Iterator[Example]:
        """Train draws only problems that are not held out; val and test only held-out ones (see
        the module docstring). Lengths are uniform over the split's range, less any length with no
        problem on this side of the split."""
        if split not in TASK_SPLITS:
            raise ValueError(f"split must be one of {TASK_SPLITS}, got {split!r}")
        # A string seed is hashed by `random` itself (SHA-512), so streams are stable everywhere
        # and independent across tasks, settings and splits.
        rng = random.Random(json.dumps([self.settings(), split, seed], sort_keys=True))
        low, high = self.split_range(split)
        held_out = split != "train"
        empty: set[int] = set()  # lengths found to have no problem on this side of the split
        for _ in range(n):
            yield self._draw(rng, low, high, held_out, empty)

    def _draw(self, rng: random.Random, low: int, high: int, held_out: bool, empty: set[int]) -> Example:
        while len(empty) <= high - low:
            level = rng.randint(low, high)
            if level in empty:
                continue
            for _ in range(MAX_DRAWS_PER_LENGTH):
                example = self.make(rng, level)
                if self.is_held_out(example.prompt) == held_out:
                    return example
            empty.add(level)
        side = "held-out" if held_out else "training"
        raise DataError(f"task {self.name!r}: no {side} problem at {self.knob} {low}-{high} (each problem is held "
                        f"out by a hash of itself, and these lengths have too few problems); widen the range")

    def problem_key(self, prompt: str) -> str:
        """The canonical encoding of the problem a prompt poses: what the split hashes and what the
        no-overlap checks compare. The prompt itself writes the whole input of most tasks."""
        return prompt

    def is_held_out(self, prompt: str) -> bool:
        """Whether a problem is kept out of training (it may be a val or test item)."""
        return split_hash(self.problem_key(prompt)) < HELD_OUT_FRACTION

    def make(self, rng: random.Random, level: int) -> Example:
        raise NotImplementedError

    # -- baselines (see `task_baselines`) --------------------------------------------------------
    chance_rule: str = ""  # how answer_space counts, for the report
    no_chance_reason: str = "the task does not define its number of possible answers"
    copy_rule: str = ""  # which input value copy_answer copies, for the report
    no_copy_reason: str = "the input holds no value of the answer's kind to copy"

    def answer_space(self, level: int) -> int | None:
        """How many answers are possible at a length (chance = 1 / this); None where undefined."""
        return None

    def copy_answer(self, example: Example) -> str | None:
        """The answer a model gives by copying a value of the input; None where there is none."""
        return None

    def format(self, example: Example) -> str:
        """The training document of one example: prompt + completion + newline."""
        return f"{example.prompt}{example.completion}\n"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings()})"


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(0, 9) if digits == 1 else rng.randint(10 ** (digits - 1), 10 ** digits - 1)


class _TwoOperands(TaskGenerator):
    """Arithmetic on two numbers, answered directly or after written steps (`written=True`)."""

    knob = "digits"
    base_name = ""
    base_description = ""
    steps_description = ""

    def __init__(self, written: bool = False, **params: int):
        super().__init__(**params)
        self.written = written
        self.name = f"{self.base_name}_steps" if written else self.base_name
        self.description = self.base_description + (f" with {self.steps_description}" if written else "")

    def operands(self, rng: random.Random, level: int) -> tuple[int, int]:
        """The longer operand has exactly `level` digits, the other any number up to it, so that a
        test example is never shorter than the training ones."""
        a, b = _number(rng, level), _number(rng, rng.randint(1, level))
        return (b, a) if rng.random() < 0.5 else (a, b)


class Addition(_TwoOperands):
    base_name, base_description, steps_description = "addition", "multi-digit addition", "written column steps"
    train_range = (1, 4)
    extra = 2
    limit = 60
    chance_rule = "1 / the number of sums the operands reach at that length (0-18 at one digit)"
    copy_rule = "the first operand (right when the second is 0)"

    def answer_space(self, level: int) -> int:
        # the longer operand has exactly `level` digits (0-9 at one digit), the other any up to it
        smallest = 0 if level == 1 else 10 ** (level - 1)
        return 2 * (10 ** level - 1) - smallest + 1

    def copy_answer(self, example: Example) -> str:
        return example.prompt.split("+", 1)[0]

    def make(self, rng: random.Random, level: int) -> Example:
        a, b = self.operands(rng, level)
        total = a + b
        columns = max(len(str(a)), len(str(b)))
        work = ""
        if self.written:
            parts, carry = [], 0
            for i in range(columns):
                da, db = a // 10 ** i % 10, b // 10 ** i % 10
                s = da + db + carry
                parts.append(f"{da}+{db}+{carry}={s}")
                carry = s // 10
            work = ",".join(parts)
        return Example(f"{a}+{b}=", str(total), columns, work)


class Multiplication(_TwoOperands):
    base_name, base_description = "multiplication", "multi-digit multiplication"
    steps_description = "written partial products"
    train_range = (1, 3)
    extra = 2
    limit = 30
    no_chance_reason = "how many distinct products numbers of a given length have has no closed form"
    copy_rule = "the first operand (right when the second is 1 or the first is 0)"

    def copy_answer(self, example: Example) -> str:
        return example.prompt.split("*", 1)[0]

    def make(self, rng: random.Random, level: int) -> Example:
        a, b = self.operands(rng, level)
        digits_b = len(str(b))
        work = ""
        if self.written:
            parts, running = [], 0
            for i in range(digits_b):
                digit = b // 10 ** i % 10
                partial = a * digit * 10 ** i
                parts.append(f"{a}*{digit * 10 ** i}={partial}")
                if i:
                    parts.append(f"{running}+{partial}={running + partial}")
                running += partial
            work = ",".join(parts)
        return Example(f"{a}*{b}=", str(a * b), digits_b, work)


class ModularArithmetic(TaskGenerator):
    name = "modarith"
    description = "modular arithmetic expressions"
    knob = "ops"
    train_range = (1, 4)
    extra = 4
    limit = 200
    params = {"mod": 10}
    param_limits = {"mod": (2, 1000)}
    chance_rule = "1 / mod (every residue is an answer)"
    copy_rule = "the first number written (right when the expression reduces to it)"

    def answer_space(self, level: int) -> int:
        return self.params["mod"]

    def copy_answer(self, example: Example) -> str:
        return re.search(r"\d+", example.prompt).group(0)

    def _tree(self, rng: random.Random, ops: int) -> tuple[str, int]:
        mod = self.params["mod"]
        if ops == 0:
            value = rng.randrange(mod)
            return str(value), value
        left_ops = rng.randint(0, ops - 1)
        left, a = self._tree(rng, left_ops)
        right, b = self._tree(rng, ops - 1 - left_ops)
        op = rng.choice("+-*")
        value = (a + b) % mod if op == "+" else (a - b) % mod if op == "-" else (a * b) % mod
        return f"({left}{op}{right})", value

    def make(self, rng: random.Random, level: int) -> Example:
        text, value = self._tree(rng, level)
        return Example(f"{text[1:-1]} mod {self.params['mod']}=", str(value), level)


class PermutationComposition(TaskGenerator):
    name = "s5"
    description = "permutation composition state tracking (S5)"
    knob = "length"
    train_range = (1, 6)
    extra = 6
    limit = 500
    params = {"size": 5}
    param_limits = {"size": (2, 10)}
    chance_rule = "1 / size! (every permutation is a final state)"
    copy_rule = "the first permutation written (right at length 1, and when the rest compose to the identity)"

    def answer_space(self, level: int) -> int:
        return math.factorial(self.params["size"])

    def copy_answer(self, example: Example) -> str:
        return example.prompt.split(":", 1)[1].split(",", 1)[0].rstrip("=")

    def make(self, rng: random.Random, level: int) -> Example:
        size = self.params["size"]
        state = list(range(size))
        perms = []
        for _ in range(level):
            p = list(range(size))
            rng.shuffle(p)
            perms.append(p)
            state = [state[p[i]] for i in range(size)]
        text = ",".join("".join(map(str, p)) for p in perms)
        return Example(f"s{size}:{text}=", "".join(map(str, state)), level)


class VariableBinding(TaskGenerator):
    name = "binding"
    description = "variable-binding chains"
    knob = "hops"
    train_range = (1, 4)
    extra = 4
    limit = len(VARIABLE_NAMES) - 1
    params = {"distract": 3}
    param_limits = {"distract": (0, 25)}
    chance_rule = "1 / 10 (the answer is a digit)"
    copy_rule = "the first digit written (right when it starts the queried chain, always without distractors)"

    def answer_space(self, level: int) -> int:
        return 10

    def copy_answer(self, example: Example) -> str:
        return re.search(r"\d", example.prompt).group(0)

    def problem_key(self, prompt: str) -> str:
        """The statements sorted, then the query: the same chains in another order pose the same problem,
        so they must fall on the same side of the split."""
        statements, _, query = prompt.rpartition(";")
        return ",".join(sorted(statements.split(","))) + ";" + query

    def make(self, rng: random.Random, level: int) -> Example:
        names = list(VARIABLE_NAMES)
        rng.shuffle(names)
        chain, names = names[: level + 1], names[level + 1:]
        value = rng.randint(0, 9)
        statements = [f"{chain[0]}={value}"] + [f"{chain[i]}={chain[i - 1]}" for i in range(1, level + 1)]
        for _ in range(self.params["distract"]):
            length = min(rng.randint(1, level), len(names) - 1)
            if length < 0:
                break
            other, names = names[: length + 1], names[length + 1:]
            statements.append(f"{other[0]}={rng.randint(0, 9)}")
            statements += [f"{other[i]}={other[i - 1]}" for i in range(1, length + 1)]
        rng.shuffle(statements)
        return Example(f"{','.join(statements)};{chain[-1]}=", str(value), level)


class FunctionIteration(TaskGenerator):
    name = "iteration"
    description = "function iteration with filler tokens"
    knob = "k"
    train_range = (1, 8)
    extra = 8
    limit = 10_000
    params = {"size": 10, "fill": 1}
    param_limits = {"size": (2, 10), "fill": (0, 16)}
    chance_rule = "1 / size (the answer is a point of f's domain)"
    copy_rule = "x itself (right when the length of x's cycle under f divides k)"

    def answer_space(self, level: int) -> int:
        return self.params["size"]

    def copy_answer(self, example: Example) -> str:
        return re.search(r",x=(\d+),", example.prompt).group(1)

    def make(self, rng: random.Random, level: int) -> Example:
        size = self.params["size"]
        table = list(range(size))
        rng.shuffle(table)
        x = rng.randrange(size)
        y = x
        for _ in range(level):
            y = table[y]
        prompt = f"f={''.join(map(str, table))},x={x},k={level}:"
        return Example(prompt, str(y), level, FILLER * (self.params["fill"] * level))


def _registry() -> dict[str, TaskGenerator]:
    tasks: list[TaskGenerator] = [
        Addition(), Addition(written=True), Multiplication(), Multiplication(written=True),
        ModularArithmetic(), PermutationComposition(), VariableBinding(), FunctionIteration(),
    ]
    return {task.name: task for task in tasks}


TASKS: dict[str, TaskGenerator] = _registry()


@dataclass(frozen=True)
class TaskSpec:
    """A parsed task spec: the configured generator plus the source-level knobs."""

    name: str
    task: TaskGenerator
    n: int
    seed: int
    spec: str  # canonical form, `task:NAME[:k=v,...]`


def parse_task_spec(spec: str) -> TaskSpec:
    """`NAME`, `NAME:k=v,k=v`, `NAME?k=v&k=v` (an optional leading `task:` is accepted)."""
    text = spec.strip()
    if text.startswith("task:"):
        text = text[len("task:"):]
    if "?" in text:
        name, _, query = text.partition("?")
        pairs = [p for p in query.split("&") if p]
    else:
        name, _, query = text.partition(":")
        pairs = [p for p in query.split(",") if p]
    name = name.strip()
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}: choose from {', '.join(TASKS)}")
    knobs: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise DataError(f"task spec {spec!r}: expected KEY=VALUE, got {pair!r}")
        if key in knobs:
            raise DataError(f"task spec {spec!r}: knob {key!r} given twice")
        knobs[key] = value
    given_keys = set(knobs)
    source_knobs = {}
    for key, default in (("n", DEFAULT_TRAIN_EXAMPLES), ("seed", 0)):
        raw = knobs.pop(key, None)
        try:
            source_knobs[key] = default if raw is None else int(raw)
        except ValueError:
            raise DataError(f"task knob {key}={raw!r}: expected an integer") from None
    if not 1 <= source_knobs["n"] <= MAX_TRAIN_EXAMPLES:
        raise DataError(f"task knob n must be in 1..{MAX_TRAIN_EXAMPLES}, got {source_knobs['n']}")
    task = TASKS[name].configure(knobs)
    given = {**knobs, **{key: str(value) for key, value in source_knobs.items() if key in given_keys}}
    canonical = f"task:{name}" + (":" + ",".join(f"{k}={given[k]}" for k in sorted(given)) if given else "")
    return TaskSpec(name, task, source_knobs["n"], source_knobs["seed"], canonical)


def get_task(spec: str) -> TaskGenerator:
    """The generator for a task name or spec (knobs applied)."""
    return parse_task_spec(spec).task


# How long val looks for distinct held-out problems before settling for fewer (a small range may
# hold fewer than n_val of them).
VAL_DRAWS_PER_EXAMPLE = 50
VAL_EXTRA_DRAWS = 1_000


class TaskSource(Source):
    """A built-in task as a data source: one document per example (see the module docstring)."""

    def __init__(self, parsed: TaskSpec, val_fraction: float = 0.05):
        self.parsed = parsed
        self.task = parsed.task
        self.spec = parsed.spec
        self.val_fraction = val_fraction
        self.n_train = parsed.n
        self.n_val = max(1, round(parsed.n * val_fraction))

    def iter_examples(self, split: str) -> Iterator[Example]:
        """The examples of "train", "val" (distinct held-out problems of the training range) or
        "test" (`n_val` held-out problems of the test range)."""
        if split == "train":
            yield from self.task.iter_examples("train", self.n_train, self.parsed.seed)
        elif split == "val":
            # Held out from train by construction (the val stream draws only held-out problems);
            # each problem once, so a small length weighs no more than it has problems.
            seen: set[str] = set()
            for example in self.task.iter_examples("val", VAL_DRAWS_PER_EXAMPLE * self.n_val + VAL_EXTRA_DRAWS,
                                                   self.parsed.seed):
                key = self.task.problem_key(example.prompt)
                if key in seen:
                    continue
                seen.add(key)
                yield example
                if len(seen) == self.n_val:
                    return
        elif split == "test":
            yield from self.task.iter_examples("test", self.n_val, self.parsed.seed)
        else:
            raise ValueError(f"split must be one of {TASK_SPLITS}, got {split!r}")

    def iter_documents(self, split: str) -> Iterator[str]:
        for example in self.iter_examples(split):
            yield self.task.format(example)

    def fingerprint(self) -> str:
        payload = ["task", TASKS_VERSION, self.task.settings(), self.n_train, self.parsed.seed, self.val_fraction]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def majority_answer(answers: Iterable[str]) -> tuple[str, int]:
    """(the most frequent answer, how many answers were read); a tie goes to the answer that sorts
    first, so the baseline does not depend on the order of the stream."""
    counts = Counter(answers)
    if not counts:
        raise DataError("no training answers to take the majority of")
    return min(counts, key=lambda answer: (-counts[answer], answer)), sum(counts.values())


def task_baselines(task: TaskGenerator, test: Sequence[Example], train: Iterable[Example | str]) -> dict:
    """Chance, copy and majority accuracy on the given test items, per length and over all of them.

    `train`: training examples (or their bare answers). The majority baseline answers each test
    item with the most frequent training answer of its own length, and with the most frequent of
    all training answers at a length training has none of (beyond the range, or bare answers).
    Returns {"by_length": {length: {"n", "distinct", "chance", "copy", "majority"}}, "overall": {...},
    "rules": {kind: what it scores}, "undefined": {kind: why it is None}, "majority_answer",
    "majority_by_length", "majority_train_examples"}; a kind the task does not define is None (its
    reason under "undefined"). `distinct` counts distinct problems (a length with few held-out
    problems repeats them).
    """
    train = [(None, item) if isinstance(item, str) else (item.steps or 0, item.answer) for item in train]
    majority, read = majority_answer(answer for _, answer in train)
    by_length_answers: dict[int, list[str]] = {}
    for length, answer in train:
        if length is not None:
            by_length_answers.setdefault(length, []).append(answer)
    majority_at = {length: majority_answer(answers)[0] for length, answers in by_length_answers.items()}
    copies = [task.copy_answer(example) for example in test]
    spaces = [task.answer_space(example.steps or 0) for example in test]
    undefined = {}
    if any(space is None for space in spaces):
        undefined["chance"] = task.no_chance_reason
    if any(answer is None for answer in copies):
        undefined["copy"] = task.no_copy_reason

    def scores(indices: list[int]) -> dict:
        def mean(values: list[float]) -> float:
            return sum(values) / len(values)

        return {"n": len(indices), "distinct": len({task.problem_key(test[i].prompt) for i in indices}),
                "chance": None if "chance" in undefined else mean([1 / spaces[i] for i in indices]),
                "copy": None if "copy" in undefined else mean([copies[i] == test[i].answer for i in indices]),
                "majority": mean([test[i].answer == majority_at.get(test[i].steps or 0, majority) for i in indices])}

    lengths: dict[int, list[int]] = {}
    for index, example in enumerate(test):
        lengths.setdefault(example.steps or 0, []).append(index)
    rules = {"chance": task.chance_rule or None, "copy": task.copy_rule or None,
             "majority": f"the most frequent answer of the first {read} training examples at the item's length "
                         f"(at a length they have none of: of them all, {majority!r})"}
    return {"by_length": {str(length): scores(indices) for length, indices in sorted(lengths.items())},
            "overall": scores(list(range(len(test)))) if test else {}, "rules": rules, "undefined": undefined,
            "majority_answer": majority, "majority_by_length": {str(k): v for k, v in sorted(majority_at.items())},
            "majority_train_examples": read}


def spec_baselines(parsed: TaskSpec, test: Sequence[Example]) -> dict:
    """`task_baselines` with the majority taken over the spec's own training stream (its first
    BASELINE_TRAIN_EXAMPLES examples: the stream's prefix does not depend on `n`)."""
    train = parsed.task.iter_examples("train", min(parsed.n, BASELINE_TRAIN_EXAMPLES), parsed.seed)
    return task_baselines(parsed.task, test, train)


def get_task_source(name: str, val_fraction: float = 0.05) -> TaskSource:
    """The Source behind `--data task:NAME[:KNOBS]` (`name` is what follows `task:`)."""
    return TaskSource(parse_task_spec(name), val_fraction)


def describe_tasks() -> str:
    """One line per task: name, description, difficulty knob and its default ranges."""
    lines = []
    for name, task in TASKS.items():
        (a, b), (c, d) = task.train_range, task.split_range("test")
        lines.append(f"{name:22s} {task.description}; {task.knob} train {a}-{b}, test {c}-{d}")
    return "\n".join(lines)


__all__ = ["ANSWER_SEPARATOR", "HELD_OUT_FRACTION", "Example", "TASKS", "TaskGenerator", "TaskSource", "TaskSpec",
           "describe_tasks", "final_answer", "get_task", "get_task_source", "majority_answer", "parse_task_spec",
           "spec_baselines", "split_hash", "task_baselines"]
