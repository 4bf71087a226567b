"""`setup`: check the output folder, the stage and a resumed run's folder, then build tokenizer,
data, model, objective and optimizers (nothing is written until all succeed), claim the folder,
and resume from its newest loadable checkpoint when asked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..archs import build_model, build_objective, get_arch
from ..checkpoint import (
    LOCK_FILE,
    RunLock,
    check_resumable,
    checkpoint_candidates,
    find_tokenizer_file,
    list_checkpoints,
    prompting_as_its_model,
    resolve_checkpoint,
)
from ..config import RunConfig, TrainConfig
from ..data import TokenLoader, load_tokenizer
from ..data.chat import ChatLoader, prepare_chat
from ..data.tokenizers import ChatTokens
from ..distributed import in_turns, init_distributed, on_main, raised_alike, resolve_strategy, together
from ..errors import CheckpointError, ConfigError, DataError, OutputError
from ..interop.upcycle import initialise_from
from ..parallel import wrap_model
from ..runtime import absolute_source, keep_freed_memory, precision_note, prepare_data, resolve_dtype
from ..util import read_json_object, warn_once, write_json_atomic
from .memory import check_micro_batch_fits, check_step_fits
from .resume import resume_run
from .stages import check_stage
from .state import ONE_OFF_TRAIN_FIELDS, SET_ON_SETUP, FlopsMemo, TrainState, config_as_given, note, rank_seed, warn
from .step import ModelAndLoss, accumulation, compiled_step_graphs
from .trackers import TENSORBOARD_DIR, WANDB_DIR, check_trackers


def _check_output_path(run_dir: Path) -> None:
    """A run folder that could never be created (a file stands in its place or above it) is reported
    before any data is prepared."""
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputError(f"output folder {run_dir} is a file")
    if run_dir.is_symlink() and not run_dir.exists():  # mkdir said only "File exists"
        raise OutputError(f"output folder {run_dir} is a link to {os.readlink(run_dir)}, which does not exist: "
                          f"make the folder it points to, or choose another output folder")
    for parent in run_dir.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"cannot create output folder {run_dir}: {parent} is a file")
            break


# train settings a resumed run cannot take: the data order and the objective's draws follow the seed,
# and the optimizers' parameter groups follow these two (their saved states would not fit)
FIXED_ON_RESUME = ("seed", "optimizer", "muon_exclude", "stage")  # stage: what the run is (its data, its checks)
# train settings the lr schedule (and step-dependent recipes such as fbt's paper schedule) is computed from
SCHEDULE_FIELDS = ("steps", "warmup_steps", "schedule", "decay_fraction", "min_lr_ratio")


# A resumed run's data.source that names another path than the saved one (the data moved): allowed, as the
# resume checks that it tokenizes to the checkpoint's shards (their sha256) before any step; said, and the
# run's config.json takes the new path at its next checkpoint. It was refused as "a different run".
MOVED_DATA = "data.source"


def train_changes(previous: dict, current: dict) -> list[str]:
    """The train settings of a resumed run that differ from its saved config, as "key: old -> new"."""
    old, new = previous.get("train", {}), current["train"]
    return [f"{key}: {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}" for key in sorted(set(old) | set(new))
            if key not in ONE_OFF_TRAIN_FIELDS
            and json.loads(json.dumps(old.get(key))) != json.loads(json.dumps(new.get(key)))]


def _holds_checkpoints(run_dir: Path) -> bool:
    """Whether the run has a checkpoint (or one a crash left aside for `recover_checkpoints` to put
    back). A save's unfinished `.tmp-` folder is not one: a run killed during its first save was
    told to --resume, then that it held no checkpoint, and started only at the third try."""
    return bool(checkpoint_candidates(run_dir))


def _is_run_config(path: Path) -> bool:
    """Whether `path` reads as a run's config.json: sections model (with its arch), train and data.
    An unreadable one counts as a run's (a crash mid-write): resuming names what is wrong with it."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True
    return isinstance(config, dict) and all(isinstance(config.get(s), dict) for s in ("model", "train", "data")) \
        and isinstance(config["model"].get("arch"), str)


