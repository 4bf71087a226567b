"""Local lm-evaluation-harness tasks over the CORE jsonl files (`latentloop-lm-eval` includes this folder; plain
`lm_eval` needs `--include_path` with it: `latentloop.eval.lm_eval_adapter.TASKS_DIR`).

- `latentloop_copa` (multiple choice: loglikelihood of each choice),
- `latentloop_lambada` (loglikelihood: perplexity and greedy accuracy of the last word),
- `latentloop_lambada_rolling` (loglikelihood_rolling: perplexity and bits per byte of the passages),
- `latentloop_arithmetic` (generate_until: exact match of `simple_arithmetic_nospaces`).

The files are read from `--metadata '{"eval_dir": PATH}'`, else `$LATENTLOOP_EVAL_DIR`, else the
cached CORE bundle, else `../shared/data/eval` next to the project.
"""
