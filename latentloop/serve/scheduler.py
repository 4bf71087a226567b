"""The batching schedulers: one thread owns the model and decodes the waiting requests together.
`--batching continuous` (the default) or `rounds` picks one; both hand the same events to the
request handlers, and every request gets what the engine gives it alone.

Continuous (`ContinuousScheduler`, iteration-level scheduling as vLLM and TGI do). Requests join a
running batch at its next decode step and leave it when done (`serve/batch.py`: the joining rows
are prefilled together, then their cache rows and the running ones are regrouped into one cache,
rows at different positions side by side). One batch per set of architecture options (every row
of a batch runs the same forward); sampling settings and seeds are per request inside a batch,
each request drawing from its own generator, so they do not split batches. Options that couple the
rows of a prefill (fbt's `passes="auto"`, `DecodeOption.couples_rows`) prefill each request alone.
At most `max_rows` rows decode at once over all batches; more requests wait in the queue, first
come first served. An idle scheduler waits `batch_window` after the first request, so that a burst
starts as one batch; a busy one takes new requests at every step.

Rounds (`RoundScheduler`, the scheduler before continuous batching). The thread waits for a
request, lets `batch_window` pass so that concurrent requests arrive, then takes the requests
waiting at that moment (first come first served, up to `max_rows` rows in all) and runs them as one
round:

1. prompts that are echoed get their logprobs from `teacher_forced_logits`;
2. the rows are grouped by what must be equal within one engine call: the architecture's
   options, and for sampled rows the sampling settings. A greedy row decodes the same in any
   batch (the engine left-pads rows and each decodes exactly as it would alone), so greedy rows
   of all requests share a group. Sampled rows draw from one random generator per engine call, so
   a request with a `seed` is its own group (reproducible: the same request gives the same text);
   unseeded sampled rows with equal settings share one. Options that couple the rows of a batch
   (fbt's `passes="auto"`, declared by `DecodeOption.couples_rows`) put each request alone;
3. each group is packed into batches whose longest prompt + longest max_tokens fits the context;
   one `engine.stream` per batch, and the batches of the round step in turn, one token each, so
   every request of the round streams from the start.

A row leaves its batch when it is done (its max_tokens, a stop token, a stop string) or its
client went away or timed out; the batch goes on with the other rows and is closed (the generator
left) once no row is left. Requests that arrive while a round runs wait for the next round: rows
never join a batch already decoding (its cache was allocated for its rows).
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import model_options, row_info, stream, teacher_forced_logits, written_rows
from ..errors import ConfigError
from ..inference.fast import about_seconds
from ..util import first_line
from .batch import (
    AUTO_START_BUDGET_S,
    DecodeBatch,
    Member,
    Sampling,
    SlotBatch,
    cached_start_seconds,
    compiles,
    couples_rows,
    why_not_compiled,
)
from .protocol import APIError, CompletionRequest, decode_with_offsets, special_names, token_string
from .settings import BATCHING
from .text import RowText, TokenEntry, top_dict

IDLE_POLL_S = 0.1  # how often an idle scheduler looks for shutdown


# --------------------------------------------------------------------------------------------
# Events posted to a request's handler
# --------------------------------------------------------------------------------------------


def token_facts(info: dict) -> dict:
    """What the model reported for one row's token that a client can shade it by: the numbers of its
    row's info (fbt's passes, rgpt's exit depth, mor's depth), not flags or names."""
    return {name: value for name, value in info.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value}


@dataclass
class Delta:
    """New text of one choice; `finish_reason` set on its last delta."""

    choice: int
    text: str
    tokens: list[TokenEntry]
    finish_reason: str | None = None
    info: dict | None = None  # with the last delta: what the regime did for this row (DecodeStep.info)


@dataclass
class Done:
    prompt_tokens: int
    completion_tokens: int
    batch_rows: int  # the most rows decoded together with this request's rows


@dataclass
class Failed:
    error: APIError


# --------------------------------------------------------------------------------------------
# Jobs and rows
# --------------------------------------------------------------------------------------------


_job_ids = itertools.count(1)


@dataclass(eq=False)
class Row:
    job: Job
    choice: int
    prompt: list[int]  # as the model reads it
    text: RowText
    written: list[bool] | None = None  # per prompt token: the model wrote it (`CompletionRequest.written`)
    generated: int = 0
    done: bool = False
    info: dict = field(default_factory=dict)


class Job:
    """One completions request in the scheduler; `post` hands events to its handler (thread-safe)."""

    def __init__(self, request: CompletionRequest, post: Callable[[Any], None], tokenizer):
        self.id = next(_job_ids)
        self.request = request
        self.post = post
        self.cancelled = threading.Event()  # the client went away or timed out: drop the rows
        self.finished = False
        self.batch_rows = 0
        self.completion_tokens = 0
        specials = special_names(tokenizer)
        self.echo_texts = [decode_with_offsets(tokenizer, self.echoed(i))[0] if request.echo else ""
                           for i in range(len(request.prompts))]
        self.rows = [Row(self, p * request.n + j, prompt,
                         RowText(tokenizer, specials, request.stop, len(self.echo_texts[p]), request.reply),
                         request.written[p] if request.written else None)
                     for p, prompt in enumerate(request.prompts) for j in range(request.n)]

    def echoed(self, prompt_index: int) -> list[int]:
        """The prompt as the client sent it (without a BOS the server added)."""
        prompt = self.request.prompts[prompt_index]
        return prompt[1:] if self.request.added_bos[prompt_index] else prompt

    def cancel(self) -> None:
        self.cancelled.set()

    def fail(self, error: APIError) -> None:
        if not self.finished:
            self.finished = True
            for row in self.rows:
                row.done = True
            self.post(Failed(error))


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


@dataclass
class Stats:
    requests: int = 0  # accepted into the queue
    completed: int = 0
    failed: int = 0  # ended with an error (shutdown, internal error)
    cancelled: int = 0  # the client disconnected or timed out before the end
    rejected_queue_full: int = 0
    rounds: int = 0  # rounds (--batching rounds); regroupings of a batch's cache (continuous)
    batches: int = 0  # engine calls (rounds); batches started from empty (continuous)
    rows_decoded: int = 0  # rows started in a batch
    rows_freed: int = 0  # rows dropped from a running batch because their client went away
    rows_joined_running: int = 0  # rows that joined a batch already decoding (continuous)
    max_batch_rows: int = 0  # the most rows one engine call decoded together
    last_round_rows: int = 0
    last_batch_rows: list[int] = field(default_factory=list)  # rows of each batch of the last round
    steps: int = 0  # decode steps over all batches
    row_steps: int = 0  # rows decoded summed over the steps (row_steps / steps: rows per step)
    tokens: int = 0  # generated tokens handed to clients' rows


# --------------------------------------------------------------------------------------------
# The scheduler
# --------------------------------------------------------------------------------------------


class Scheduler:
    """What both schedulers share: the queue and its limits, shutdown, statistics, echo, and
    handing a row's text to its handler. A subclass decodes (`_loop`)."""

    def __init__(self, model, tokenizer, max_rows: int, max_queue: int, batch_window: float):
        self.model, self.tokenizer = model, tokenizer
        self.max_rows, self.max_queue, self.batch_window = max_rows, max_queue, batch_window
        self.context = int(model.config.sequence_len)
        # as `latentloop generate`; a chat model also ends its turn with <|end|>
        chat = getattr(tokenizer, "chat_tokens", None)
        self.stop_tokens = (*tokenizer.stop_ids, tokenizer.bos_id) + ((chat.end,) if chat is not None else ())
        self.specials = special_names(tokenizer)
        self.stats = Stats()
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition(threading.RLock())
        self._stopping = threading.Event()
        self._active_rows = 0
        self._thread = threading.Thread(target=self._run, name="latentloop-scheduler", daemon=True)
        self._warming = False  # `warm` asked: the thread compiles its steps before it takes requests
        self._warmed_event = threading.Event()
        self._warm_error: BaseException | None = None

    # -- the handlers' side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the decoding thread (once: `warm` may have started it)."""
        if self._thread.ident is None:
            self._thread.start()

    def _run(self) -> None:
        if self._warming:
            try:
                self._warm_steps()
            except BaseException as exc:  # noqa: BLE001 - handed to `warm`, which raises it where it was called
                self._warm_error = exc
                return
            finally:
                self._warmed_event.set()
        self._loop()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise APIError 429 (queue full) / 503 (shutting down)."""
        with self._cond:  # checked under the lock that `_fail_pending` takes: no job is queued after it
            if self._stopping.is_set():
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            waiting = sum(1 for j in self._pending if not j.cancelled.is_set())
            if waiting >= self.max_queue:
                self.stats.rejected_queue_full += 1
                raise APIError(429, f"the queue is full ({self.max_queue} requests wait already, --max-queue); "
                                    f"retry later", type="rate_limit_error", code="queue_full")
            self._pending.append(job)
            self.stats.requests += 1
            self._cond.notify()

    def warm(self) -> None:
        """Before serving: start the decoding thread, which compiles what it will run before it takes
        any request (`_warm_steps`), and wait until it has; its error is raised here. On the thread
        that decodes because CUDA graph trees are per thread (`torch._inductor.cudagraph_trees`: a
        thread-local tree manager): graphs captured on the caller's thread would be captured again,
        in a second memory pool, at the first request."""
        if self._thread.ident is not None:  # its loop runs already: it would never look at `_warming`
            raise RuntimeError("warm() must come before start(): the decoding thread warms before its loop")
        self._warming = True
        self.start()
        self._warmed_event.wait()
        if self._warm_error is not None:
            raise self._warm_error

    def _warm_steps(self) -> None:
        """Compile what the scheduler will run (nothing, unless a subclass says), on its thread."""

    def stop(self) -> None:
        """Ask the thread to end every request with an error and exit (safe from a signal handler:
        it only sets a flag, which the thread reads at its next step)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """Whether `stop` was called: handlers waiting for other work give up with 503 too."""
        return self._stopping.is_set()

    def join(self, timeout: float) -> None:
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def snapshot(self) -> dict:
        with self._cond:
            queued = sum(1 for j in self._pending if not j.cancelled.is_set())
        stats = dict(vars(self.stats))
        stats["last_batch_rows"] = list(self.stats.last_batch_rows)
        return {**stats, "queued": queued, "active_rows": self._active_rows, "max_batch_size": self.max_rows,
                "max_queue": self.max_queue, "batch_window_s": self.batch_window}

    # -- taking work ----------------------------------------------------------------------------
    def _wait_for_work(self, room: int) -> bool:
        """Wait for a job, then let `batch_window` pass so that concurrent requests arrive (ended
        early once `room` rows wait). False when stopping."""
        with self._cond:
            while not self._pending and not self._stopping.is_set():
                self._cond.wait(IDLE_POLL_S)
        if self._stopping.is_set():
            return False
        if self.batch_window > 0:  # let concurrent requests arrive; end early once a batch is full
            deadline = time.monotonic() + self.batch_window
            with self._cond:
                while (left := deadline - time.monotonic()) > 0 and not self._stopping.is_set() \
                        and sum(len(j.rows) for j in self._pending) < room:
                    self._cond.wait(left)
        return True

    def _take_jobs(self, room: int, at_least_one: bool = True) -> list[Job]:
        """Waiting jobs, first come first served, while their rows fit `room` (the first one
        always, with `at_least_one`: a request of more rows than room still runs)."""
        jobs, rows = [], 0
        with self._cond:
            while self._pending:
                job = self._pending[0]
                if job.cancelled.is_set():
                    self._pending.popleft()
                    self.stats.cancelled += 1
                    continue
                if rows + len(job.rows) > room and (jobs or not at_least_one):
                    break
                jobs.append(self._pending.popleft())
                rows += len(job.rows)
        return jobs

    # -- rows -----------------------------------------------------------------------------------
    def _gone(self, row: Row) -> bool:
        """Whether a live row's client went away (or its job ended otherwise): the row is freed."""
        if not row.done and (row.job.cancelled.is_set() or row.job.finished):
            row.done = True
            self.stats.rows_freed += 1
            self._active_rows -= 1
            return True
        return False

    def _hand_token(self, row: Row, token: int | None, logprob: float | None, top: list | None,
                    info: dict) -> None:
        """A row's new token (None: the engine stopped it on a stop token) to its text and handler."""
        if token is None:  # the stop token the engine sampled counts as generated, as a stop handled here does
            row.generated += 1
            self._finish_row(row, "stop")
            return
        row.info = info
        row.generated += 1
        self.stats.tokens += 1
        stopped = row.text.add(token, logprob, top[:row.job.request.logprobs] if row.job.request.logprobs else None,
                               token_facts(info))
        if stopped:
            self._finish_row(row, "stop")
        elif row.generated >= row.job.request.max_tokens:
            self._finish_row(row, "length")
        else:
            text, tokens = row.text.release()
            if text or tokens:
                row.job.post(Delta(row.choice, text, tokens))

    def _fail_pending(self) -> None:
        with self._cond:
            jobs, self._pending = list(self._pending), collections.deque()
        for job in jobs:
            job.fail(APIError(503, "the server is shutting down", type="server_error", code="shutting_down"))
            self.stats.failed += 1

    def _fail_internal(self, jobs: list[Job], exc: Exception) -> None:
        for job in jobs:
            if not job.finished:
                self.stats.failed += 1
                job.fail(APIError(500, f"internal error: {type(exc).__name__}: {first_line(exc)}", type="server_error"))

    def _finish_row(self, row: Row, reason: str) -> None:
        job = row.job
        if row.done:
            return
        row.done = True
        if job.request.max_tokens > 0:
            self._active_rows -= 1
        text, tokens = row.text.release(final=True)
        job.completion_tokens += row.generated
        job.post(Delta(row.choice, text, tokens, reason, row.info))
        if all(r.done for r in job.rows) and not job.finished:
            job.finished = True
            self.stats.completed += 1
            job.post(Done(sum(len(p) for p in job.request.prompts), job.completion_tokens, job.batch_rows))

    # -- echo ---------------------------------------------------------------------------------
    def _echo(self, job: Job) -> None:
        """Each echoed prompt's text and, with logprobs, each prompt token's log-probability given
        the tokens before it (None for a first token that has none), from the architecture's
        scoring path (`teacher_forced_logits`)."""
        request = job.request
        k = request.logprobs
        for p, prompt in enumerate(request.prompts):
            entries: list[TokenEntry] = []
            echoed = job.echoed(p)
            text, offsets = decode_with_offsets(self.tokenizer, echoed)
            if k is not None:
                first = len(prompt) - len(echoed)  # 1 when the server added BOS
                logp = self._prompt_logprobs(prompt, request.options)  # (T, V)
                chosen = logp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1).tolist()
                top_values, top_ids = logp[:-1].topk(k, dim=-1) if k else (None, None)
                for j in range(first, len(prompt)):
                    token = token_string(self.tokenizer, prompt[j], self.specials)
                    if j == 0:
                        entries.append(TokenEntry(token, None, None, offsets[j - first]))
                        continue
                    top = None
                    if k:
                        top = top_dict(self.tokenizer, self.specials,
                                       list(zip(top_ids[j - 1].tolist(), top_values[j - 1].tolist())))
                    entries.append(TokenEntry(token, chosen[j - 1], top, offsets[j - first]))
            for j in range(request.n):
                job.post(Delta(p * request.n + j, text, entries))

    def _prompt_logprobs(self, prompt: list[int], options: dict) -> torch.Tensor:
        """Log-probabilities (T, V) of the next token after every prompt position."""
        idx = torch.tensor([prompt], device=next(self.model.parameters()).device)
        with torch.inference_mode():
            logits = teacher_forced_logits(self.model, idx, **options)
        return logits[0].float().log_softmax(dim=-1).cpu()