def check_run_folder(run_dir: Path, config: RunConfig, resume: bool, strategy: str | None = None) -> list[str]:
    """Refuse a folder this run cannot start or resume in; resuming, the train settings that changed
    since the run's saved config (`train_changes`; a FIXED_ON_RESUME one is refused). `strategy`: the
    train.strategy as given (auto, say), compared in place of the resolved one `config` holds, since
    the saved config keeps it as given (`config_as_given`)."""
    saved = run_dir / "config.json"
    if (run_dir / "model.safetensors").is_file() or (run_dir / "state.json").is_file():
        if run_dir.parent.name == "checkpoints":
            raise CheckpointError(f"{run_dir} is a checkpoint folder; give its run folder ({run_dir.parent.parent}) "
                                  f"as --out, or start a new run from it with --init-from")
        raise CheckpointError(f"{run_dir} holds model weights and is not a run folder: choose another output folder "
                              f"(to start from its weights: --init-from, after `latentloop import-hf` for a Hugging "
                              f"Face folder)")
    if saved.is_file() and not _is_run_config(saved):
        # a Hugging Face folder's config.json (or any other) was taken for a stopped run, and both it and
        # tokenizer.json were overwritten
        raise CheckpointError(f"{run_dir} exists and is not empty, and its config.json is not a latentloop run's; "
                              f"choose another output folder")
    if saved.is_file() and not resume and not _holds_checkpoints(run_dir):
        return []  # a run that stopped before its first save: nothing to resume, so it starts again here
    if saved.is_file():
        if not resume:
            raise CheckpointError(f"{run_dir} already holds a run; pass --resume to continue it or choose another "
                                  f"output folder")
        try:
            previous = json.loads(saved.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"corrupt {saved}: {exc}") from None
        if not isinstance(previous, dict) or not all(isinstance(previous.get(s, {}), dict) for s in ("model", "data")):
            raise CheckpointError(f"corrupt {saved}: not a run config with sections model/train/data")
        current = config.to_dict() if strategy is None else config_as_given(config, strategy)
        moved = []
        for section in ("model", "data"):
            for key in sorted(set(previous.get(section, {})) | set(current[section])):
                old, new = previous.get(section, {}).get(key), current[section].get(key)
                if key in SET_ON_SETUP:  # resuming reloads the run's own tokenizer, which decides these
                    continue
                if (section, key) == ("data", "source") and isinstance(old, str) and isinstance(new, str):
                    old, new = absolute_source(old), absolute_source(new)  # one file, however its path is typed
                    if old != new:  # moved: the resume checks its token shards against the checkpoint's
                        moved.append(f"{MOVED_DATA}: {json.dumps(old)} -> {json.dumps(new)}")
                        continue
                if json.loads(json.dumps(old)) != json.loads(json.dumps(new)):
                    raise CheckpointError(f"{run_dir} holds a different run: {section}.{key} is {old!r} there, "
                                          f"{new!r} here")
        changes = train_changes(previous, current)
        for key in FIXED_ON_RESUME:
            old, new = previous.get("train", {}).get(key), current["train"].get(key)
            if key in previous.get("train", {}) and json.loads(json.dumps(old)) != json.loads(json.dumps(new)):
                raise CheckpointError(f"cannot resume {run_dir} with train.{key} {new!r}: it ran with {old!r}, and a "
                                      f"resumed run keeps it; start a new run from its weights (--init-from) instead")
        return changes + moved
    elif resume:
        raise CheckpointError(f"cannot resume: {run_dir} holds no run (no config.json)")
    elif run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        raise CheckpointError(f"{run_dir} exists and is not empty; choose another output folder")
    return []


STOPPED_LOG = "metrics-stopped.jsonl"  # a run started again in its folder keeps the stopped one's log here


def stopped_log_path(run_dir: Path, name: str = STOPPED_LOG) -> Path:
    """Where a stopped run's log (or tracker folder: `name` without a suffix) is kept: `name`, or the
    first free numbered name after it (a folder started again twice before its first save replaced the
    first stopped run's log)."""
    path, number = run_dir / name, 2
    while path.exists():
        path, number = run_dir / f"{Path(name).stem}-{number}{Path(name).suffix}", number + 1
    return path


def check_validation_split(val, config: RunConfig) -> None:
    """Every run ends with a validation: a split shorter than one window was found only then, after
    the whole training, and the run ended without a checkpoint."""
    window = config.model.sequence_len + 1
    if len(val) < window:
        raise DataError(f"the validation split holds {len(val):,} tokens ({config.data.val_fraction:g} of the data); "
                        f"one validation window needs sequence_len + 1 = {window:,}: add data, raise "
                        f"data.val_fraction or lower sequence_len")


def _check_compile_scope(train: TrainConfig, resume: bool) -> None:
    """fsdp2's units are the blocks, so a whole-model compile (`compile_scope=whole`) would be passed
    over without a word: a new run is refused; a run that was saved so resumes (block by block, as it
    ran), with a warning. Checked here, not in the config: a saved config must still load."""
    if not (train.compile and train.strategy == "fsdp2" and train.compile_scope == "whole"):
        return
    message = ("train.compile_scope=whole: under strategy fsdp2 every architecture compiles block by block "
               "(fsdp2's units are the blocks)")
    if resume:
        warn_once(message + "; this run resumes so, as it ran")
        return
    raise ConfigError(message + "; use compile_scope=auto or blocks")


