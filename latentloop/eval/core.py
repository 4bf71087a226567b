"""CORE: the in-context-learning score of DCLM (Li et al., 2024), as nanochat computes it.

Twenty-two tasks in three kinds, each scored from the model's log-probabilities:

- multiple choice (`query`, `choices`, `gold`): the prompt is rendered once per choice; the choice
  whose continuation has the lowest *mean* loss per token is the answer. The continuation is what
  follows the longest token prefix the rendered prompts share;
- schema (`context_options`, `continuation`, `gold`; winograd, winogrande): one prompt per context
  option, all ending in the same continuation; the option after which that shared continuation
  (the longest common token suffix) has the lowest mean loss is the answer;
- language modelling (`context`, `continuation`): correct when greedy decoding reproduces the
  continuation exactly, i.e. the argmax at every continuation position is the next true token.

Prompts: `num_fewshot` solved examples, each `<query><delimiter><answer>` followed by a blank line,
then the scored example. The few-shot examples of example i are drawn from the same file with
`random.Random(1234 + i)`, excluding i itself; examples are first shuffled with `Random(1337)`, and
`limit` keeps the first N of that order (the shots are still drawn from the whole file, so a limit
does not change any prompt). Each task's accuracy is centred by its random baseline,
`(acc - rb) / (1 - rb)`, and CORE is the mean centred accuracy over the tasks evaluated. The random
baselines are those of DCLM's `eval_meta_data.csv` (e.g. 62% for boolq, 9.1% for language
identification), so scores compare with published CORE numbers.

Scoring works for every architecture through the engine's `teacher_forced_logits`: each row is
`[left padding][context][continuation][right padding]` with all contexts ending at column P (the
contexts left-padded by the engine's own `left_pad`, as prompts of different lengths are); the
contexts are prefilled into the cache and the continuation decoded teacher-forced, so it is scored
as generated text under the chosen regime (fbt `fused` prefills the context with K passes, then
feeds latents back over the continuation; `soft` feeds latents back over the continuation after a
plain prefill). `mode="full"` scores with the naive uncached `reference` path instead (the same
numbers, tested; far slower where the reference re-runs the stack per continuation token). The
last continuation token is never an input, so a row of context c and continuation k tokens needs
c + k - 1 inputs; a row that needs more than the model's `sequence_len` T is scored on its last T
inputs, as lm-eval cuts (the context loses its oldest tokens, BOS included; see `fit_row`). A
continuation longer than T cannot be scored whole (its score says so: `whole`); a task counts such
an example wrong, however its first T tokens scored, and says how many (`n_too_long`), where
nanochat and lm-eval stop (a small context would end the whole suite at one long answer).
Rows are sorted by length and packed into batches, so a small model scores a few hundred examples
in seconds on a CPU, and a row scores the same in any batch as alone.

Data: a folder of jsonl files (`../shared/data/eval`, or the official bundle's `eval_data/**`),
from an argument, else `$LATENTLOOP_EVAL_DIR`, else `<cache>/eval_bundle`, which
`download_eval_bundle` fills from the official bundle when there is a network.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..data.sources import iter_jsonl
from ..engine import left_pad, model_options, teacher_forced_logits
from ..errors import ConfigError, DataError
from ..runtime import EVAL_DIR_ENV, default_eval_dir
from ..util import evaluating
from .stats import wilson_interval

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
SHUFFLE_SEED = 1337
FEWSHOT_SEED = 1234
DEFAULT_BATCH_SIZE = 64
TRUNCATION_STEP = 16  # batches are planned by continuation length in buckets of this many tokens

MULTIPLE_CHOICE, SCHEMA, LANGUAGE_MODELING = "multiple_choice", "schema", "language_modeling"


@dataclass(frozen=True)
class Task:
    name: str
    files: tuple[str, ...]  # candidate jsonl names, first found wins
    kind: str  # MULTIPLE_CHOICE, SCHEMA or LANGUAGE_MODELING
    num_fewshot: int
    random_baseline: float  # fraction of questions a random guess gets right
    delimiter: str = " "  # between a query/context and its answer


def _task(name, files, kind, shots, baseline, delimiter=" ") -> Task:
    return Task(name, tuple(files) if isinstance(files, (list, tuple)) else (files,), kind, shots, baseline, delimiter)


_ANSWER = "\nAnswer: "
_HELLASWAG = ("hellaswag.jsonl", "hellaswag_val1k.jsonl")

# The 22 tasks of DCLM's CORE, in the order of its core.yaml.
CORE_TASKS: dict[str, Task] = {t.name: t for t in (
    _task("hellaswag_zeroshot", _HELLASWAG, MULTIPLE_CHOICE, 0, 0.25),
    _task("jeopardy", "jeopardy_all.jsonl", LANGUAGE_MODELING, 10, 0.0, _ANSWER),
    _task("bigbench_qa_wikidata", "bigbench_qa_wikidata.jsonl", LANGUAGE_MODELING, 10, 0.0),
    _task("arc_easy", "arc_easy.jsonl", MULTIPLE_CHOICE, 10, 0.25, _ANSWER),
    _task("arc_challenge", "arc_challenge.jsonl", MULTIPLE_CHOICE, 10, 0.25, _ANSWER),
    _task("copa", "copa.jsonl", MULTIPLE_CHOICE, 0, 0.5),
    _task("commonsense_qa", "commonsense_qa.jsonl", MULTIPLE_CHOICE, 10, 0.2),
    _task("piqa", "piqa.jsonl", MULTIPLE_CHOICE, 10, 0.5, _ANSWER),
    _task("openbook_qa", "openbook_qa.jsonl", MULTIPLE_CHOICE, 0, 0.25),
    _task("lambada_openai", "lambada_openai.jsonl", LANGUAGE_MODELING, 0, 0.0),
    _task("hellaswag", _HELLASWAG, MULTIPLE_CHOICE, 10, 0.25),
    _task("winograd", "winograd_wsc.jsonl", SCHEMA, 0, 0.5),
    _task("winogrande", "winogrande.jsonl", SCHEMA, 0, 0.5),
    _task("bigbench_dyck_languages", "bigbench_dyck_languages.jsonl", LANGUAGE_MODELING, 10, 0.0),
    _task("agi_eval_lsat_ar", "agi_eval_lsat_ar.jsonl", MULTIPLE_CHOICE, 3, 0.2),
    _task("bigbench_cs_algorithms", "bigbench_cs_algorithms.jsonl", LANGUAGE_MODELING, 10, 0.0),
    _task("bigbench_operators", "bigbench_operators.jsonl", LANGUAGE_MODELING, 10, 0.0),
    _task("bigbench_repeat_copy_logic", "bigbench_repeat_copy_logic.jsonl", LANGUAGE_MODELING, 10, 0.0),
    _task("squad", "squad.jsonl", LANGUAGE_MODELING, 10, 0.0),
    _task("coqa", "coqa.jsonl", LANGUAGE_MODELING, 0, 0.0),
    _task("boolq", "boolq.jsonl", MULTIPLE_CHOICE, 10, 0.62, _ANSWER),
    _task("bigbench_language_identification", "bigbench_language_identification.jsonl", MULTIPLE_CHOICE, 10, 0.091),
)}


def centered(accuracy: float, random_baseline: float) -> float:
    """Accuracy rescaled so that chance is 0 and perfect is 1: (acc - rb) / (1 - rb)."""
    return (accuracy - random_baseline) / (1.0 - random_baseline)


# --------------------------------------------------------------------------------------------
# Data: where it lives, fetching the official bundle, reading and normalising rows
# --------------------------------------------------------------------------------------------


def locate_eval_dir(data_dir: str | Path | None = None, download: bool = True) -> tuple[Path, str]:
    """The folder of task files and where it came from (for the user: which of the places below
    answered): `data_dir` (--eval-dir), else $LATENTLOOP_EVAL_DIR, else the cache folder (fetched
    there once when `download` and a network allow)."""
    for given, origin in ((data_dir, "--eval-dir"), (os.environ.get(EVAL_DIR_ENV), f"${EVAL_DIR_ENV}")):
        if given:
            folder = Path(given).expanduser()
            if not folder.is_dir():
                raise DataError(f"{origin} {folder} " + ("is a file, not a folder of task files" if folder.exists()
                                                         else "does not exist"))
            return folder, f"from {origin}"
    cached = default_eval_dir()
    if cached.is_dir() and any(cached.rglob("*.jsonl")):
        return cached, f"the bundle fetched earlier into the cache (no --eval-dir, no ${EVAL_DIR_ENV})"
    hint = f"pass --eval-dir PATH or set ${EVAL_DIR_ENV} (e.g. to ../shared/data/eval)"
    if not download:
        raise DataError(f"no evaluation data in {cached}: {hint}")
    try:
        return download_eval_bundle(cached), f"downloaded from {EVAL_BUNDLE_URL} (no --eval-dir, no ${EVAL_DIR_ENV})"
    except DataError as exc:
        raise DataError(f"no evaluation data: {hint}; {exc}") from None


def resolve_eval_dir(data_dir: str | Path | None = None, download: bool = True) -> Path:
    """The folder of task files (`locate_eval_dir` without saying where it came from)."""
    return locate_eval_dir(data_dir, download)[0]


def download_eval_bundle(dest: str | Path | None = None, url: str | None = None, timeout: float = 60.0) -> Path:
    """Fetch the official CORE bundle (a zip of jsonl files, ~20 MB) into `dest` and return it.

    The zip is downloaded and unpacked in a temporary folder next to `dest`, then moved into place,
    so an interrupted download leaves nothing half-written. Raises DataError when offline.
    """
    dest = Path(dest) if dest is not None else default_eval_dir()
    url = url or EVAL_BUNDLE_URL
    try:  # the cache folder itself: a file in its place or a folder we may not write is the user's to fix
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    except OSError as exc:  # mkdir of a file says "File exists": say what is in the way
        reason = "a file is there, not a folder" if dest.parent.is_file() else exc.strerror or exc
        raise DataError(f"cannot fetch the eval bundle into {dest.parent}: {reason}") from None
    try:
        archive = work / "bundle.zip"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(archive, "wb") as f:
                shutil.copyfileobj(response, f)
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise DataError(f"cannot download the eval bundle from {url}: {reason}") from None
        unpacked = work / "unpacked"
        try:
            with zipfile.ZipFile(archive) as zf:
                root = unpacked.resolve()
                for member in zf.namelist():
                    if not (unpacked / member).resolve().is_relative_to(root):
                        raise DataError(f"the eval bundle from {url} holds an unsafe path: {member}")
                zf.extractall(unpacked)
        except zipfile.BadZipFile:
            raise DataError(f"the download from {url} is not a zip file") from None
        entries = [p for p in unpacked.iterdir() if not p.name.startswith("__MACOSX")]
        source = entries[0] if len(entries) == 1 and entries[0].is_dir() else unpacked
        if not any(source.rglob("*.jsonl")):
            raise DataError(f"the eval bundle from {url} holds no jsonl files")
        try:
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(source, dest)
        except OSError as exc:  # a file where the folder goes, say
            raise DataError(f"cannot put the eval bundle in place at {dest}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def find_task_file(folder: Path, task: Task) -> Path | None:
    """The task's jsonl in `folder`, at the top level or anywhere below it (the bundle's layout)."""
    for name in task.files:
        if (folder / name).is_file():
            return folder / name
    for name in task.files:
        found = sorted(folder.rglob(name))
        if found:
            return found[0]
    return None


def _clean_hellaswag(text: str) -> str:
    """HellaSwag's usual cleanup: WikiHow '[title]' markers become sentence breaks, other
    bracketed markers go, double spaces collapse."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _describe(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def _text(row: dict, key: str, *, empty: bool = True) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {_describe(value)}")
    if not empty and not value:
        raise ValueError(f"'{key}' is empty")
    return value