class RoundScheduler(Scheduler):
    """Rounds: see the module docstring."""

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                jobs = self._take_round()
                if jobs:
                    self._run_round(jobs)
        finally:
            self._fail_pending()

    def _take_round(self) -> list[Job]:
        """The jobs waiting once the batch window has passed, first come first served, up to
        max_rows rows (at least one job)."""
        if not self._wait_for_work(self.max_rows):
            return []
        return self._take_jobs(self.max_rows)

    def _run_round(self, jobs: list[Job]) -> None:
        self.stats.rounds += 1
        self.stats.last_round_rows = sum(len(job.rows) for job in jobs)
        runs: list[_BatchRun] = []
        try:
            for job in jobs:
                if job.request.echo:
                    self._echo(job)
            live = []
            for job in jobs:
                for row in job.rows:
                    if job.request.max_tokens == 0:
                        self._finish_row(row, "length")
                    else:
                        live.append(row)
            for batch in self._plan(live):
                try:
                    runs.append(self._start_batch(batch))
                except Exception as exc:  # noqa: BLE001 - a bug must not take the server down
                    self._fail_internal([row.job for row in batch], exc)
            self.stats.last_batch_rows = [len(run.rows) for run in runs]
            while runs:
                if self._stopping.is_set():
                    break
                for run in list(runs):
                    try:
                        alive = self._step(run)
                    except Exception as exc:  # noqa: BLE001 - only this batch's requests fail
                        self._fail_internal([row.job for row in run.rows], exc)
                        alive = False
                    if not alive:
                        run.close()
                        runs.remove(run)
        except Exception as exc:  # noqa: BLE001 - a bug must not take the server down: the round's requests fail
            self._fail_internal(jobs, exc)
        finally:
            for run in runs:
                run.close()
            self._active_rows = 0
            if self._stopping.is_set():
                for job in jobs:
                    if not job.finished:
                        job.fail(APIError(503, "the server is shutting down: the request was stopped",
                                          type="server_error", code="shutting_down"))
                        self.stats.failed += 1
            for job in jobs:
                if not job.finished and job.cancelled.is_set():
                    job.finished = True
                    self.stats.cancelled += 1

    # -- grouping and batches -----------------------------------------------------------------
    def _group_key(self, job: Job) -> tuple:
        """What a batch's rows share: options, how they sample, and their stop tokens (none with
        `ignore_eos`): (options, (kind, ...), ignore_eos)."""
        return (*self._sampling_key(job), job.request.ignore_eos)

    def _sampling_key(self, job: Job) -> tuple:
        request = job.request
        options = tuple(sorted(request.resolved.items()))  # {} and {"regime": "soft"} decode alike
        if any(option.couples_rows is not None and option.couples_rows(request.resolved.get(option.name))
               for option in self.model.OPTIONS):
            return options, ("alone", job.id)
        if request.greedy:
            return options, ("greedy",)
        if request.seed is not None:
            return options, ("seeded", job.id)
        return options, ("sampled", request.temperature, request.top_k, request.top_p)

    def _plan(self, rows: list[Row]) -> list[list[Row]]:
        """Rows grouped by key, each group packed first fit (longest prompt first, except one
        request's own group, in its order) into batches of at most max_rows rows whose longest
        prompt + longest max_tokens fits the context."""
        groups: dict[tuple, list[Row]] = {}
        for row in rows:
            groups.setdefault(self._group_key(row.job), []).append(row)
        batches: list[list[Row]] = []
        for key, group in groups.items():
            open_batches: list[tuple[list[Row], int, int]] = []
            # one request's own group (seeded, or rows the options couple) keeps its rows' order: the
            # engine draws row by row, so a reordered seeded request got another prompt's draws
            own = key[1][0] in ("seeded", "alone")
            for row in group if own else sorted(group, key=lambda r: -len(r.prompt)):
                P, M = len(row.prompt), row.job.request.max_tokens
                for i, (batch, longest, most) in enumerate(open_batches):
                    if len(batch) < self.max_rows and max(longest, P) + max(most, M) <= self.context:
                        batch.append(row)
                        open_batches[i] = (batch, max(longest, P), max(most, M))
                        break
                else:
                    open_batches.append(([row], P, M))
            batches.extend(batch for batch, _, _ in open_batches)
        return batches

    def _start_batch(self, rows: list[Row]) -> _BatchRun:
        request = rows[0].job.request  # every row of a batch shares the key's settings and resolved options
        top = max((row.job.request.logprobs or 0) for row in rows)
        steps = stream(self.model, [row.prompt for row in rows], max(row.job.request.max_tokens for row in rows),
                       temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, seed=request.seed,
                       stop_tokens=() if request.ignore_eos else self.stop_tokens, pad_id=self.tokenizer.pad_id,
                       logprobs=any(row.job.request.logprobs is not None for row in rows), top_logprobs=top,
                       written=written_rows([(row.prompt, row.written) for row in rows]), **request.options)
        self.stats.batches += 1
        self.stats.rows_decoded += len(rows)
        self.stats.max_batch_rows = max(self.stats.max_batch_rows, len(rows))
        self._active_rows += len(rows)
        for row in rows:
            row.job.batch_rows = max(row.job.batch_rows, len(rows))
        return _BatchRun(rows, steps)

    # -- one step of one batch ----------------------------------------------------------------
    def _step(self, run: _BatchRun) -> bool:
        """Advance a batch by one token; False once it has no row left."""
        for row in run.rows:
            self._gone(row)
        if all(row.done for row in run.rows):
            return False
        try:
            step = next(run.steps)
        except StopIteration:  # every row stopped on a stop token, or the batch's max_tokens
            for row in run.rows:
                if not row.done:
                    if row.generated >= row.job.request.max_tokens:
                        self._finish_row(row, "length")
                    else:  # its last sample was a stop token (not yielded): generated all the same
                        row.generated += 1
                        self._finish_row(row, "stop")
            return False
        self.stats.steps += 1
        self.stats.row_steps += sum(not row.done for row in run.rows)
        for i, row in enumerate(run.rows):
            if row.done:
                continue
            logprob = step.logprobs[i] if step.logprobs is not None else None
            top = step.top_logprobs[i] if step.top_logprobs is not None else None
            self._hand_token(row, step.tokens[i], logprob, top, row_info(step.info, i))
        return not all(row.done for row in run.rows)