def setup(config: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
          init_from: str | Path | None = None) -> TrainState:
    """Build tokenizer, data, model, objective and optimizers; nothing is written until all succeed.
    Under torchrun (train.strategy ddp or fsdp2) this process first joins the job's process group."""
    run_dir = Path(run_dir)
    # auto -> what runs (the model's wrapping, the checkpoints' state.json and the log follow it); the
    # run's config.json keeps the setting as given (`config_as_given`)
    given_strategy = config.train.strategy
    config.train.strategy = resolve_strategy(given_strategy)
    # a text file's path as an absolute one: the run records it so, and resumes from any folder
    config.data.source = absolute_source(config.data.source)
    env, device = init_distributed(config.train.strategy, config.train.device)
    if device.type == "cpu" and config.train.keep_freed_memory:
        keep_freed_memory()
    together(_check_output_path, run_dir)
    together(check_trackers, config.train.trackers)  # a missing tracker package, before anything is written
    together(check_stage, config, resume, init_from)
    together(_check_compile_scope, config.train, resume)
    # the token batch divides into micro-batches, before any data is prepared
    together(accumulation, config.train, config.model.sequence_len, env.world_size)
    together(check_run_folder, run_dir, config, resume, given_strategy)
    if resume and list_checkpoints(run_dir):
        together(lambda: check_resumable(resolve_checkpoint(run_dir)))  # before any data is prepared
    if resume and init_from is not None:
        together(_check_resumed_init_from, run_dir, init_from)
    tokenizer = together(load_tokenizer, _run_tokenizer(run_dir) if resume else config.data.tokenizer)
    if init_from is not None and not resume:  # an imported run saved before its tokenizer file said how it prompts
        tokenizer = together(lambda: prompting_as_its_model(tokenizer, resolve_checkpoint(init_from)))
    elif not resume and not tokenizer.adds_bos:
        # a new model reads every document after BOS (the data's rule), whatever the file says of the
        # model it came with (an imported run's tokenizer.json: its model reads none)
        tokenizer = tokenizer.prompting_with_bos()
    if init_from is not None and not resume:
        together(check_tokenizer_of_base, tokenizer, init_from)
    sft = config.train.stage == "sft"
    added_ids: list[int] = []  # the token ids SFT adds (its chat tokens), whose rows start at the mean
    if sft:
        before = tokenizer
        tokenizer = tokenizer.with_chat_tokens()  # already there on resume: the same tokenizer back
        if getattr(before, "chat_tokens", None) is None and isinstance(tokenizer.chat_tokens, ChatTokens):
            added_ids = list(tokenizer.chat_tokens.ids)
    config.model.vocab_size, config.model.bos_id = tokenizer.vocab_size, tokenizer.bos_id
    together(config.model.__post_init__)
    together(check_micro_batch_fits, config, device)
    together(check_step_fits, config, device, env.world_size)  # the plan's estimate of a step, past a size
    torch.manual_seed(config.train.seed)
    if sft:
        # rendered in memory on every rank (nothing cached to disk), the same rows everywhere
        data = together(prepare_chat, config.data.source, tokenizer, config.model.sequence_len,
                        config.data.val_fraction)
        counts = data.meta["train"]
        if (counts["dropped"] or counts["cut"]) and env.is_main:  # a context too short should not pass unnoticed
            warn(f"{counts['dropped']} training conversations longer than a row of {config.model.sequence_len + 1} "
                  f"tokens were dropped (no assistant token fits) and {counts['cut']} cut; "
                  f"{counts['conversations']} are trained on")
        loader = ChatLoader(data.train, config.train.batch_size, seed=config.train.seed, rank=env.rank,
                            world_size=env.world_size)
    else:
        data = in_turns(prepare_data, config, tokenizer, progress and env.is_main)
        together(check_validation_split, data.val, config)
        loader = together(TokenLoader, data.train, config.train.batch_size, config.model.sequence_len,
                          seed=config.train.seed, rank=env.rank, world_size=env.world_size)
        round_windows = config.train.batch_size * env.world_size
        if loader.num_windows < round_windows and env.is_main:  # it trained on, each batch repeating, unsaid
            warn(f"the train split holds {loader.num_windows:,} windows of {config.model.sequence_len + 1} tokens, "
                 f"fewer than one batch of {round_windows:,}: every batch repeats windows (add data, or lower "
                 f"--batch-size or sequence_len)")
    model = build_model(config.model)  # the same init on every rank (same seed)
    init_report = None
    if init_from is not None and not resume:  # a resumed run's weights are its checkpoint's
        init_report = together(initialise_from, model, init_from, grow_vocab=sft, new_ids=added_ids)
    model = model.to(device)
    objective = build_objective(config.model, config.train)
    flops = FlopsMemo(model)
    objective.flops_per_token(flops)  # every kind of forward the run takes, counted once on the plain model
    if env.rank > 0:  # training noise: each rank its own stream (rank 0 continues the single-process one)
        torch.manual_seed(rank_seed(config.train.seed, env.rank))
    # the model and its loss as one module: compiled whole (train.compile), the loss is in the graph
    forward_model = wrap_model(model, config.train, device, root=ModelAndLoss(model, objective),
                               graphs=compiled_step_graphs(objective))
    # after fsdp2 sharded the parameters; Muon's iteration in the dtype of the run's products
    # every rank refuses a bad setting alike (a muon_exclude typo): together, so it is said once
    optimizers = together(get_arch(config.model.arch).build_optimizers, model, config.train,
                          resolve_dtype(device, config.train.dtype))
    state = TrainState(config, run_dir, model, tokenizer, data, loader, objective, optimizers, device,
                       init_report=init_report, dist=env, flops=flops,
                       init_from=None if init_from is None else str(Path(init_from).resolve()))
    state.forward_model = forward_model
    state.given_strategy = given_strategy

    changes = on_main(_claim_run_folder, state, resume, given_strategy)
    try:
        if resume:
            resume_run(state)
            if state.step > config.train.steps:  # it "trained" nothing and saved the checkpoint with the lower count
                # every rank resumed the same step and raises alike: shared, said once
                raise raised_alike(ConfigError(f"train.steps={config.train.steps:,} is below the step {state.step:,} "
                                               f"this run resumes at: give --steps {state.step:,} or more"))
            # said and kept only once the run resumed: a resume that fails changes nothing in the folder
            on_main(_keep_train_changes, state, changes or [])
    except BaseException:
        if state.lock is not None:
            state.lock.release()
        raise
    if progress and env.is_main:
        note(precision_note(device, config.train.dtype, emulate=not config.train.compile))
    train = config.train
    if train.warmup_steps >= train.steps and not resume and env.is_main:  # e.g. a short try at warmup's default
        warn(f"train.warmup_steps={train.warmup_steps} is not below train.steps={train.steps}: the learning rate "
             f"only warms up (to {train.steps / train.warmup_steps:.0%} of its peak) and never decays; set "
             f"train.warmup_steps lower")
    if env.world_size > 1 and env.is_main:
        note(f"{env.world_size} processes ({train.strategy}, {env.backend}): global batch = {train.batch_size} "
              f"x {state.accumulation} accumulation x {env.world_size} processes = {state.global_batch} sequences "
              f"({state.global_batch * config.model.sequence_len:,} tokens) per step")
    return state


