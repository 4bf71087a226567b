"""The training loop: `train_step` (one optimizer step, the one `fit` and the benchmarks take),
`fit` (steps, logging, validation and checkpoints on schedule), `validate`, and `FiniteGuard`
(the divergence check)."""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import RunLock, json_safe, list_checkpoints
from ..config import TrainConfig
from ..data import eval_batches
from ..data.chat import ChatData, masked_batches
from ..distributed import current_dist
from ..errors import NonFiniteError, OutputError
from ..eval.loss import evaluate_batches
from ..objectives import Objective, trained_targets
from ..optim import lr_multiplier, set_lr
from ..parallel import (
    any_rank,
    grad_norm,
    gradient_sync,
    mean_across_ranks,
    micro_batch_shares,
    micro_batch_term_shares,
)
from ..runtime import autocast_for, resolve_dtype, to_device_async
from .profile import OPTIMIZER_RANGE, open_profiler
from .resume import save
from .state import FlopsMemo, TrainState
from .step import host_values, micro_batch_loss
from .trackers import open_trackers


def validate(state: TrainState, max_batches: int | None = None) -> dict[str, float]:
    """Validation loss / perplexity / bits per byte, the figures of every batch evaluated once: a
    job's processes share the batches out (`process_share`) and add up their sums, so validation
    takes 1/world of one process's time; rank 0 logs them."""
    cfg = state.config
    batches = cfg.train.eval_batches if max_batches is None else max_batches
    if isinstance(state.data, ChatData):  # the loss on the assistant's tokens of held-out conversations
        every = masked_batches(state.data.val, cfg.train.batch_size, batches or None)
    else:
        every = eval_batches(state.data.val, cfg.train.batch_size, cfg.model.sequence_len, batches or None)
    world = state.dist.world_size
    share = process_share(every, state.dist.rank, world) if world > 1 else every
    with autocast_for(state.device, cfg.train.dtype, emulate=not cfg.train.compile):
        return evaluate_batches(state.model, share, state.tokenizer.token_byte_lengths(), across_processes=world > 1)