class ContinuousScheduler(Scheduler):
    """Continuous batching: see the module docstring. `compiled`: a batch whose options compile
    decodes on the compiled path (`SlotBatch`); "auto": so where the on-disk cache holds the steps
    (`auto_compiled`); `announce(message)` hears of its compiles and of what "auto" chose. `kv_dtype`:
    the compiled path's cache stores keys and values in it (`SlotBatch`); eager batches keep the model's.

    Only `warm` compiles: the default options' steps, and those of each of `warm_options` (option
    dicts, as a request gives them) with `compiled=True`. A batch for other options takes the compiled
    path only where the on-disk cache holds all its steps, and decodes eagerly otherwise, saying so
    once: a request whose options compiled at first use held the decoding thread, and so every
    stream, for the minutes a compile takes on a small CPU."""

    def __init__(self, model, tokenizer, max_rows: int, max_queue: int, batch_window: float,
                 compiled: bool | str = False, announce: Callable[[str], None] | None = None,
                 compile_steps: bool = True, kv_dtype: torch.dtype | None = None,
                 warm_options: Sequence[dict] = ()):
        super().__init__(model, tokenizer, max_rows, max_queue, batch_window)
        self.announce = announce
        self.kv_dtype = kv_dtype  # what the compiled path's cache stores keys and values in (None: the model's)
        self.defaults = model_options(model, {})  # the options a request without any decodes with
        self.compile_at_start = compiled is True  # "auto" compiles nothing: it loads what the cache holds
        self.any_compiled = bool(compiled)  # True or "auto": a batch may take the compiled path
        self.warm_options = [self._resolved_warm_options(given) for given in warm_options]  # before any compile
        self.compiled = self.auto_compiled() if compiled == "auto" else bool(compiled)
        self.compile_steps = compile_steps  # False: the compiled path's step run eagerly (tests)
        self.device = next(model.parameters()).device
        self._batches: dict[tuple, DecodeBatch] = {}  # by the options every row of the batch runs with
        self._jobs: list[Job] = []  # admitted and not finished
        self._warmed: list[tuple[dict, SlotBatch]] = []  # the batches `warm` compiled, kept for every later join
        self._told_eager: list[dict] = []  # options already announced as decoding eagerly

    def _resolved_warm_options(self, given: dict) -> dict:
        try:
            return model_options(self.model, given)
        except ConfigError as exc:
            raise ConfigError(f"--warm-options {json.dumps(given)}: {exc}") from None

    def auto_compiled(self) -> bool:
        """`--decode auto`: the compiled path when the default options' step compiles and loading it
        for every batch size is expected within AUTO_START_BUDGET_S (it was compiled on this machine
        before); else eager, saying how to compile it once."""
        if not compiles(self.model, self.defaults, self.max_rows):
            return False
        seconds = cached_start_seconds(self.model, self.defaults, self.max_rows, self.kv_dtype)
        chosen = seconds is not None and seconds <= AUTO_START_BUDGET_S
        if self.announce is not None:
            self.announce(f"--decode auto: the compiled path (its steps for 1 to {self.max_rows} rows are in the "
                          f"on-disk cache: {about_seconds(seconds)} to load)" if chosen else
                          f"--decode auto: decoding eagerly; the compiled path's steps for 1 to {self.max_rows} rows "
                          f"are not all in the on-disk cache (one start with --decode compiled compiles them, "
                          f"minutes on a small CPU; later starts load them in seconds)"
                          + ("" if self.kv_dtype is None else f"; until then the cache stays in the model's dtype, "
                                                              f"not --kv-dtype's {self.kv_dtype}"))
        return chosen

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._jobs and not self._wait_for_work(self.max_rows):
                    break
                room = self.max_rows - self._active_rows
                for job in self._take_jobs(room, at_least_one=not self._jobs):
                    self._admit(job)
                for key, batch in list(self._batches.items()):
                    if self._stopping.is_set():
                        break
                    try:
                        self._step(batch)
                    except Exception as exc:  # noqa: BLE001 - only this batch's requests fail
                        self._fail_internal(list({id(m.owner.job): m.owner.job for m in self._members(batch)}
                                                 .values()), exc)
                        self._drop_rows(batch)
                    if not len(batch):
                        del self._batches[key]
                self._settle_jobs()
        finally:
            self._stop_running()
            self._fail_pending()

    def _settle_jobs(self) -> None:
        """After a pass: a cancelled job whose rows are all freed has ended (kept, the loop never
        idled again: it spun a core for good after one client hung up); ended jobs leave; the live
        rows are counted from the jobs themselves (a failed job's rows, marked done as it failed,
        were never subtracted from a running count: the room for new rows shrank for good)."""
        for job in self._jobs:
            if not job.finished and job.cancelled.is_set() and all(row.done for row in job.rows):
                job.finished = True
                self.stats.cancelled += 1
        self._jobs = [job for job in self._jobs if not job.finished]
        self._active_rows = sum(1 for job in self._jobs for row in job.rows if not row.done)

    def _stop_running(self) -> None:
        """Stopping: every admitted request that has not ended ends with 503."""
        for job in self._jobs:
            if not job.finished:
                if job.cancelled.is_set():
                    job.finished = True
                    self.stats.cancelled += 1
                else:
                    job.fail(APIError(503, "the server is shutting down: the request was stopped",
                                      type="server_error", code="shutting_down"))
                    self.stats.failed += 1
        self._jobs, self._batches, self._active_rows = [], {}, 0

    def _warm_steps(self) -> None:
        """Compile (or load from the on-disk cache) the compiled path's step at every batch size up to
        `max_rows` for the default options and each of `warm_options` (with "auto": those whose steps
        the cache holds; the others decode eagerly, `_new_batch`)."""
        if not self.any_compiled:
            return
        for options in [self.defaults, *self.warm_options]:
            if any(options == warmed for warmed, _ in self._warmed):
                continue
            asked = options != self.defaults  # a --warm-options set of its own: what becomes of it is said
            why = why_not_compiled(self.model, options, self.max_rows)
            if why is not None:
                if asked and self.announce is not None:
                    self.announce(f"--warm-options {self._shown(options)}: they decode eagerly, their step does not "
                                  f"compile ({why})")
                continue
            if self.compile_at_start or self._steps_cached(options):
                batch = self._slot_batch(options)
                batch.warm(self.max_rows)
                self._warmed.append((options, batch))
            elif asked:  # "auto": loaded only where the cache holds them
                self._tell_eager(options)

    def _steps_cached(self, options: dict) -> bool:
        """Whether the compiled path's steps for these options are all in the on-disk cache (or need
        no compile: `compile_steps=False`), so a batch of them compiles nothing; with "auto", also
        expected to load within AUTO_START_BUDGET_S, as `auto_compiled` judges the defaults (records
        of slow first calls loaded 300 s of steps under a notice that said it would not)."""
        if not self.compile_steps:
            return True
        seconds = cached_start_seconds(self.model, options, self.max_rows, self.kv_dtype)
        return seconds is not None and (self.compile_at_start or seconds <= AUTO_START_BUDGET_S)

    def _slot_batch(self, options: dict) -> SlotBatch:
        return SlotBatch(self.model, options, self.stop_tokens, self.tokenizer.pad_id,
                         coupled=couples_rows(self.model, options), compile=self.compile_steps,
                         on_compile=self.announce, kv_dtype=self.kv_dtype)

    def _new_batch(self, options: dict) -> DecodeBatch:
        for warmed, batch in self._warmed:
            if warmed == options:
                # the warmed batch, again after it emptied: its storage for max_rows rows is allocated once
                return batch
        if self.any_compiled and compiles(self.model, options, self.max_rows):
            if self._steps_cached(options):  # under "auto" too: its defaults' steps may be cached or not
                return self._slot_batch(options)
            self._tell_eager(options)
        return DecodeBatch(self.model, options, self.stop_tokens, self.tokenizer.pad_id,
                           coupled=couples_rows(self.model, options))

    def _tell_eager(self, options: dict) -> None:
        """Say once per set of options that its batches decode eagerly, and how to compile them (the
        defaults' are said by `auto_compiled`, which names the flag that compiles them)."""
        if self.announce is None or options in self._told_eager or options == self.defaults:
            return
        self._told_eager.append(options)
        shown = self._shown(options)
        dtype = "" if self.kv_dtype is None else f" (their cache in the model's dtype, not {self.kv_dtype})"
        self.announce(f"requests with {shown} decode eagerly{dtype}: their compiled steps are not all in the "
                      f"on-disk cache, and a request never makes the server compile (every stream would wait "
                      f"minutes); start with --decode compiled --warm-options '{shown}' to compile them")

    def _shown(self, options: dict) -> str:
        """The options as a request gives them: those that differ from the defaults, as JSON."""
        return json.dumps({name: value for name, value in options.items() if value != self.defaults.get(name)})

    # -- joining ------------------------------------------------------------------------------
    def _admit(self, job: Job) -> None:
        """A new request: its echo, then its rows into the batch of its options (prefilled and
        joined at that batch's next step)."""
        request = job.request
        self._jobs.append(job)
        self._active_rows += len(job.rows) if request.max_tokens > 0 else 0
        try:
            if request.echo:
                self._echo(job)
            if request.max_tokens == 0:
                for row in job.rows:
                    self._finish_row(row, "length")
                return
            options = model_options(self.model, request.options)
            key = tuple(sorted(request.resolved.items()))  # {} and {"regime": "soft"} decode alike
            batch = self._batches.get(key)
            if batch is None:
                batch = self._batches[key] = self._new_batch(options)
                self.stats.batches += 1
            generator = None
            if not request.greedy:  # the request's own draws: seeded as asked, else from fresh entropy
                generator = torch.Generator(device=self.device)
                generator.manual_seed(request.seed) if request.seed is not None else generator.seed()
            sampling = Sampling(request.temperature, request.top_k, request.top_p, generator,
                                logprobs=request.logprobs is not None, top_logprobs=request.logprobs or 0,
                                ignore_eos=request.ignore_eos)
            if any(not member.done for member in batch.members):
                self.stats.rows_joined_running += len(job.rows)
            batch.add([Member(row.prompt, request.max_tokens, sampling, owner=row, written=row.written)
                       for row in job.rows])
            self.stats.rows_decoded += len(job.rows)
        except Exception as exc:  # noqa: BLE001 - a bug must not take the server down: this request fails
            self._fail_internal([job], exc)
            for row in job.rows:  # freed: the pass's end counts the live rows from the jobs (`_settle_jobs`)
                row.done = True

    # -- one step of one batch ----------------------------------------------------------------
    @staticmethod
    def _members(batch: DecodeBatch) -> list[Member]:
        return [m for m in batch.members if not m.done] + [m for group in batch.waiting for m in group]

    def _drop_rows(self, batch: DecodeBatch) -> None:
        """After a failed step: the batch's rows are gone (their jobs failed)."""
        for member in self._members(batch):
            batch.drop(member)
            member.owner.done = True  # freed: the pass's end counts the live rows from the jobs (`_settle_jobs`)
        batch.waiting = []

    def _step(self, batch: DecodeBatch) -> None:
        for member in self._members(batch):
            if self._gone(member.owner):
                batch.drop(member)
        regroups = batch.regroups
        steps = batch.step()
        self.stats.rounds += batch.regroups - regroups
        if not steps:
            return
        self.stats.steps += 1
        self.stats.row_steps += len(steps)
        self.stats.max_batch_rows = max(self.stats.max_batch_rows, len(steps))
        self.stats.last_batch_rows = [len(steps)]
        for step in steps:
            row = step.member.owner
            row.job.batch_rows = max(row.job.batch_rows, len(steps))
            if row.done:  # finished by its job's end meanwhile
                batch.drop(step.member)
                continue
            self._hand_token(row, step.token, step.logprob, step.top_logprobs, dict(step.member.info))
            if row.done:
                batch.drop(step.member)


