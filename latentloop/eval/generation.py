"""Generation tasks: the model writes an answer, which is extracted and checked.

Tasks (`GENERATION_TASKS`, each `fn(model, tokenizer, data_dir, options, limit, progress) -> dict`):

- `gsm8k`, `svamp` (`gsm8k.jsonl`, `svamp.jsonl`: `context`, `chain_of_thought`, `answer`): a few-shot
  prompt of other rows of the same file, each `Question: ...\\nAnswer: <chain of thought> #### <answer>`
  (calculator annotations `<<...>>` removed, one line per answer); generation stops at a blank line
  or at `Question:`; the answer is the number after `####`, else after "answer is", else the last
  number written; exact match as numbers (`1,000` = `1000.0`);
- `simple_arithmetic` (`simple_arithmetic_nospaces.jsonl`: `context`, `continuation`): few-shot
  lines `25-759=-734`, the first generated line must equal the continuation;
- one task per built-in reasoning task (`addition`, `s5`, ...; see `latentloop.data.tasks`): its
  *test* split (held-out problems only, never trained on), zero-shot, as trained (`prompt` →
  `work;answer` or `answer`, one line).
  `run_generation_tasks` also takes specs with knobs, e.g. `addition:digits=3` or
  `task:addition:digits=3,test=4-5`, to evaluate a model trained on `--data task:addition:digits=3`;
- `humaneval` (`human_eval.jsonl`): the prompt is completed until a new top-level statement; the
  function with its tests runs in `latentloop.eval.sandbox` (bubblewrap namespaces, a throwaway uid,
  a read-only view but for a size-limited work folder, no network, timeout and memory limit; it
  raises `SandboxUnavailable` before generating anything where that isolation is missing); the
  tests, after the prompt's own helpers, take only the entry point from the candidate and call the
  real builtins (`humaneval_program`); pass@k by the unbiased estimator over `samples` per problem.

Files are read from `data_dir` (or its `eval/` subfolder). Every prompt starts with BOS, as the
training documents do. A prompt longer than the model's context minus the generation budget first
loses few-shot examples, then its oldest tokens (counted in `truncated_prompts`). Decoding is
greedy unless sampling is asked for (humaneval with samples > 1). `options` go to
`latentloop.generate` untouched (e.g. `{"regime": "soft"}` for fbt).

Chat-format tasks (for SFT runs, whose tokenizer has chat tokens; `latentloop.data.chat`): the
question is the user turn, the model answers after `<|assistant|>` until `<|end|>`, zero-shot:

- `chat:gsm8k` (`gsm8k.jsonl`, the test split): the user turn is the question, as SFT on
  `chat:gsm8k_train.jsonl:question=user,answer=assistant` trained it; the answer is read as for `gsm8k`;
- `chat:TASK[:knobs]` for a built-in task (`chat:addition_steps`): prompt as the user turn, the
  reply read as the task's line (`work;answer`).

Every result holds `accuracy`, `n` (examples scored), `mean_trace_tokens` (generated tokens until
the answer is complete: until the stop string / newline / end token, or the budget),
`mean_reasoning_tokens` (generated tokens before the final answer starts: before `####` / "answer
is" / the last number for word problems, before the last `;` for built-in tasks, so 0 for a bare
answer; the papers' "trace length"), `seconds`,
plus task details (`max_new_tokens`, `truncated_prompts`, `shots`, `accuracy_by_steps` for the
built-in tasks, `pass@k` and `statuses` for humaneval) and the first few `examples` (prompt tail,
output, target, correct).

Built-in tasks (plain and chat) also report, per length, the model's accuracy beside its baselines
on the same test items (`by_length`: {length: {"n", "distinct", "accuracy", "chance", "copy",
"majority"}}) and `baselines` ({"overall", "rules", "undefined", "majority_answer", ...}; see
`latentloop.data.tasks.task_baselines`); `format_by_length` writes them as text. Their intervals
(`accuracy_ci`, overall and per length) count distinct prompts, not items: the test split repeats a
prompt where a length has few held-out problems, and repeats decode alike (`distinct` says how many).

Keyword arguments beyond the common six (for scripts and tests): `shots`, `max_new_tokens` (gsm8k
and svamp 256, simple_arithmetic 16, built-in tasks the longest reference + 25%, humaneval 512; at
most half the model's context) and `batch_size` (32) for all; humaneval also `samples` (1),
`temperature` (0 for one sample, else 0.8), `top_p`, `ks`, `timeout`, `memory_mb`, `workers`, `seed`.
"""

from __future__ import annotations

import ast
import random
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import partial
from pathlib import Path

from tqdm import tqdm

from latentloop.data.sources import iter_jsonl
from latentloop.data.tasks import (
    ANSWER_SEPARATOR,
    TASKS,
    Example,
    TaskSpec,
    final_answer,
    parse_task_spec,
    spec_baselines,
)
from latentloop.engine import MAX_SEED, fit_prompt, stream
from latentloop.errors import ConfigError, DataError
from latentloop.eval.sandbox import BUILTIN_NAMES, require_sandbox, run_untrusted
from latentloop.eval.stats import wilson_interval