def process_share(batches: Iterable[tuple], rank: int, world: int) -> Iterator[tuple]:
    """Process `rank`'s share of the batches, read as they stream (one batch held at a time, and the
    first): every world-th from its rank on, then as many padding batches as make every share
    ceil(batches / world) long, since under fsdp2 every forward is collective and each process must
    run as many. A padding batch is the first batch with a loss mask of no target: it runs the same
    forward and adds nothing."""
    first, total, own = None, 0, 0
    for i, batch in enumerate(batches):
        first = batch if first is None else first
        total += 1
        if i % world == rank:
            own += 1
            yield batch
    for _ in range(-(-total // world) - own):
        x, y, *_ = first
        yield x, y, torch.zeros(y.shape, dtype=torch.bool)


def _log(state: TrainState, row: dict[str, Any]) -> None:
    """Append a row to metrics.jsonl as strict JSON: a NaN or infinity is written as null; and to
    the run's trackers. Only rank 0 writes (every process keeps the rows in `state.history`)."""
    state.history.append(row)
    if not state.dist.is_main:
        return
    try:
        with open(state.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
    except OSError as exc:
        raise OutputError(f"cannot write {state.run_dir / 'metrics.jsonl'}: {exc.strerror or exc}") from None
    for tracker in state.trackers:
        tracker.log(row)


NO_STEP = -1  # the guard's "no non-finite step seen yet"
LOSS, GRAD_NORM = 0, 1  # what the guard found not finite first (its `first_kind`)


class FiniteGuard:
    """Stops a diverged run: remembers the first step whose loss or gradient norm was NaN or
    infinite.

    On an accelerator the flags stay on the device (reading them every step would stall the queue
    of kernels) and are read at log intervals and before each save; on the CPU, which has no queue,
    they are read every step, before the optimizer touches the weights."""

    def __init__(self, device: torch.device, deferred: bool | None = None):
        self.deferred = device.type != "cpu" if deferred is None else deferred  # given: as on another device
        self.first_bad = torch.full((), NO_STEP, dtype=torch.long, device=device) if self.deferred else None
        self.first_kind = torch.full((), LOSS, dtype=torch.long, device=device) if self.deferred else None

    @staticmethod
    def fail(step: int, what: str, value: float | str) -> NonFiniteError:
        return NonFiniteError(f"training diverged at step {step}: the {what} is {value}; stopped without saving "
                              f"it (the checkpoints before it, if any, are kept); try a lower learning rate")

    def _observe(self, value: torch.Tensor | float, step: int, kind: int) -> None:
        what = "loss" if kind == LOSS else "gradient norm"
        if not self.deferred:
            if not math.isfinite(float(value)):
                raise self.fail(step, what, float(value))
            return
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value), device=self.first_bad.device)
        newly_bad = ~torch.isfinite(value.detach()) & (self.first_bad == NO_STEP)
        self.first_bad = torch.where(newly_bad, torch.full_like(self.first_bad, step), self.first_bad)
        self.first_kind = torch.where(newly_bad, torch.full_like(self.first_kind, kind), self.first_kind)

    def observe_loss(self, loss: torch.Tensor | float, step: int) -> None:
        self._observe(loss, step, LOSS)

    def observe_grad_norm(self, norm: torch.Tensor, step: int) -> None:
        self._observe(norm, step, GRAD_NORM)

    def check(self) -> None:
        if self.deferred and int(self.first_bad) != NO_STEP:
            what = "loss" if int(self.first_kind) == LOSS else "gradient norm"
            raise self.fail(int(self.first_bad), what, "not finite")


@dataclass
class StepOutcome:
    loss_on_device: torch.Tensor  # the reported loss, averaged over the micro-batches and the processes
    metrics: dict[str, Any]  # what the objective reports: float values averaged as the loss, others the
    # last micro-batch's (device values unread)

    @property
    def loss(self) -> float:
        """The reported loss as a host float (a read: waits for the device to finish the step)."""
        return float(self.loss_on_device)


def _weighing(batches: list[tuple[torch.Tensor, ...]], accumulate: int, device: torch.device, objective: Objective
              ) -> tuple[Callable[[torch.Tensor, int], torch.Tensor], torch.Tensor | None]:
    """How micro-batch m's loss (and metrics) weigh in the step, and the loss terms' shares the
    objective weighs them by itself (None: it does not): divided by `accumulate` where every loss is
    a mean over its whole batch (the micro-batches count alike: the division it always was); with loss
    masks, times its share of the step's trained targets (`micro_batch_shares`), as a mean per
    micro-batch weighed equally would weigh a token by how few others its micro-batch trained on; for
    an objective whose loss is a sum of means over different targets (`Objective.target_terms`), each
    term by its own share (`micro_batch_term_shares`), applied by the objective, and summed here."""
    if not any(len(batch) > 2 for batch in batches):
        return (lambda value, micro: value / accumulate), None
    terms = [objective.target_terms(batch[1], batch[2]) if len(batch) > 2 else None for batch in batches]
    if all(counts is not None for counts in terms):
        return (lambda value, micro: value), micro_batch_term_shares(terms, device)
    counts = [int(trained_targets(*batch[1:3]).sum()) for batch in batches]  # what each micro-batch's mean is over
    shares = micro_batch_shares(counts, device)
    return (lambda value, micro: value * shares[micro]), None


def train_step(model: nn.Module, forward_model: nn.Module, objective: Objective,
               next_batch: Callable[[], tuple[torch.Tensor, ...]], step: int,
               optimizers: list[torch.optim.Optimizer], train: TrainConfig, device: torch.device,
               guard: FiniteGuard, accumulate: int | None = None) -> StepOutcome:
    """One optimizer step, the one `fit` and the benchmarks take: `accumulate` micro-batches
    (default `train.grad_accum`; each `next_batch()` -> x, y[, loss mask]) through the objective
    under the run's autocast (`forward_model`: the model, or the trainer's model-and-loss, compiled
    or wrapped, see `train.step`), each loss backward scaled by its micro-batch's share (1 / accumulate;
    with loss masks, its share of the step's trained targets over every process: `_weighing`),
    the loss and the objective's float metrics weighed alike over micro-batches and processes, the loss checked, the
    gradient norm clipped and checked (a non-finite one raises before the optimizer touches the
    weights, on the CPU), then every optimizer's step. Nothing is read back from the device (on
    an accelerator the guard's checks wait for `guard.check()`). The learning rate is the caller's
    (`set_lr`). `step` is 0-based: the objective's draws are seeded by it, and `guard` reports a
    failure as step + 1."""
    accumulate = accumulate or train.grad_accum
    env = current_dist()
    # the step's batches drawn first: a masked step weighs each micro-batch by its share of the targets
    batches = [next_batch() for _ in range(accumulate)]  # each x, y[, loss mask] (sft batches carry the mask)
    weigh, term_shares = _weighing(batches, accumulate, device, objective)
    loss_sum, metrics = None, {}
    averaged: dict[str, torch.Tensor] = {}  # the objective's float metrics, weighed over micro-batches as the loss
    for micro, (x, y, *rest) in enumerate(batches):
        with gradient_sync(forward_model, sync=micro == accumulate - 1):
            x, y = to_device_async(x, device), to_device_async(y, device)
            mask = to_device_async(rest[0], device) if rest else None
            # which of the step's batches this is, over micro-batches and processes (the loader gives
            # process r of W the global batch micro x W + r): fbt's prefixes are drawn per batch
            draw = micro * env.world_size + env.rank
            with autocast_for(device, train.dtype, emulate=not train.compile):
                loss, reported, metrics = micro_batch_loss(forward_model, objective, x, y, mask, step, draw,
                                                           None if term_shares is None else term_shares[micro])
            weigh(loss, micro).backward()
        reported = weigh(reported.float(), micro)
        loss_sum = reported if loss_sum is None else loss_sum + reported
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1:
                part = weigh(value.detach().float().reshape(()), micro)
                averaged[key] = part if key not in averaged else averaged[key] + part
    # the loss and those metrics averaged over the processes in one reduction: a metric of the last
    # micro-batch on rank 0 alone differed between one process and N with the same global batch
    means = mean_across_ranks(torch.stack([loss_sum.reshape(()), *averaged.values()]))
    loss_sum = means[0]
    metrics = {**metrics, **dict(zip(averaged, means[1:]))}
    guard.observe_loss(loss_sum, step + 1)
    with torch.profiler.record_function(OPTIMIZER_RANGE):  # the profile's optimizer share (train/profile.py)
        guard.observe_grad_norm(grad_norm(model, train.grad_clip), step + 1)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return StepOutcome(loss_sum, metrics)


def fit(state: TrainState, progress: bool = True, max_seconds: float | None = None) -> dict[str, Any]:
    """Train until `train.steps` (or until `max_seconds` of training have passed in this call; under
    several processes the deadline is agreed at logging steps, which read the device anyway),
    evaluating and checkpointing on schedule; returns a summary. Holds the run folder's lock
    throughout (rank 0); a NaN or infinite loss or gradient stops the run with `NonFiniteError`
    (on every process at the same step: the loss is averaged over them and the gradients are
    shared)."""
    if state.dist.is_main:
        if state.lock is None:
            state.lock = RunLock(state.run_dir)
        state.lock.acquire()  # a no-op when setup's lock is still held
    try:
        if state.dist.is_main and state.config.train.trackers:
            state.trackers = open_trackers(state.config.train.trackers, state.run_dir, state.config_as_saved(),
                                           state.step)
        return _fit(state, progress and state.dist.is_main, max_seconds)
    except NonFiniteError as exc:
        if state.dist.world_size > 1:
            exc.shared = True  # every process stops at the same step with the same line: rank 0 prints it
        raise
    finally:
        for tracker in state.trackers:
            tracker.close()
        state.trackers = []
        if state.lock is not None:
            state.lock.release()


class _ValidationSkipped(Exception):
    """Ctrl+C during the run's final validation: the validation is dropped, the save still runs."""


class _GracefulInterrupt:
    """Ctrl+C (SIGINT) or SIGTERM while training (the main thread): the first asks the loop to stop
    after the step it is in, then validate and save as a run does at its end (`--resume` continues);
    a second stops at once, without saving. A stop in the middle of a step could leave some weights
    updated and others not, so the first one never interrupts a step. Without it, a run with
    `save_every` 0 lost everything, and its folder could be neither resumed nor reused.

    The handler stays installed to the end of the final save (`phase`): a Ctrl+C during the final
    validation drops the validation and saves; during the save it is said and waited out. Restored
    before that save, one Ctrl+C in the final validation lost a whole run with `save_every` 0.

    Under torchrun (`shared`: several processes), which forwards a Ctrl+C or SIGTERM to every worker,
    the processes agree on the stop (`_fit`) so that all stop after the same step and save together,
    and a signal during the final validation is waited out (one process skipping it alone would
    leave the others waiting in its collectives). Only rank 0 speaks (`speaks`)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, shared: bool = False, speaks: bool = True):
        self.enabled = threading.current_thread() is threading.main_thread()
        self.shared, self.speaks = shared, speaks
        self.asked = False
        self.asked_while_saving = False  # a stop's save comes before its validation: this one skips it
        self.validation_skipped = False  # the skip is raised once: a second Ctrl+C after it is waited out
        self.phase = "training"  # then "validating", then "saving"
        self._previous: dict[int, Any] = {}

    def _say(self, text: str) -> None:
        if self.speaks:
            print(text, file=sys.stderr)

    def _ask(self, signum, frame) -> None:
        self.asked_while_saving |= self.phase == "saving"
        if self.phase == "saving" or (self.phase == "validating" and self.shared):
            self._say(f"\nlatentloop: {'saving the checkpoint' if self.phase == 'saving' else 'validating'}; it stops "
                      f"once the checkpoint is written")
            self.asked = True
            return
        if self.phase == "validating":
            self.asked = True
            if self.validation_skipped:  # raised already: the save follows, whatever the handler's timing
                self._say("\nlatentloop: saving the checkpoint; it stops once the checkpoint is written")
                return
            self.validation_skipped = True
            raise _ValidationSkipped
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        self._say("\nlatentloop: stopping after this step and saving (Ctrl+C again: stop now, unsaved)")

    def install(self) -> None:
        if self.enabled:
            self._previous = {signum: signal.signal(signum, self._ask) for signum in self.SIGNALS}

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


def _fit(state: TrainState, progress: bool, max_seconds: float | None) -> dict[str, Any]:
    cfg, model = state.config.train, state.model
    if state.step >= cfg.steps:  # a finished run resumed: validating and saving again logged a second final row
        return {"step": state.step, "nothing_to_train": True, "tokens": state.tokens_seen, "flops": state.flops_seen,
                "elapsed": state.elapsed, "params": model.num_params(), "world_size": state.dist.world_size,
                "checkpoint": str(list_checkpoints(state.run_dir)[-1]) if list_checkpoints(state.run_dir) else None}
    guard = state.guard = FiniteGuard(state.device)
    forward_model = state.forward_model if state.forward_model is not None else model
    flops_model = state.flops if state.flops is not None else FlopsMemo(model)
    tokens_per_step = state.global_batch * state.config.model.sequence_len
    model.train()
    bar = tqdm(total=cfg.steps, initial=state.step, disable=not progress, desc="train", dynamic_ncols=True)
    # tokens/s over the steps' own time since the last log row (`state.elapsed`): validation and
    # checkpoints between them are not the steps' time
    window_start, window_tokens = state.elapsed, 0
    train_loss = float("nan")
    deadline = time.perf_counter() + max_seconds if max_seconds is not None else float("inf")
    first_step = state.step

    shared = state.dist.world_size > 1

    def out_of_time(agree: bool) -> bool:
        """Past the deadline. One process checks whenever asked; several make one decision (else some
        would wait for the others), only where `agree` (the agreement is a read of the device)."""
        if max_seconds is None:
            return False
        late = time.perf_counter() >= deadline
        if not shared:
            return late
        return any_rank(late, state.device) if agree else False

    profiler = open_profiler(state) if cfg.profile_steps else None
    interrupt = _GracefulInterrupt(shared=shared, speaks=state.dist.is_main)
    stopped_on_request = False
    try:
        interrupt.install()
        # several processes agree on the deadline before the first step, then at logging steps (`stopping`)
        while state.step < cfg.steps and not out_of_time(agree=state.step == first_step):
            step_start = time.perf_counter()
            multiplier = lr_multiplier(state.step, cfg)
            set_lr(state.optimizers, multiplier)
            outcome = train_step(model, forward_model, state.objective, state.loader.next_batch, state.step,
                                 state.optimizers, cfg, state.device, guard, state.accumulation)
            state.flops_seen += state.objective.flops_per_token(flops_model, state.step) * tokens_per_step
            state.step += 1
            state.tokens_seen += tokens_per_step
            window_tokens += tokens_per_step
            due = state.step % cfg.log_every == 0 or state.step == cfg.steps
            # several processes stop after the same step: they agree on a request where they log (a
            # step that reads the device anyway), so no other step waits on the host
            requested = any_rank(interrupt.asked, state.device) if shared and due else interrupt.asked and not shared
            stopped_on_request = requested
            stopping = out_of_time(agree=due) or requested  # several processes: agreed at logging steps
            logging = due or stopping
            # a stop validates and saves below, as a run's end does: here too, it did both twice
            validating = bool(cfg.eval_every) and state.step % cfg.eval_every == 0 and state.step < cfg.steps
            saving = bool(cfg.save_every) and state.step % cfg.save_every == 0 and state.step < cfg.steps
            validating, saving = validating and not stopping, saving and not stopping
            if logging:  # the step's only reads of the device: they wait for its queue of kernels
                guard.check()
                train_loss, extra = outcome.loss, host_values(outcome.metrics)
            elif validating or saving:  # its queued kernels finish here, inside the step's time, not theirs
                guard.check()
            state.elapsed += time.perf_counter() - step_start
            if profiler is not None:
                profiler.step()
            if logging:
                tok_per_s = window_tokens / max(state.elapsed - window_start, 1e-9)
                window_start, window_tokens = state.elapsed, 0
                lr = cfg.lr * multiplier
                spread = ({"world_size": state.dist.world_size, "global_batch": state.global_batch}
                          if state.dist.world_size > 1 else {})
                _log(state, {"step": state.step, "loss": train_loss, "lr": lr, "tokens": state.tokens_seen,
                             "flops": state.flops_seen, "tok_per_s": tok_per_s, "elapsed": state.elapsed, **spread,
                             **extra})
                bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_per_s:,.0f}")
            bar.update(1)
            if validating:
                _log(state, {"step": state.step, **{f"val_{k}": v for k, v in validate(state).items()}})
                model.train()
            if saving:
                save(state)
            if stopping:
                break
    except BaseException:  # diverged, or stopped at once: the handler goes with the run
        interrupt.restore()
        raise
    finally:  # also when the run stops (diverged, interrupted): the error starts a line of its own
        bar.close()
        if profiler is not None:
            profiler.close()
    checkpoint = None
    try:  # the handler stays until the checkpoint is written: a Ctrl+C here must not lose the run
        if stopped_on_request:  # a signal's grace (torchrun's ~30 s before it kills) goes to the checkpoint first
            interrupt.phase = "saving"
            checkpoint = save(state)
        # a Ctrl+C during that save ("it stops once the checkpoint is written") means now: no validation
        # (every process alike: collectives follow)
        skipped = stopped_on_request and any_rank(interrupt.asked_while_saving, state.device)
        final: dict[str, float] = {}
        if not skipped:
            interrupt.phase = "validating"
            try:
                final = validate(state)
                interrupt.phase = "saving"  # inside: a Ctrl+C before this line skips a validation that is done
            except _ValidationSkipped:
                interrupt.phase = "saving"  # first: a second Ctrl+C from here on is waited out, not raised
                final, skipped = {}, True
        if skipped:
            print("latentloop: final validation skipped (Ctrl+C)" + ("" if checkpoint else "; saving"), file=sys.stderr)
        interrupt.phase = "saving"  # from here a Ctrl+C is waited out: logging the row (trackers) included
        if final:
            _log(state, {"step": state.step, **{f"val_{k}": v for k, v in final.items()}})
        if checkpoint is None:
            checkpoint = save(state)
    finally:
        interrupt.restore()
    return {"step": state.step, "train_loss": train_loss, "tokens": state.tokens_seen, "flops": state.flops_seen,
            "elapsed": state.elapsed, "params": state.model.num_params(), "checkpoint": str(checkpoint),
            "world_size": state.dist.world_size, "strategy": cfg.strategy, "global_batch": state.global_batch,
            "precision": resolve_dtype(state.device, cfg.dtype),
            # stopped short of train.steps (a Ctrl+C during the last step, honoured after it, is not)
            "interrupted": stopped_on_request and state.step < cfg.steps,
            "validation_skipped": skipped, **{f"val_{k}": v for k, v in final.items()}}
