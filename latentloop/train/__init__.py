"""Training as functions: `setup` -> `fit` (which calls `validate` and `save`), as litgpt's pretrain.

    state = setup(run_config, "runs/name")          # validates everything before writing anything
    summary = fit(state)                             # progress bar, JSONL metrics, checkpoints
    metrics = validate(state)                        # val loss / ppl / bpb

Stages (`train.stage`): `pretrain`; `sft` (from `init_from`, on `chat:` data: the tokenizer gains
the chat tokens, the embedding and head grow by `checkpoint.grow_vocab_rows`, batches carry a loss
mask of the assistant's tokens that every objective honours, validation is the masked loss on
held-out conversations); `extend` (from `init_from`, at a longer `sequence_len` with the RoPE base
scaled by `config.extended_rope_theta`; `stage_config` builds both from the base run's config).

The trainer knows models only through `forward` and objectives only through the `Objective`
interface, so each architecture brings its own training procedure.

Many processes (`torchrun --nproc_per_node N -m latentloop train ...`: ddp unless train.strategy says
otherwise):
every process runs these same functions on its own rank's batches (`TokenLoader` shards the global
order), so one step sees micro-batch x grad_accum x world_size sequences. Rank 0 alone prints,
logs and writes the run folder's shared files; the others follow. Every phase that can fail on
bad input ends with the processes agreeing on the outcome (`runtime.agree`), so an error on one
rank stops them all with its one line, printed once. The objectives' random draws (fbt's pass
count and prefix boundaries, rgpt's depth) are seeded by (seed, step) and so the same on every
rank; training noise (fbt's jitter, rgpt's noise) comes from each rank's own torch RNG stream.
"""

from .loop import FiniteGuard, StepOutcome, fit, train_step, validate
from .resume import save
from .stages import STAGE_DEFAULTS, stage_config
from .start import setup
from .state import FlopsMemo, TrainState, rank_seed

__all__ = ["STAGE_DEFAULTS", "FiniteGuard", "FlopsMemo", "StepOutcome", "TrainState", "fit", "rank_seed", "save",
           "setup", "stage_config", "train_step", "validate"]