def _texts(row: dict, key: str) -> list[str]:
    """A non-empty list of strings."""
    value = row[key]
    if not isinstance(value, list):
        raise ValueError(f"'{key}' must be a list of strings, got {_describe(value)}")
    if not value:
        raise ValueError(f"'{key}' is an empty list")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise ValueError(f"'{key}'[{index}] must be a string, got {_describe(item)}")
    return value


def _gold(row: dict, key: str, count: int, of: str) -> int:
    """An index into the `count` items of `of`: an integer (or the digits of one, as HellaSwag writes
    its labels) in 0..count-1."""
    value = row[key]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{key}' must be an integer index into '{of}', got {_describe(value)}")
    if not 0 <= value < count:
        raise ValueError(f"'{key}' is {value}, out of range for the {count} item(s) of '{of}'")
    return value


def normalize_row(row: dict, kind: str) -> dict:
    """One jsonl row in the task's canonical form; HellaSwag's original format is converted. A row
    of the wrong shape raises KeyError (the missing keys) or ValueError (what is wrong): every text
    a string, `choices`/`context_options` non-empty lists of strings, `gold` an index into them, a
    language-modelling `continuation` not empty."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {_describe(row)}")
    if kind == MULTIPLE_CHOICE and "endings" in row and "query" not in row:
        missing = [key for key in ("ctx_a", "ctx_b", "activity_label", "label") if key not in row]
        if missing:
            raise KeyError(", ".join(missing))
        endings = _texts(row, "endings")
        context = _text(row, "ctx_a") + " " + _text(row, "ctx_b").capitalize()
        return {"query": _clean_hellaswag(f"{_text(row, 'activity_label')}: {context}"),
                "choices": [_clean_hellaswag(e) for e in endings], "gold": _gold(row, "label", len(endings), "endings")}
    needed = {MULTIPLE_CHOICE: ("query", "choices", "gold"), SCHEMA: ("context_options", "continuation", "gold"),
              LANGUAGE_MODELING: ("context", "continuation")}[kind]
    missing = [key for key in needed if key not in row]
    if missing:
        raise KeyError(", ".join(missing))
    if kind == MULTIPLE_CHOICE:
        choices = _texts(row, "choices")
        return {"query": _text(row, "query"), "choices": choices, "gold": _gold(row, "gold", len(choices), "choices")}
    if kind == SCHEMA:
        options = _texts(row, "context_options")
        return {"context_options": options, "continuation": _text(row, "continuation"),
                "gold": _gold(row, "gold", len(options), "context_options")}
    return {"context": _text(row, "context"), "continuation": _text(row, "continuation", empty=False)}


def load_examples(path: Path, kind: str) -> list[dict]:
    """The rows of a task file, each checked (`normalize_row`): a bad row is a one-line DataError
    naming the file and line."""
    examples = []
    for line_no, row in iter_jsonl(path):  # unreadable files, bad UTF-8 and bad JSON: DataError, file and line
        try:
            examples.append(normalize_row(row, kind))
        except KeyError as exc:
            raise DataError(f"{path}:{line_no}: a {kind} row needs the key(s) {exc.args[0]}") from None
        except (TypeError, ValueError) as exc:
            raise DataError(f"{path}:{line_no}: malformed {kind} row: {exc}") from None
    if not examples:
        raise DataError(f"{path} holds no examples")
    return examples


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def fewshot_indices(n: int, index: int, k: int) -> list[int]:
    """k example indices other than `index`, drawn deterministically for that example."""
    if k <= 0 or n < 2:
        return []
    # the same draw as sampling the list of all other indices (nanochat), without building it
    drawn = random.Random(FEWSHOT_SEED + index).sample(range(n - 1), min(k, n - 1))
    return [j if j < index else j + 1 for j in drawn]


def render_prompts(kind: str, item: dict, delimiter: str, shots: Sequence[dict] = ()) -> list[str]:
    """The full prompts of one example: one per choice (multiple choice), one per context option
    (schema), or [context only, context + continuation] (language modelling)."""
    if kind == MULTIPLE_CHOICE:
        prefix = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{prefix}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if kind == SCHEMA:
        prefix = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n" for s in shots)
        return [f"{prefix}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    if kind == LANGUAGE_MODELING:
        prefix = "".join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
        context = f"{prefix}{item['context'].strip()}{delimiter}"
        # the context alone is stripped, so its trailing space goes with the continuation's first token
        return [context.strip(), context + item["continuation"]]
    raise ConfigError(f"unknown task type {kind!r}")


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        if any(s[i] != sequences[0][i] for s in sequences):
            return i
    return shortest


def common_suffix_length(sequences: Sequence[Sequence[int]]) -> int:
    return common_prefix_length([list(reversed(s)) for s in sequences])


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    """The texts as prompts (`tokenizer.as_prompt`: BOS first where the tokenizer starts texts with it)."""
    encoded = tokenizer.encode_batch(texts) if hasattr(tokenizer, "encode_batch") else [tokenizer.encode(t)
                                                                                         for t in texts]
    return [tokenizer.as_prompt(ids) for ids in encoded]


def split_requests(kind: str, tokens: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) token lists from the tokenized prompts of one example (each as
    `_encode_all` gives it). Every continuation keeps at least one token and every context at least
    its first (BOS, where the tokenizer starts texts with it)."""
    if kind == MULTIPLE_CHOICE:
        start = max(1, min(common_prefix_length(tokens), min(len(t) for t in tokens) - 1))
        return [(t[:start], t[start:]) for t in tokens]
    if kind == SCHEMA:
        shared = max(1, min(common_suffix_length(tokens), min(len(t) for t in tokens) - 1))
        return [(t[:-shared], t[-shared:]) for t in tokens]
    without, with_continuation = tokens
    if with_continuation[:len(without)] == without:
        start = len(without)
    else:  # the tokenizer merged across the boundary: score from where the two first differ
        start = common_prefix_length([without, with_continuation])
    start = max(1, min(start, len(with_continuation) - 1))
    return [(with_continuation[:start], with_continuation[start:])]