DEFAULT_BATCH_SIZE = 32
DEFAULT_TASK_EXAMPLES = 500  # test examples of a built-in task when no limit is given
GSM8K_SHOTS = 8
SVAMP_SHOTS = 5
ARITHMETIC_SHOTS = 5
HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
PROMPT_DEF = re.compile(r"^(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)", re.MULTILINE)  # a top-level function's name
WORD_PROBLEM_STOPS = ("\n\n", "Question:")
NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
EXAMPLES_REPORTED = 3


@dataclass
class Generation:
    text: str  # the generated text, cut before the first stop string
    tokens: int  # generated tokens up to the end of `text` (the trace length)
    ids: tuple[int, ...] = ()  # those tokens


def tokens_before(tokenizer, generation: Generation, position: int) -> int:
    """How many of the generation's tokens it takes to write its text up to character `position`
    (the fewest whose decoded text reaches it)."""
    return _fewest_tokens_reaching(tokenizer, list(generation.ids[:generation.tokens]), position)


def _fewest_tokens_reaching(tokenizer, ids: list[int], position: int) -> int:
    """The fewest leading `ids` whose decoded text is at least `position` characters long
    (a binary search: decoded length only grows with more tokens)."""
    low, high = 0, len(ids)
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(ids[:middle])) >= position:
            high = middle
        else:
            low = middle + 1
    return low


def word_problem_answer_start(text: str) -> int:
    """Where the final answer of a word-problem solution starts (as `extract_number` reads it):
    its `####` or "answer is", else its last number; the text's length when it has no number."""
    marked = re.search(r"####|answer is", text, flags=re.IGNORECASE)
    if marked is not None:
        return marked.start()
    numbers = list(NUMBER.finditer(text))
    return numbers[-1].start() if numbers else len(text)


def task_answer_start(text: str) -> int:
    """Where the answer of a built-in task's line starts: after its work (the last `;`), else 0."""
    line = text.split("\n", 1)[0]
    cut = line.rfind(ANSWER_SEPARATOR)
    return 0 if cut < 0 else cut