def make_scheduler(batching: str, model, tokenizer, max_rows: int, max_queue: int, batch_window: float,
                   compiled: bool | str = False, announce: Callable[[str], None] | None = None,
                   kv_dtype: torch.dtype | None = None, warm_options: Sequence[dict] = ()) -> Scheduler:
    """The scheduler `--batching` names (BATCHING); `compiled` (continuous only): the compiled path,
    or "auto" (see `ContinuousScheduler.auto_compiled`; with rounds: eager); `kv_dtype` and
    `warm_options` (the compiled path only): its cache's dtype, the options it makes ready at start."""
    if batching == "continuous":
        return ContinuousScheduler(model, tokenizer, max_rows, max_queue, batch_window, compiled, announce,
                                   kv_dtype=kv_dtype, warm_options=warm_options)
    if batching == "rounds" and compiled is not True and kv_dtype is None and not warm_options:
        return RoundScheduler(model, tokenizer, max_rows, max_queue, batch_window)
    raise ValueError(f"batching must be one of {', '.join(BATCHING)} (the compiled path: continuous), "
                     f"got {batching!r}")


class _BatchRun:
    """One engine call (a generator) and its rows, in order."""

    def __init__(self, rows: list[Row], steps):
        self.rows, self.steps = rows, steps

    def close(self) -> None:
        self.steps.close()  # leaves the engine's generator: its cache is freed