def _run_root(path: str | Path) -> Path:
    """The run folder a path names: itself, or the run of a checkpoint folder in its checkpoints/ (an
    --init-from of the base run's checkpoint and of the base run are the same base)."""
    path = Path(path).resolve()
    return path.parent.parent if path.parent.name == "checkpoints" else path


def check_tokenizer_of_base(tokenizer, init_from: str | Path) -> None:
    """--init-from trains the base run's token rows: the run's tokenizer must give every id the base
    knew the token it had there (ids past them may follow: SFT's chat tokens are added after this).
    Another tokenizer (`--tokenizer`, `--set data.tokenizer=`) loaded the rows under ids that mean other
    tokens, without a word, wherever the vocabularies' sizes happened to fit."""
    checkpoint = resolve_checkpoint(init_from)
    file = find_tokenizer_file(checkpoint)
    base = load_tokenizer(str(file))
    mismatch = None
    if tokenizer.vocab_size < base.vocab_size:
        mismatch = f"has {tokenizer.vocab_size:,} ids, the base's {base.vocab_size:,}"
    elif tokenizer.bos_id != base.bos_id:
        mismatch = f"has BOS at id {tokenizer.bos_id}, the base's at {base.bos_id}"
    else:
        differing = next((i for i in range(base.vocab_size) if tokenizer.token_to_bytes(i) != base.token_to_bytes(i)),
                         None)
        if differing is not None:
            mismatch = (f"gives id {differing} the token {tokenizer.token_to_bytes(differing)!r}, the base "
                        f"{base.token_to_bytes(differing)!r}")
    if mismatch is not None:
        raise ConfigError(f"--init-from {checkpoint}: this run's tokenizer {mismatch} ({file}): train with the "
                          f"base's tokenizer (leave --tokenizer and data.tokenizer out), or without --init-from")