# --------------------------------------------------------------------------------------------
# Batched scoring of continuations, for every architecture
# --------------------------------------------------------------------------------------------


@dataclass
class ContinuationScore:
    logprob: float  # summed log-probability of the continuation tokens (nats)
    tokens: int  # continuation tokens scored
    greedy: bool  # greedy decoding would reproduce the continuation exactly
    whole: bool = True  # False: the continuation was longer than the model's context, its first tokens scored

    @property
    def mean_loss(self) -> float:
        return -self.logprob / self.tokens


def _bucket(length: int) -> int:
    return -(-length // TRUNCATION_STEP) * TRUNCATION_STEP


def fit_row(context: list[int], continuation: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """Cut a (context, continuation) pair whose row needs more than max_len inputs (the last
    continuation token is only a target: a row needs len(context) + len(continuation) - 1 inputs).

    The row keeps its last max_len inputs: the context loses its oldest tokens (BOS included, as
    lm-eval and nanochat cut), so the scores are those of one forward over the last max_len inputs.
    A continuation longer than max_len keeps its first max_len tokens, after the context's last token.
    """
    if len(context) + len(continuation) - 1 <= max_len:
        return context, continuation
    continuation = continuation[:max_len]
    return context[len(context) - (max_len + 1 - len(continuation)):], continuation


MAX_OPEN_BATCHES = 64


def plan_batches(rows: Sequence[tuple[list[int], list[int]]], batch_size: int, max_len: int,
                 max_tokens: int) -> list[list[int]]:
    """Row indices grouped into batches, first fit: rows in order of continuation length bucket,
    then context length (longest first), each into the first open batch where it fits. A batch
    fits a row when it holds fewer than batch_size rows, its aligned width (longest context +
    longest continuation - 1: the inputs it needs) stays within max_len, and rows x width within
    max_tokens."""
    order = sorted(range(len(rows)), key=lambda i: (-_bucket(len(rows[i][1])), -len(rows[i][0]), i))
    closed: list[list[int]] = []
    open_batches: list[tuple[list[int], int, int]] = []  # (rows, longest context, longest continuation)
    for i in order:
        p, c = len(rows[i][0]), len(rows[i][1])
        for n, (batch, P, C) in enumerate(open_batches):
            width = max(P, p) + max(C, c) - 1
            if width <= max_len and (len(batch) + 1) * width <= max_tokens:
                batch.append(i)
                if len(batch) >= batch_size:
                    closed.append(open_batches.pop(n)[0])
                else:
                    open_batches[n] = (batch, max(P, p), max(C, c))
                break
        else:
            if batch_size == 1:
                closed.append([i])
                continue
            open_batches.append(([i], p, c))
            if len(open_batches) > MAX_OPEN_BATCHES:
                closed.append(open_batches.pop(0)[0])
    return closed + [batch for batch, _, _ in open_batches]


SCORING_MODES = ("auto", "full", "stepwise")  # auto = stepwise: the cached path


def continuation_logits(model: nn.Module, idx: torch.Tensor, pad_mask: torch.Tensor | None, P: int, C: int,
                        options: dict, stepwise: bool = True, share_prompts: bool = True) -> torch.Tensor:
    """Logits (B, C, V) predicting idx[:, P:P+C] after the contexts that end at column P. Only the
    first P + C - 1 columns are run: the last continuation token is a target, never an input.

    stepwise: the engine's own path: a cached prefill of the contexts, then the continuation
    decoded teacher-forced. full: the naive uncached `reference` over the whole rows, the first P
    columns being the prompt. Both give the same numbers. `share_prompts` (stepwise): rows that
    repeat a context (a question's choices) prefill it once (`teacher_forced_logits`).
    """
    idx = idx[:, :P + C - 1]
    pad_mask = None if pad_mask is None else pad_mask[:, :P + C - 1]
    if stepwise:
        logits = teacher_forced_logits(model, idx, pad_mask, prompt_len=P, share_prompts=share_prompts, **options)
    else:
        logits = model.reference(idx, pad_mask, P, **model_options(model, options, cached=False)).logits
    return logits[:, P - 1:P + C - 1]


def _score_batch(model: nn.Module, rows: list[tuple[list[int], list[int]]], options: dict, pad_id: int,
                 device: torch.device, stepwise: bool, share_prompts: bool = True) -> list[ContinuationScore]:
    contexts, mask = left_pad([ctx for ctx, _ in rows], pad_id, device)  # the engine's padding: (B, P)
    P = contexts.shape[1]
    C = max(len(cont) for _, cont in rows)
    lengths = torch.tensor([len(cont) for _, cont in rows], device=device)
    # continuations right-padded after column P: a row's padding comes after its last scored token,
    # so it changes nothing the row sees
    continuations = torch.full((len(rows), C), pad_id, dtype=torch.long, device=device)
    for r, (_, cont) in enumerate(rows):
        continuations[r, :len(cont)] = torch.tensor(cont, dtype=torch.long)
    idx = torch.cat([contexts, continuations], dim=1)  # (B, P + C)
    if mask is not None:
        mask = torch.cat([mask, torch.ones_like(continuations, dtype=torch.bool)], dim=1)
    logits = continuation_logits(model, idx, mask, P, C, options, stepwise, share_prompts).float()  # (B, C, V)
    logprobs = logits.log_softmax(dim=-1).gather(-1, continuations[..., None]).squeeze(-1)  # (B, C)
    valid = torch.arange(C, device=device)[None, :] < lengths[:, None]
    sums = torch.where(valid, logprobs, torch.zeros_like(logprobs)).sum(dim=1)
    greedy = ((logits.argmax(dim=-1) == continuations) | ~valid).all(dim=1)
    return [ContinuationScore(float(s), int(n), bool(g)) for s, n, g in zip(sums.tolist(), lengths.tolist(),
                                                                            greedy.tolist())]


def _clean_options(options: dict | None) -> dict:
    return {k: v for k, v in (options or {}).items() if v is not None}


@torch.no_grad()
def score_continuations(model: nn.Module, rows: Sequence[tuple[Sequence[int], Sequence[int]]],
                        options: dict | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
                        max_tokens: int | None = None, on_batch: Callable[[int], None] | None = None,
                        mode: str = "auto", share_prompts: bool = True) -> list[ContinuationScore]:
    """Log-probability and greedy match of each continuation after its context (both token id
    lists; the context should start with BOS). A row that needs more inputs than the model's
    sequence_len is cut to its last sequence_len inputs by `fit_row`.
    `on_batch(n)` is called after each batch of n rows (progress bars); `mode` picks how the
    continuation is run (`continuation_logits`; auto: stepwise); `share_prompts`: rows of a batch that
    repeat a context prefill it once (the same scores to float rounding; False: every row prefilled)."""
    options = _clean_options(options)
    model_options(model, options, cached=mode != "full")
    if mode not in SCORING_MODES:
        raise ConfigError(f"scoring mode must be one of {', '.join(SCORING_MODES)}, got {mode!r}")
    stepwise = mode != "full"
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    config = model.config
    max_len = config.sequence_len
    if max_tokens is None:  # bound the (rows x width x vocab) fp32 logits to ~0.5 GB (a longer row runs alone)
        max_tokens = min(1 << 16, (1 << 27) // max(config.vocab_size, 1))
    fitted = []
    for ctx, cont in rows:
        ctx, cont = list(ctx), list(cont)
        if not ctx or not cont:
            raise ValueError("every row needs a context and a continuation of at least one token")
        fitted.append(fit_row(ctx, cont, max_len))
    device = next(model.parameters()).device
    scores: list[ContinuationScore | None] = [None] * len(fitted)
    with evaluating(model):
        for batch in plan_batches(fitted, batch_size, max_len, max_tokens):
            for i, score in zip(batch, _score_batch(model, [fitted[i] for i in batch], options, config.bos_id,
                                                     device, stepwise, share_prompts)):
                score.whole = score.tokens == len(rows[i][1])
                scores[i] = score
            if on_batch is not None:
                on_batch(len(batch))
    return scores  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Tasks and the CORE score
# --------------------------------------------------------------------------------------------


def build_task_requests(task: Task, examples: Sequence[dict], tokenizer, limit: int | None = None
                        ) -> tuple[list[tuple[list[int], list[int]]], list[tuple[int, int, int | None]]]:
    """Rows for the first `limit` examples (in the shuffled order) and, per example, the slice
    (start, end) of its rows and its gold index (None for language modelling)."""
    n = len(examples) if limit is None else min(limit, len(examples))
    prompts, counts, golds = [], [], []
    for i in range(n):
        shots = [examples[j] for j in fewshot_indices(len(examples), i, task.num_fewshot)]
        rendered = render_prompts(task.kind, examples[i], task.delimiter, shots)
        prompts.extend(rendered)
        counts.append(len(rendered))
        golds.append(examples[i].get("gold"))
    tokens = _encode_all(tokenizer, prompts)
    rows, groups, start = [], [], 0
    for count, gold in zip(counts, golds):
        pairs = split_requests(task.kind, tokens[start:start + count])
        groups.append((len(rows), len(rows) + len(pairs), gold))
        rows.extend(pairs)
        start += count
    return rows, groups


def finite(scores: Sequence[ContinuationScore]) -> bool:
    """Whether every row of an example has a finite loss (not a model whose logits overflowed)."""
    return all(math.isfinite(s.mean_loss) for s in scores)


def judge(kind: str, scores: Sequence[ContinuationScore], gold: int | None) -> bool:
    """Whether one example is answered correctly, from the scores of its rows. A row whose loss is
    not finite makes it wrong (`finite`): `min` over NaNs picked the first choice, so such a model
    scored the share of items whose answer is choice 0."""
    if not finite(scores):
        return False
    if kind == LANGUAGE_MODELING:
        return all(s.greedy for s in scores)
    losses = [s.mean_loss for s in scores]
    return losses.index(min(losses)) == gold


def shuffled(examples: Sequence[dict]) -> list[dict]:
    order = list(examples)
    random.Random(SHUFFLE_SEED).shuffle(order)
    return order


def evaluate_task(model: nn.Module, tokenizer, task: Task, examples: Sequence[dict], options: dict | None = None,
                  limit: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True) -> dict:
    """Accuracy and centred accuracy of one task; `examples` in file order."""
    start = time.perf_counter()
    data = shuffled(examples)
    rows, groups = build_task_requests(task, data, tokenizer, limit)
    bar = tqdm(total=len(rows), desc=task.name, unit="row", disable=not progress, dynamic_ncols=True)
    try:
        scores = score_continuations(model, rows, options, batch_size, on_batch=bar.update)
    finally:
        bar.close()
    # an example with a continuation longer than the context was scored on part of it: counted wrong
    whole = [all(score.whole for score in scores[a:b]) for a, b, _ in groups]
    too_long = whole.count(False)
    correct = [fits and judge(task.kind, scores[a:b], gold) for fits, (a, b, gold) in zip(whole, groups)]
    not_finite = sum(not finite(scores[a:b]) for a, b, _ in groups)
    accuracy = sum(correct) / len(correct)
    result = {"task": task.name, "type": task.kind, "num_fewshot": task.num_fewshot,
              "random_baseline": task.random_baseline, "accuracy": accuracy,
              "accuracy_ci": list(wilson_interval(sum(correct), len(correct))),
              "centered": centered(accuracy, task.random_baseline), "n": len(correct), "n_available": len(data),
              "n_too_long": too_long, "rows": len(rows), "seconds": time.perf_counter() - start}
    notes = []
    if too_long:
        notes.append(f"{too_long} of {len(groups)} examples counted wrong: a continuation longer than the "
                     f"model's context ({model.config.sequence_len} tokens) cannot be scored whole")
    if not_finite:
        result["n_not_finite"] = not_finite
        notes.append(f"{not_finite} of {len(groups)} examples counted wrong: the model's loss on them is not finite "
                     f"(NaN or inf logits)")
    if notes:
        result["note"] = "; ".join(notes)
    return result


def resolve_task_names(tasks: str | Sequence[str]) -> list[str]:
    """'core' (or a list / comma-separated string of CORE task names, 'core' expanding to all)."""
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else [str(t).strip() for t in tasks]
    resolved: list[str] = []
    for name in filter(None, names):
        for expanded in (CORE_TASKS if name == "core" else [name]):
            if expanded not in CORE_TASKS:
                raise ConfigError(f"unknown CORE task {expanded!r}: choose from core, {', '.join(CORE_TASKS)}")
            if expanded not in resolved:
                resolved.append(expanded)
    if not resolved:
        raise ConfigError("no task given")
    return resolved


def run_core(model: nn.Module, tokenizer, tasks: str | Sequence[str] = "core", data_dir: str | Path | None = None,
             options: dict | None = None, limit: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
             progress: bool = True, on_task: Callable[[str, dict], None] | None = None) -> dict[str, Any]:
    """Evaluate CORE tasks; returns per-task results, the CORE mean and the tasks whose files are
    missing (reported, not scored as zero). `on_task(name, result)` is called as each task ends."""
    names = resolve_task_names(tasks)
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    options = _clean_options(options)
    model_options(model, options)
    folder, origin = locate_eval_dir(data_dir)
    if progress:
        print(f"CORE data: {folder} ({origin})", file=sys.stderr)
    start = time.perf_counter()
    results: dict[str, dict] = {}
    missing: list[str] = []
    loaded: dict[Path, list[dict]] = {}
    for name in names:
        task = CORE_TASKS[name]
        path = find_task_file(folder, task)
        if path is None:
            missing.append(name)
            continue
        if path not in loaded:
            loaded[path] = load_examples(path, task.kind)
        result = evaluate_task(model, tokenizer, task, loaded[path], options, limit, batch_size, progress)
        result["file"] = str(path)
        results[name] = result
        if on_task is not None:
            on_task(name, result)
    if not results:
        raise DataError(f"none of the task files ({', '.join(missing)}) is in {folder}")
    core = sum(r["centered"] for r in results.values()) / len(results)
    return {"core": core, "tasks": results, "evaluated": len(results), "missing": missing,
            "requested": names, "data_dir": str(folder), "data_source": origin, "options": options, "limit": limit,
            "seconds": time.perf_counter() - start}


TASK_HEADER = f"{'task':<34} {'n':>5} {'acc':>7} {'95% Wilson':>15} {'centred':>8} {'sec':>7}"


def task_row(name: str, r: dict) -> str:
    """One task's line under TASK_HEADER (CORE's tasks and the generation tasks alike): n, accuracy
    with its Wilson interval, centred accuracy where the task has a random baseline, seconds."""
    accuracy, centred, interval = r.get("accuracy"), r.get("centered"), r.get("accuracy_ci")
    accuracy_text = f"{accuracy:>7.4f}" if isinstance(accuracy, (int, float)) else f"{'?':>7}"
    interval_text = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
    centred_text = f"{centred:>8.4f}" if isinstance(centred, (int, float)) else f"{'':>8}"
    return (f"{name:<34} {r.get('n', ''):>5} {accuracy_text} {interval_text:>15} {centred_text} "
            f"{r.get('seconds', 0.0):>7.1f}")


def task_lines(name: str, r: dict) -> list[str]:
    """A task's row under TASK_HEADER and, below it, its note (examples left out) if it has one."""
    return [task_row(name, r)] + ([f"  note: {r['note']}"] if r.get("note") else [])


def format_results(result: dict) -> str:
    """A plain-text table of a `run_core` result."""
    lines = [TASK_HEADER] + [line for name, r in result["tasks"].items() for line in task_lines(name, r)]
    for name in result.get("missing", []):
        lines.append(f"{name:<34} {'missing':>5}")
    core = result["core"]
    lines.append(f"{'CORE':<34} {'':>5} {'':>7} {'':>15} {core:>8.4f} {result['seconds']:>7.1f}"
                 + (f"   ({result['evaluated']} tasks)" if not math.isnan(core) else ""))
    return "\n".join(lines)


__all__ = ["CORE_TASKS", "ContinuationScore", "EVAL_BUNDLE_URL", "EVAL_DIR_ENV", "Task", "centered",
           "download_eval_bundle", "evaluate_task", "find_task_file", "format_results", "load_examples",
           "locate_eval_dir", "render_prompts", "resolve_eval_dir", "resolve_task_names", "run_core",
           "score_continuations"]