# -- answers ---------------------------------------------------------------------------------------
def to_number(text: str) -> Decimal | None:
    """`"1,000"`, `"$18"`, `"18.0"`, `"-3."` -> Decimal; None when there is no number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_number(text: str) -> str | None:
    """The final numeric answer in a model's text: after `####`, else after "answer is", else the
    last number. Returned without thousands separators; None when the text has no number."""
    marked = re.search(r"####\s*\$?\s*(" + NUMBER.pattern + ")", text)
    if marked is None:
        marked = re.search(r"answer is\s*:?\s*\$?\s*(" + NUMBER.pattern + ")", text, flags=re.IGNORECASE)
    if marked is not None:
        return marked.group(1).replace(",", "")
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def numbers_match(predicted: str | None, gold: str) -> bool:
    if predicted is None:
        return False
    a, b = to_number(predicted), to_number(gold)
    return a is not None and b is not None and a == b


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 - C(n-c, k) / C(n, k), for n samples of which c pass."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # The product form avoids huge binomials: C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i).
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


# -- generation ------------------------------------------------------------------------------------
_STOP_ID_CACHE: dict[tuple[str, str], list[int]] = {}


def newline_token_ids(tokenizer) -> list[int]:
    """Ids of tokens that are only whitespace and contain a newline: safe to stop on for line answers."""
    key = (type(tokenizer).__name__, tokenizer.fingerprint())
    if key not in _STOP_ID_CACHE:
        special = {tokenizer.bos_id, *tokenizer.stop_ids, tokenizer.pad_id}
        ids = []
        for token_id in range(tokenizer.vocab_size):
            if token_id in special:
                continue
            text = tokenizer.decode([token_id])
            if "\n" in text and not text.strip():
                ids.append(token_id)
        _STOP_ID_CACHE[key] = ids
    return _STOP_ID_CACHE[key]


def _first_stop(text: str, stops: Sequence[str]) -> int:
    positions = [text.find(stop) for stop in stops]
    positions = [p for p in positions if p >= 0]
    return min(positions) if positions else -1


def _cut(tokenizer, tokens: list[int], stops: Sequence[str]) -> Generation:
    text = tokenizer.decode(tokens)
    position = _first_stop(text, stops)
    if position < 0:
        return Generation(text, len(tokens), tuple(tokens))
    kept = _fewest_tokens_reaching(tokenizer, tokens, position)  # covers everything before the stop string
    return Generation(text[:position], kept, tuple(tokens[:kept]))


def generate_texts(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   stops: Sequence[str] = (), options: dict | None = None, temperature: float = 0.0,
                   top_p: float | None = None, top_k: int | None = None, seed: int = 0,
                   batch_size: int = DEFAULT_BATCH_SIZE, bar: tqdm | None = None,
                   stop_token_ids: Sequence[int] = (), seed_offsets: Sequence[int] | None = None) -> list[Generation]:
    """Generate for every prompt (token ids) in batches of similar length, stopping each row at the
    end/BOS token, at a newline token when "\\n" is a stop string, or at any stop string.

    The engine stops rows only on token ids; stop strings are watched here, step by step, and the
    batch ends (by leaving the engine's generator) once every row has written one. Results come
    back in the order of `prompts`. Sampled, each prompt draws from a generator of its own, seeded
    `seed` + its offset (default: its index in `prompts`; pass the items' own indices where prompts
    are a slice of a task), so its samples do not change with the batch size or the other prompts
    (except under self-speculative options: a round drafts for the batch's longest-owing row, so a
    row's draws there depend on its batch; `engine.RowGenerators`)."""
    stop_ids = [*tokenizer.stop_ids, tokenizer.bos_id, *stop_token_ids]
    if "\n" in stops:
        stop_ids += newline_token_ids(tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    offsets = range(len(prompts)) if seed_offsets is None else seed_offsets
    results: list[Generation | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        seeds = [(seed + offsets[i]) % MAX_SEED for i in rows] if temperature > 0 else None
        tokens: list[list[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        for step in stream(model, [list(prompts[i]) for i in rows], max_new_tokens, temperature=temperature,
                           top_p=top_p, top_k=top_k, seed=seeds, stop_tokens=stop_ids,
                           pad_id=tokenizer.pad_id, **(options or {})):
            for row, token in enumerate(step.tokens):
                if done[row] or token is None:
                    done[row] = True
                    continue
                tokens[row].append(token)
                if stops and _first_stop(tokenizer.decode(tokens[row][-64:]), stops) >= 0:
                    done[row] = True
            if all(done):
                break
        for row, index in enumerate(rows):
            results[index] = _cut(tokenizer, tokens[row], stops)
        if bar is not None:
            bar.update(len(rows))
    return results  # type: ignore[return-value]


def generation_budget(model, max_new_tokens: int) -> tuple[int, int]:
    """(max new tokens, prompt tokens) that fit the model's context: generation gets at most half."""
    context = int(model.config.sequence_len)
    new = max(1, min(max_new_tokens, context // 2))
    return new, context - new


def encode_prompt(tokenizer, text: str, budget: int) -> tuple[list[int], bool]:
    """The tokens of `text` as the tokenizer starts a prompt (`as_prompt`: BOS first unless an imported
    tokenizer adds none), cut to `budget` tokens by `fit_prompt` (BOS and the most recent tokens)
    when too long."""
    return fit_prompt(tokenizer.as_prompt(tokenizer.encode(text)), budget, tokenizer.bos_id)


def few_shot_prompt(tokenizer, shots: Sequence[str], query: str, budget: int) -> tuple[list[int], int, bool]:
    """The prompt with as many of `shots` (in order) as fit before `query`: (ids, shots used, truncated)."""
    query_length = 1 + len(tokenizer.encode(query))
    used, total = 0, query_length
    for shot in shots:
        length = len(tokenizer.encode(shot))
        if total + length > budget:
            break
        used, total = used + 1, total + length
    while True:
        ids, truncated = encode_prompt(tokenizer, "".join(shots[:used]) + query, budget)
        if not truncated or used == 0:
            return ids, used, truncated
        used -= 1  # token boundaries between shots differ slightly from the separate counts


# -- data ------------------------------------------------------------------------------------------
def find_data_file(data_dir: Path | str | None, filename: str, task: str) -> Path:
    if data_dir is None:
        raise DataError(f"task {task} reads {filename}: give the folder of evaluation data (--eval-dir; "
                        f"data_dir in Python)")
    folder = Path(data_dir).expanduser()
    for candidate in (folder / filename, folder / "eval" / filename):
        if candidate.is_file():
            return candidate
    raise DataError(f"task {task}: {filename} not found in {folder}")


def read_jsonl(path: Path, keys: Sequence[str], numbers: Sequence[str] = ()) -> list[dict]:
    """The rows of a task file: JSON objects whose `keys` each hold a string (a key in `numbers` may
    hold a number instead, as answers are often written). A row that is not is a one-line DataError
    naming the file and line."""
    rows = []
    for line_number, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
        missing = [key for key in keys if key not in row]
        if missing:
            raise DataError(f"{path}:{line_number}: missing key(s) {', '.join(missing)}")
        for key in keys:
            value = row[key]
            number = key in numbers and isinstance(value, (int, float)) and not isinstance(value, bool)
            if not isinstance(value, str) and not number:
                kind = "a string or a number" if key in numbers else "a string"
                got = "null" if value is None else type(value).__name__
                raise DataError(f"{path}:{line_number}: '{key}' must be {kind}, got {got}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no rows")
    return rows


def _limited(rows: list, limit: int | None) -> list:
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    return rows if limit is None else rows[:limit]


def _shot_indices(count: int, exclude: int, shots: int, salt: str) -> list[int]:
    """`shots` row indices other than `exclude`, the same for the same row on every run."""
    rng = random.Random(f"{salt}:{exclude}")
    pool = [i for i in range(count) if i != exclude] if count <= 5_000 else None
    if pool is not None:
        return rng.sample(pool, min(shots, len(pool)))
    chosen: list[int] = []
    while len(chosen) < min(shots, count - 1):
        i = rng.randrange(count)
        if i != exclude and i not in chosen:
            chosen.append(i)
    return chosen


def _report(name: str, correct: list[bool], generations: list[Generation], started: float,
            records: list[dict], reasoning: list[int] | None = None, **extra) -> dict:
    n = len(correct)
    mean = (lambda values: sum(values) / len(values) if values else 0.0)  # noqa: E731
    return {
        "task": name,
        "accuracy": sum(correct) / n if n else 0.0,
        "accuracy_ci": _wilson(sum(correct), n),
        "n": n,
        "mean_trace_tokens": mean([g.tokens for g in generations]),
        **({"mean_reasoning_tokens": mean(reasoning)} if reasoning is not None else {}),
        "seconds": time.perf_counter() - started,
        **extra,
        "examples": records[:EXAMPLES_REPORTED],
    }


def _wilson(successes: int, n: int) -> list[float] | None:
    """The 95% Wilson interval of successes / n as a JSON-ready pair (None without items)."""
    interval = wilson_interval(successes, n)
    return None if interval is None else list(interval)


def _record(prompt_text: str, generation: Generation, target: str, correct: bool) -> dict:
    return {"prompt": prompt_text[-200:], "output": generation.text, "target": target, "correct": correct}


# -- word problems and arithmetic ------------------------------------------------------------------
def _word_problem_shot(row: dict) -> str:
    steps = re.sub(r"<<[^>]*>>", "", str(row["chain_of_thought"]))
    steps = " ".join(line.strip() for line in steps.splitlines() if line.strip())
    return f"Question: {row['context'].strip()}\nAnswer: {steps} #### {row['answer']}\n\n"


def _word_problems(name: str, filename: str, default_shots: int, model, tokenizer, data_dir, options: dict | None,
                   limit: int | None, progress: bool, *, shots: int | None = None, max_new_tokens: int = 256,
                   batch_size: int = DEFAULT_BATCH_SIZE) -> dict:
    started = time.perf_counter()
    rows = read_jsonl(find_data_file(data_dir, filename, name), ("context", "chain_of_thought", "answer"),
                      numbers=("answer",))
    evaluated = _limited(rows, limit)
    shots = default_shots if shots is None else shots
    new_tokens, budget = generation_budget(model, max_new_tokens)
    prompts, shots_used, truncated = [], [], 0
    for index, row in enumerate(evaluated):
        examples = [_word_problem_shot(rows[i]) for i in _shot_indices(len(rows), index, shots, name)]
        query = f"Question: {row['context'].strip()}\nAnswer:"
        ids, used, cut = few_shot_prompt(tokenizer, examples, query, budget)
        prompts.append(ids)
        shots_used.append(used)
        truncated += cut
    with tqdm(total=len(prompts), desc=name, unit="ex", disable=not progress) as bar:
        generations = generate_texts(model, tokenizer, prompts, new_tokens, stops=WORD_PROBLEM_STOPS, options=options,
                                     batch_size=batch_size, bar=bar)
    correct, records = [], []
    reasoning = [tokens_before(tokenizer, g, word_problem_answer_start(g.text)) for g in generations]
    for row, generation in zip(evaluated, generations):
        predicted = extract_number(generation.text)
        correct.append(numbers_match(predicted, str(row["answer"])))
        records.append(_record(row["context"], generation, str(row["answer"]), correct[-1]))
    return _report(name, correct, generations, started, records, reasoning, shots=shots,
                   mean_shots_used=sum(shots_used) / len(shots_used), truncated_prompts=truncated,
                   max_new_tokens=new_tokens)


def eval_gsm8k(model, tokenizer, data_dir, options, limit, progress, **kwargs) -> dict:
    return _word_problems("gsm8k", "gsm8k.jsonl", GSM8K_SHOTS, model, tokenizer, data_dir, options, limit, progress,
                          **kwargs)


def eval_svamp(model, tokenizer, data_dir, options, limit, progress, **kwargs) -> dict:
    return _word_problems("svamp", "svamp.jsonl", SVAMP_SHOTS, model, tokenizer, data_dir, options, limit, progress,
                          **kwargs)


def eval_simple_arithmetic(model, tokenizer, data_dir, options, limit, progress, *, shots: int = ARITHMETIC_SHOTS,
                           max_new_tokens: int = 16, batch_size: int = DEFAULT_BATCH_SIZE) -> dict:
    name = "simple_arithmetic"
    started = time.perf_counter()
    rows = read_jsonl(find_data_file(data_dir, "simple_arithmetic_nospaces.jsonl", name), ("context", "continuation"),
                      numbers=("continuation",))
    evaluated = _limited(rows, limit)
    new_tokens, budget = generation_budget(model, max_new_tokens)
    prompts, truncated = [], 0
    for index, row in enumerate(evaluated):
        examples = [f"{rows[i]['context']}{rows[i]['continuation']}\n" for i in _shot_indices(len(rows), index, shots,
                                                                                               name)]
        ids, _, cut = few_shot_prompt(tokenizer, examples, row["context"], budget)
        prompts.append(ids)
        truncated += cut
    with tqdm(total=len(prompts), desc=name, unit="ex", disable=not progress) as bar:
        generations = generate_texts(model, tokenizer, prompts, new_tokens, stops=("\n",), options=options,
                                     batch_size=batch_size, bar=bar)
    correct, records = [], []
    for row, generation in zip(evaluated, generations):
        target = str(row["continuation"]).strip()
        correct.append(generation.text.strip() == target)
        records.append(_record(row["context"], generation, target, correct[-1]))
    return _report(name, correct, generations, started, records, shots=shots, truncated_prompts=truncated,
                   max_new_tokens=new_tokens)


# -- built-in reasoning tasks ----------------------------------------------------------------------
BASELINE_KINDS = ("chance", "copy", "majority")


def _distinct_wilson(examples: Sequence[Example], correct: Sequence[bool]) -> tuple[list[float] | None, int]:
    """(the 95% Wilson interval over distinct prompts, how many there are). A built-in task's test
    split repeats a prompt where a length has few held-out problems, and repeats decode alike
    (greedy): counted as independent items they made the interval far too narrow (27 distinct
    prompts among 500 items gave [0, 0.019] where the 27 give about [0, 0.125]). Each distinct
    prompt counts once, with the share of its items answered right."""
    by_prompt: dict[str, list[bool]] = {}
    for example, ok in zip(examples, correct):
        by_prompt.setdefault(example.prompt, []).append(ok)
    successes = round(sum(sum(oks) / len(oks) for oks in by_prompt.values()))
    return _wilson(successes, len(by_prompt)), len(by_prompt)


def _task_scores(parsed: TaskSpec, examples: Sequence[Example], correct: Sequence[bool]) -> dict:
    """The per-length part of a built-in task's report: accuracy with its baselines beside it, and
    the intervals over distinct prompts (`_distinct_wilson`), overall and per length."""
    by_steps: dict[int, list[int]] = {}
    for index, example in enumerate(examples):
        by_steps.setdefault(example.steps or 0, []).append(index)
    accuracy_by_steps = {str(steps): sum(correct[i] for i in v) / len(v) for steps, v in sorted(by_steps.items())}
    interval_by_steps = {str(steps): _distinct_wilson([examples[i] for i in v], [correct[i] for i in v])[0]
                         for steps, v in by_steps.items()}
    baselines = spec_baselines(parsed, examples)
    by_length = {length: {"n": row["n"], "distinct": row["distinct"], "accuracy": accuracy_by_steps[length],
                          "accuracy_ci": interval_by_steps[length],
                          **{kind: row[kind] for kind in BASELINE_KINDS}}
                 for length, row in baselines.pop("by_length").items()}
    overall, distinct = _distinct_wilson(examples, correct)
    return {"accuracy_ci": overall, "distinct": distinct, "accuracy_by_steps": accuracy_by_steps,
            "by_length": by_length, "baselines": baselines}


def format_by_length(result: dict) -> list[str]:
    """Text lines of a built-in task's per-length accuracy and baselines (none for other tasks)."""
    rows = result.get("by_length")
    if not rows:
        return []

    def cell(value) -> str:
        return f"{value:>9.4f}" if isinstance(value, (int, float)) else f"{'n/a':>9}"

    def interval(pair) -> str:
        return f"{f'[{pair[0]:.3f}, {pair[1]:.3f}]':>15}" if pair else f"{'':>15}"

    lines = [f"  {'length':>8} {'n':>5} {'distinct':>8} {'accuracy':>9} {'95% Wilson':>15} "
             + " ".join(f"{k:>9}" for k in BASELINE_KINDS)]
    for length, row in rows.items():
        lines.append(f"  {length:>8} {row['n']:>5} {row['distinct']:>8} {cell(row['accuracy'])} "
                     f"{interval(row.get('accuracy_ci'))} " + " ".join(cell(row[kind]) for kind in BASELINE_KINDS))
    baselines = result.get("baselines", {})
    for kind in BASELINE_KINDS:
        reason = baselines.get("undefined", {}).get(kind)
        rule = baselines.get("rules", {}).get(kind)
        if reason or rule:
            lines.append(f"  {kind}: " + (f"n/a, {reason}" if reason else rule))
    return lines

def baseline_markdown(by_length: dict, lengths: Sequence[int] | None = None,
                      column: Callable[[int], str] = "len {}".format) -> list[str]:
    """A Markdown table of a built-in task's baselines per length (a report's `by_length`: what a
    model gets for nothing on those items) and the items' count; `lengths` (default: the report's)
    are the columns, `column` names one. n/a where a baseline is undefined or a length is missing."""
    lengths = sorted(int(n) for n in by_length) if lengths is None else list(lengths)

    def cell(value) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    lines = ["| baseline | " + " | ".join(column(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for kind in BASELINE_KINDS:
        lines.append(f"| {kind} | " + " | ".join(cell(by_length.get(str(n), {}).get(kind)) for n in lengths) + " |")
    lines.append("| test items (n) | " + " | ".join(str(by_length.get(str(n), {}).get("n", "")) for n in lengths)
                 + " |")
    return lines


def eval_reasoning_task(model, tokenizer, data_dir, options, limit, progress, *, spec: str,
                        max_new_tokens: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE) -> dict:
    """Accuracy on the test split of a built-in task (`spec`: a name, optionally with knobs)."""
    del data_dir  # generated, no files
    started = time.perf_counter()
    parsed = parse_task_spec(spec)
    _limited([], limit)  # checks the limit
    examples = parsed.task.examples("test", limit or DEFAULT_TASK_EXAMPLES, parsed.seed)
    if max_new_tokens is None:
        longest = max(len(tokenizer.encode(example.completion + "\n")) for example in examples)
        max_new_tokens = longest + max(4, longest // 4)
    new_tokens, budget = generation_budget(model, max_new_tokens)
    prompts, truncated = [], 0
    for example in examples:
        ids, cut = encode_prompt(tokenizer, example.prompt, budget)
        prompts.append(ids)
        truncated += cut
    with tqdm(total=len(prompts), desc=parsed.name, unit="ex", disable=not progress) as bar:
        generations = generate_texts(model, tokenizer, prompts, new_tokens, stops=("\n",), options=options,
                                     batch_size=batch_size, bar=bar)
    correct, records = [], []
    for example, generation in zip(examples, generations):
        ok = final_answer(generation.text) == example.answer
        correct.append(ok)
        records.append(_record(example.prompt, generation, example.completion, ok))
    reasoning = [tokens_before(tokenizer, g, task_answer_start(g.text)) for g in generations]
    return _report(parsed.name, correct, generations, started, records, reasoning, spec=parsed.spec,
                   settings=parsed.task.settings(), **_task_scores(parsed, examples, correct),
                   truncated_prompts=truncated, max_new_tokens=new_tokens)


# -- chat format ------------------------------------------------------------------------------------
def _chat_generations(model, tokenizer, name: str, questions: list[str], max_new_tokens: int, options, progress: bool,
                      batch_size: int) -> tuple[list[Generation], int, int]:
    """Zero-shot answers in the chat format: (generations, max new tokens, prompts truncated)."""
    tokens = getattr(tokenizer, "chat_tokens", None)
    if tokens is None:
        raise ConfigError(f"task {name} is in the chat format, but this run's tokenizer has no chat tokens "
                          f"(fine-tune it with --stage sft first)")
    new_tokens, budget = generation_budget(model, max_new_tokens)
    prompts, truncated = [], 0
    for question in questions:
        ids = tokenizer.render_prompt([{"role": "user", "content": question}])
        if len(ids) > budget:  # keep BOS and the end of the question with its <|end|><|assistant|>
            ids, _ = fit_prompt(ids, budget, tokenizer.bos_id)
            truncated += 1
        prompts.append(ids)
    with tqdm(total=len(prompts), desc=name, unit="ex", disable=not progress) as bar:
        generations = generate_texts(model, tokenizer, prompts, new_tokens, options=options, batch_size=batch_size,
                                     bar=bar, stop_token_ids=[tokens.end])
    return generations, new_tokens, truncated


def eval_chat_gsm8k(model, tokenizer, data_dir, options, limit, progress, *, max_new_tokens: int = 256,
                    batch_size: int = DEFAULT_BATCH_SIZE) -> dict:
    name = "chat:gsm8k"
    started = time.perf_counter()
    rows = _limited(read_jsonl(find_data_file(data_dir, "gsm8k.jsonl", name), ("context", "answer"),
                               numbers=("answer",)), limit)
    generations, new_tokens, truncated = _chat_generations(model, tokenizer, name, [r["context"].strip() for r in rows],
                                                           max_new_tokens, options, progress, batch_size)
    correct = [numbers_match(extract_number(g.text), str(r["answer"])) for r, g in zip(rows, generations)]
    records = [_record(r["context"], g, str(r["answer"]), ok) for r, g, ok in zip(rows, generations, correct)]
    reasoning = [tokens_before(tokenizer, g, word_problem_answer_start(g.text)) for g in generations]
    return _report(name, correct, generations, started, records, reasoning, shots=0, truncated_prompts=truncated,
                   max_new_tokens=new_tokens)


def eval_chat_task(model, tokenizer, data_dir, options, limit, progress, *, spec: str,
                   max_new_tokens: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE) -> dict:
    """A built-in task's test split in the chat format (`spec`: `chat:NAME[:knobs]`)."""
    del data_dir
    started = time.perf_counter()
    parsed = parse_task_spec(spec.removeprefix("chat:"))
    _limited([], limit)
    examples = parsed.task.examples("test", limit or DEFAULT_TASK_EXAMPLES, parsed.seed)
    if max_new_tokens is None:
        longest = max(len(tokenizer.encode(example.completion)) + 1 for example in examples)
        max_new_tokens = longest + max(4, longest // 4)
    name = f"chat:{parsed.name}"
    generations, new_tokens, truncated = _chat_generations(model, tokenizer, name, [e.prompt for e in examples],
                                                           max_new_tokens, options, progress, batch_size)
    correct = [final_answer(g.text) == e.answer for e, g in zip(examples, generations)]
    records = [_record(e.prompt, g, e.completion, ok) for e, g, ok in zip(examples, generations, correct)]
    reasoning = [tokens_before(tokenizer, g, task_answer_start(g.text)) for g in generations]
    return _report(name, correct, generations, started, records, reasoning, spec=f"chat:{parsed.spec}",
                   **_task_scores(parsed, examples, correct), truncated_prompts=truncated, max_new_tokens=new_tokens)


# -- HumanEval -------------------------------------------------------------------------------------
def humaneval_program(problem: dict, completion: str) -> tuple[str, str, tuple[str, ...]]:
    """The candidate's program (the prompt and its body), the tests with the call that runs them, and
    the names the tests take from the program.

    They run in two processes (`run_untrusted(program, tests=tests, exports=exports)`): the tests'
    assertions are decided where the candidate's code cannot reach them, with the real builtins. The
    tests take only the entry point from the candidate; the prompt's other definitions (its imports and
    helpers, such as HumanEval/38's `encode_cyclic`, which the tests call) are the data set's, as the
    tests are, and run before them in the judge: a candidate's own `abs`, `len` or `encode_cyclic`
    changes only what its own code calls."""
    entry = problem["entry_point"]
    if not (isinstance(entry, str) and entry.isidentifier()) or entry in BUILTIN_NAMES:
        raise DataError(f"{problem.get('task_id', 'a HumanEval problem')}: entry_point {entry!r} is not a name the "
                        f"tests can take from the candidate (an identifier that is no builtin's)")
    prompt = problem["prompt"]
    context, exports = _prompt_context(prompt, entry)
    return f"{prompt}{completion}\n", f"{context}{problem['test']}\n\ncheck({entry})\n", exports


def _prompt_context(prompt: str, entry: str) -> tuple[str, tuple[str, ...]]:
    """The prompt's definitions but the entry point, as source for the tests to run first, and the
    names the tests take from the candidate. A prompt that does not parse alone (none of HumanEval's)
    gives no source: its top-level functions are then taken from the candidate, builtins' names never."""
    try:
        tree = ast.parse(prompt)
    except (SyntaxError, ValueError):
        helpers = [name for name in PROMPT_DEF.findall(prompt)
                   if name != entry and name not in BUILTIN_NAMES and not name.startswith("__")]
        return "", (entry, *dict.fromkeys(helpers))
    kept = [node for node in tree.body
            if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == entry)]
    source = ast.unparse(ast.Module(body=kept, type_ignores=[]))
    return (source + "\n\n\n" if source else ""), (entry,)


def eval_humaneval(model, tokenizer, data_dir, options, limit, progress, *, samples: int = 1,
                   temperature: float | None = None, top_p: float | None = 0.95, ks: Sequence[int] = (1, 10, 100),
                   max_new_tokens: int = 512, timeout: float = 5.0, memory_mb: int = 512, workers: int = 2,
                   batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0) -> dict:
    """pass@k over `samples` candidates per problem (greedy when samples == 1, else temperature 0.8).
    `accuracy` is pass@1: with one sample the fraction of problems passed, with its Wilson interval
    (`accuracy_ci`); with several the mean per-problem pass rate, with no interval (`accuracy_ci` None,
    `accuracy_ci_note` says why) and, beside it, the fraction of problems any sample passed
    (`any_sample_passed`) with its Wilson interval."""
    name = "humaneval"
    if samples < 1:
        raise ConfigError(f"samples must be >= 1, got {samples}")
    require_sandbox()  # before any generation: raises SandboxUnavailable where candidates cannot be run safely
    started = time.perf_counter()
    problems = _limited(read_jsonl(find_data_file(data_dir, "human_eval.jsonl", name),
                                   ("task_id", "prompt", "test", "entry_point")), limit)
    if temperature is None:
        temperature = 0.0 if samples == 1 else 0.8
    new_tokens, budget = generation_budget(model, max_new_tokens)
    prompts, owners, truncated = [], [], 0
    for index, problem in enumerate(problems):
        ids, cut = encode_prompt(tokenizer, problem["prompt"], budget)
        truncated += cut
        for _ in range(samples):
            prompts.append(ids)
            owners.append(index)
    with tqdm(total=len(prompts), desc=name, unit="sample", disable=not progress) as bar:
        generations = generate_texts(model, tokenizer, prompts, new_tokens, stops=HUMANEVAL_STOPS, options=options,
                                     temperature=temperature, top_p=top_p if temperature > 0 else None, seed=seed,
                                     batch_size=batch_size, bar=bar)
        bar.set_postfix_str("running tests")
        programs = [humaneval_program(problems[owner], g.text) for owner, g in zip(owners, generations)]
        def run(program_tests_exports: tuple[str, str, tuple[str, ...]]):
            program, tests, exports = program_tests_exports
            return run_untrusted(program, timeout=timeout, memory_mb=memory_mb, tests=tests, exports=exports)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            outcomes = list(pool.map(run, programs))
    passed_per_problem = [0] * len(problems)
    statuses: dict[str, int] = {}
    for owner, outcome in zip(owners, outcomes):
        passed_per_problem[owner] += outcome.passed
        statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
    pass_k = {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in passed_per_problem) / len(problems)
              for k in sorted(set(ks)) if k <= samples}
    records = [_record(problems[owner]["prompt"], g, problems[owner]["task_id"], outcome.passed)
               for owner, g, outcome in zip(owners, generations, outcomes)]
    any_passed = [c > 0 for c in passed_per_problem]
    report = _report(name, any_passed, generations, started, records, **pass_k,
                     samples_per_problem=samples, temperature=temperature, statuses=statuses,
                     truncated_prompts=truncated, max_new_tokens=new_tokens)
    if samples > 1:
        # accuracy is the mean of per-problem pass rates (unbiased pass@1), not a count of successes out
        # of n: a Wilson interval does not describe it, so none is given; the Wilson interval of "any
        # sample passed" goes with that figure, under its own name
        report["accuracy"] = sum(c / samples for c in passed_per_problem) / len(problems)
        report["accuracy_ci"] = None
        report["accuracy_ci_note"] = (f"no interval: with {samples} samples per problem accuracy is the mean "
                                      f"pass rate (pass@1), not a proportion of problems")
        report["any_sample_passed"] = sum(any_passed) / len(problems)
        report["any_sample_passed_ci"] = _wilson(sum(any_passed), len(problems))
    return report


# -- registry --------------------------------------------------------------------------------------
GENERATION_TASKS: dict[str, Callable[..., dict]] = {
    "gsm8k": eval_gsm8k,
    "svamp": eval_svamp,
    "simple_arithmetic": eval_simple_arithmetic,
    "humaneval": eval_humaneval,
    **{name: partial(eval_reasoning_task, spec=name) for name in TASKS},
}


def resolve_generation_task(name: str) -> Callable[..., dict]:
    """The function for a task name, or for a built-in task spec with knobs (`addition:digits=3`)."""
    if name in GENERATION_TASKS:
        return GENERATION_TASKS[name]
    if name.startswith("chat:"):
        if name == "chat:gsm8k":
            return eval_chat_gsm8k
        parse_task_spec(name.removeprefix("chat:"))  # a bad task or knob is reported now
        return partial(eval_chat_task, spec=name)
    base = name.removeprefix("task:").split("?", 1)[0].split(":", 1)[0].strip()
    if base in TASKS:
        parse_task_spec(name)  # reports bad knobs now, before any task has run
        return partial(eval_reasoning_task, spec=name)
    raise ConfigError(f"unknown generation task {name!r}: choose from {', '.join(GENERATION_TASKS)}")


def split_task_names(text: str) -> list[str]:
    """`"gsm8k,addition:digits=3,test=4-5,s5"` -> `["gsm8k", "addition:digits=3,test=4-5", "s5"]`: a piece
    that is only `KEY=VALUE` continues the knobs of the task spec before it."""
    names: list[str] = []
    for piece in (part.strip() for part in text.split(",")):
        if not piece:
            continue
        if names and "=" in piece and ":" not in piece and "?" not in piece:
            names[-1] += "," + piece
        else:
            names.append(piece)
    return names


def run_generation_tasks(model, tokenizer, names: Sequence[str] | str, data_dir: Path | str | None = None,
                         options: dict | None = None, limit: int | None = None, progress: bool = True) -> dict:
    """Run each named task; returns {name: result}. Names may be comma-separated in one string."""
    if isinstance(names, str):
        names = split_task_names(names)
    functions = {name: resolve_generation_task(name) for name in names}
    data = Path(data_dir) if data_dir is not None else None
    return {name: fn(model, tokenizer, data, dict(options or {}), limit, progress) for name, fn in functions.items()}


__all__ = ["GENERATION_TASKS", "Generation", "baseline_markdown", "eval_chat_gsm8k", "eval_chat_task", "eval_gsm8k",
            "eval_humaneval", "eval_reasoning_task", "format_by_length",
           "eval_simple_arithmetic", "eval_svamp", "extract_number", "generate_texts", "humaneval_program",
           "numbers_match", "pass_at_k", "resolve_generation_task", "run_generation_tasks", "split_task_names"]