def _check_resumed_init_from(run_dir: Path, init_from: str | Path) -> None:
    """`--resume` with `--init-from`: the run's own command again (an SFT or extend run names its base)
    is accepted, and nothing is initialised (the checkpoint's weights are the run's); another run is
    refused. Its weights were loaded and then replaced by the checkpoint's, while the run said
    "initialised from" it."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        return
    # {} where it does not read: that is the resume's to report (it falls back to an older checkpoint)
    state = read_json_object(checkpoints[-1] / "state.json")
    if "init_from" not in state:
        return  # saved before runs recorded their base: nothing to compare, and nothing is initialised
    started = state["init_from"]
    if not isinstance(started, str) or _run_root(started) != _run_root(init_from):
        began = f"started from {started}" if isinstance(started, str) else "started from fresh weights"
        raise ConfigError(f"cannot resume {run_dir} with --init-from {init_from}: the run {began}, and a resumed "
                          f"run continues from its own checkpoint; drop --init-from, or start a new run (a new "
                          f"--out) from {init_from}")


def _run_tokenizer(run_dir: Path) -> str:
    """A resumed run's tokenizer.json: the run folder's, else the newest checkpoint's checked copy
    (a missing run-folder copy was reported as an unknown tokenizer name)."""
    own, checkpoints = run_dir / "tokenizer.json", list_checkpoints(run_dir)
    if own.is_file() or not checkpoints:
        return str(own)
    return str(find_tokenizer_file(checkpoints[-1]))


def _keep_train_changes(state: TrainState, changes: list[str]) -> None:
    """Rank 0, after a resume: the train settings that changed are said, and the run's config.json
    holds them from the next checkpoint on (each checkpoint copies it: a later plain --resume keeps
    them; until then a resume without them runs as before, and one with them says them again)."""
    moved = [change for change in changes if change.startswith(f"{MOVED_DATA}:")]
    changes = [change for change in changes if change not in moved]
    for change in moved:
        note(f"resuming on data given by another path ({change.split(': ', 1)[1]}): its token shards are the "
             f"checkpoint's (sha256), so the run goes on with the data it was trained on")
        state.config_unsaved = True
    if not changes:
        return
    note(f"resuming with changed train settings ({'; '.join(changes)}): they apply from the resumed step on "
         f"(optimizer settings too; the saved moments are kept)")
    if any(change.split(":")[0] in SCHEDULE_FIELDS for change in changes):
        note("the lr schedule (and any recipe that follows the run's length) is computed for the new settings "
             "from the resumed step on: past the warmup the run does not follow a straight run's lr")
    state.config_unsaved = True


def _claim_run_folder(state: TrainState, resume: bool, strategy: str) -> list[str]:
    """Rank 0: create and lock the run folder; a new run writes its config (train.strategy as given,
    `strategy`), tokenizer and an empty log. Returns the train settings a resume changes
    (`check_run_folder`)."""
    run_dir, config = state.run_dir, state.config
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create output folder {run_dir}: {exc.strerror or exc}") from None
    state.lock = RunLock(run_dir).acquire()
    try:
        # again, locked: another run may have started here meanwhile
        changes = check_run_folder(run_dir, config, resume, strategy)
        if not resume:
            log = run_dir / "metrics.jsonl"
            kept = []
            if log.is_file() and log.stat().st_size:  # the rows of a run that stopped before its first save
                kept.append(stopped_log_path(run_dir))
                log.replace(kept[-1])
            # and its trackers' files: TensorBoard drew the dead run's steps beside the new run's, and W&B
            # continued the dead run's id (dropping the new run's rows for the steps it had logged)
            for tracker_dir in (TENSORBOARD_DIR, WANDB_DIR):
                if (run_dir / tracker_dir).is_dir():
                    kept.append(stopped_log_path(run_dir, f"{tracker_dir}-stopped"))
                    (run_dir / tracker_dir).replace(kept[-1])
            if kept:
                note(f"{run_dir} held a run that stopped before its first checkpoint: starting again (kept as "
                     f"{', '.join(path.name for path in kept)})")
            write_json_atomic(run_dir / "config.json", config_as_given(config, strategy))
            try:
                state.tokenizer.save(run_dir)
                (run_dir / "metrics.jsonl").write_text("")
            except OSError as exc:
                raise OutputError(f"cannot write into {run_dir}: {exc.strerror or exc}") from None
    except BaseException:
        state.lock.release()
        raise
    return changes

