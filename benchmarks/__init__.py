"""Benchmarks, run from the repository root as modules (`python -m benchmarks.NAME`), importing
latentloop as users do: `baseline` (gpt training and decode), `variants` (fbt, lrt, rgpt together) or
one of `fbt`, `lrt`, `rgpt`, `serve_load` (the server under load), `kill_trials` (checkpoint
robustness). Timing primitives and formatting live in `common`."""
