"""lm-evaluation-harness adapter: any latentloop run as an lm-eval model named `latentloop`.

    pip install 'latentloop[lm-eval]'
    python -m latentloop.eval.lm_eval_adapter --model latentloop \\
        --model_args pretrained=runs/fbt,regime=soft --tasks arc_easy --limit 100
    # the same arguments work with a console script `latentloop-lm-eval` where one is installed

lm-eval finds models only in its own registry and offers no plugin entry point for them, so the
plain `lm_eval` command cannot see this one; this module registers `latentloop` when imported and
runs lm-eval's own command line (`main`). From Python: `import latentloop.eval.lm_eval_adapter`,
then `lm_eval.simple_evaluate(model="latentloop", model_args="pretrained=RUN,regime=soft", ...)`.

model_args: `pretrained` (run or checkpoint folder, required), `device` (cpu, cuda, ...),
`batch_size` (rows per forward), `max_gen_toks` (default for generate_until), and the decoding
options of `latentloop eval`: `regime` (fbt standard/soft/fused), `passes` (fused: int or auto),
`steps` (rgpt depth), `prefill` (lrt sequential/interleaved).

Requests:
- `loglikelihood(context, continuation)`: the context as a prompt (`tokenizer.as_prompt`: after
  BOS where the tokenizer starts texts with one, an empty context as [BOS]), then the continuation
  scored as generated text under the chosen regime, by `latentloop.eval.core.score_continuations`
  (the CORE scorer; trailing spaces of the context move to the continuation, as lm-eval expects). A pair
  that needs more inputs than the model's context (`sequence_len`, T) is scored on its last T
  inputs, as lm-eval's Hugging Face model cuts;
- `loglikelihood_rolling(text)`: lm-eval's rolling windows (`get_rolling_token_windows` with
  `context_len=1`, then `make_disjoint_window`): the text's tokens scored in disjoint chunks of T
  targets, each read after the T inputs before its last target: the first chunk after BOS, a
  later full chunk after the last token of the chunk before, the last (partial) chunk after as
  many earlier tokens as fill T inputs; the totals are the sums over the chunks;
- `generate_until(context, {until, max_gen_toks, do_sample, temperature})`: batched generation with
  the engine, stopped at the end token or at the first `until` string, which is cut off.

A local task YAML over a file of `../shared/data/eval` is in `latentloop/eval/lm_eval_tasks/`
(`TASKS_DIR`): `latentloop-lm-eval` adds it as `--include_path` unless given one; plain `lm_eval`
needs `--include_path` with that folder.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..archs import option_union
from ..engine import fit_prompt, model_options
from ..errors import ConfigError, LatentloopError
from ..util import first_line, warn_once
from .core import DEFAULT_BATCH_SIZE, score_continuations

MODEL_NAME = "latentloop"
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
LM_EVAL_UNKNOWN_TASKS = "Tasks not found"  # how lm-eval's ValueError for a task name it does not know begins

try:  # lm_eval is optional: without it this module still imports (for docs and tests)
    from lm_eval.api.model import LM as _LMBase

    HAVE_LM_EVAL = True
    LM_EVAL_IMPORT_ERROR = ""
except ImportError as exc:  # pragma: no cover - depends on the environment
    _LMBase = object
    HAVE_LM_EVAL = False
    LM_EVAL_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"  # why, for the message (installed but broken)


LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # what lm-eval's command line passes when --device is not given


def _available_device(name: str | None):
    """The device asked for; lm-eval's default `cuda:0` falls back to the CPU, silently, where there
    is no GPU. Any other device that is not there is refused (`resolve_device`), a cuda one included:
    it ran on the CPU, where a named mps was refused."""
    import torch

    from ..runtime import resolve_device

    name = name or "cpu"
    if name == LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available():
        name = "cpu"
    return resolve_device(name)


# lm-eval's names for the most new tokens of a generate_until request, in the order it reads them
# (its `normalize_gen_kwargs`)
NEW_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


def _positive(name: str, value) -> int:
    """A model_args / gen_kwargs count: a whole number >= 1 (batch_size=-1 generated nothing, 0 and
    max_gen_toks=abc ended in a traceback)."""
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    return number


class LatentloopLM(_LMBase):
    """lm-eval's `LM` interface over a latentloop run, under one set of decoding options."""

    def __init__(self, pretrained: str | None = None, device: str | None = "cpu", batch_size: int | str | None = None,
                 max_batch_size: int | None = None, max_gen_toks: int = 256, model=None, tokenizer=None, **extra):
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ConfigError("model_args needs pretrained=RUN (a latentloop run or checkpoint folder)")
            from ..runs import load_run

            model, tokenizer, _, _ = load_run(pretrained, _available_device(device))
        elif tokenizer is None:
            raise ConfigError("give the tokenizer together with the model")
        self.model, self.tokenizer = model.eval(), tokenizer
        # model_args beyond lm-eval's own are the architecture's declared options (regime, passes,
        # prefill, steps, cache_mode, exit_threshold, ...), parsed from their text as the CLI does
        declared = {option.name: option for option in self.model.OPTIONS}
        unknown = sorted(name for name in extra if name not in option_union())
        if unknown:  # a typo (regmie=standard) scored the run under the default options, without a word
            raise ConfigError(f"unknown model_args {', '.join(unknown)}: this adapter takes pretrained, device, "
                              f"batch_size, max_batch_size, max_gen_toks and the architecture's options "
                              f"({', '.join(declared) or 'none'})")
        given = {name: value for name, value in extra.items() if name in option_union()}
        self.options = {name: declared[name].parse(value) if name in declared else value
                        for name, value in given.items() if value is not None}
        model_options(self.model, self.options)
        size = batch_size if batch_size not in (None, "auto") and not str(batch_size).startswith("auto") else None
        self.batch_size_rows = _positive("batch_size", size) if size is not None else DEFAULT_BATCH_SIZE
        if max_batch_size is not None:
            self.batch_size_rows = min(self.batch_size_rows, _positive("max_batch_size", max_batch_size))
        self.max_gen_toks = _positive("max_gen_toks", max_gen_toks)
        self.max_length = int(model.config.sequence_len)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> LatentloopLM:
        """lm-eval's constructor call (its command line parses `--model_args` into a dict): the
        model_args, with lm-eval's own `--batch_size`, `--max_batch_size` and `--device` where they do
        not name them (lm-eval passes both: batch_size=4 or device=cpu in model_args was a TypeError's
        traceback)."""
        given = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **given)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LatentloopLM:
        """`create_from_arg_obj` from model_args as text ("pretrained=RUN,batch_size=4")."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """lm-eval asks for it with --apply_chat_template, before any request: refused in one line
        (its default NotImplementedError was a traceback after the model had loaded)."""
        if chat_template:
            raise ConfigError("--apply_chat_template is not supported by the latentloop adapter (it scores raw "
                              "text); for an SFT run's chat format, serve it and use lm-eval's "
                              "local-chat-completions model against `latentloop serve`")
        return ""

    @staticmethod
    def _seed() -> int:
        """A sampled generation's seed where gen_kwargs gives none: the one lm-eval's --seed gave torch
        (it seeds torch's global generator; a fixed 0 made every run draw alike whatever --seed said)."""
        import torch

        return torch.initial_seed() % (2**63)

    # -- lm-eval bookkeeping ----------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return f"latentloop-{getattr(self.tokenizer, 'name', type(self.tokenizer).__name__)}"

    def _cache(self, kind: str, args: Any, result: Any) -> None:
        hook = getattr(self, "cache_hook", None)
        if hook is not None:
            hook.add_partial(kind, args, result)

    # -- encoding ---------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens as a prompt, continuation tokens): `tokenizer.as_prompt` puts BOS before the
        context where the tokenizer starts texts with it (an empty context is [BOS] either way);
        trailing spaces of the context move to the continuation, and the continuation is what the
        joint tokenization adds to the context."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return self.tokenizer.as_prompt([]), self.tokenizer.encode(continuation)
        context_ids = self.tokenizer.encode(context)
        whole = self.tokenizer.encode(context + continuation)
        prompt = self.tokenizer.as_prompt(context_ids)
        if whole[:len(context_ids)] == context_ids:
            return prompt, whole[len(context_ids):]
        return prompt, self.tokenizer.encode(continuation)

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, targets) windows whose targets are `tokens` in disjoint chunks of max_length
        (T): each window's context + targets[:-1] are the (up to) T inputs before its last target in
        [BOS] + tokens, so the first context is [BOS], a later full chunk's the token before it, and
        the last chunk's as many tokens before it as make T inputs (lm-eval's rolling windows with
        context_len=1, made disjoint). The first target needs an input before it: BOS, whether or not
        the tokenizer starts prompts with one (lm-eval's models read their prefix token there too)."""
        span = self.max_length
        sequence = [self.tokenizer.bos_id, *tokens]
        windows = []
        for start in range(0, len(tokens), span):
            end = min(start + span, len(tokens))  # targets tokens[start:end], at sequence[start + 1:end + 1]
            first_input = max(0, end - span)  # the inputs are sequence[first_input:end]
            windows.append((sequence[first_input:start + 1], tokens[start:end]))
        return windows

    # -- the three request types ------------------------------------------------------------
    def _score(self, rows: list[tuple[list[int], list[int]]], disable_tqdm: bool, desc: str):
        bar = tqdm(total=len(rows), desc=desc, disable=disable_tqdm)
        try:
            return score_continuations(self.model, rows, self.options, self.batch_size_rows, on_batch=bar.update)
        finally:
            bar.close()

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args) for req in requests]
        for _, continuation in pairs:  # as lm-eval's HFLM: scored in part, it was a wrong number
            if len(continuation) > self.max_length:
                raise ConfigError(f"a continuation of {len(continuation):,} tokens is longer than the model's context "
                                  f"of {self.max_length:,}: its log-likelihood cannot be scored in one window")
        scored = [i for i, (_, cont) in enumerate(pairs) if cont]
        scores = self._score([pairs[i] for i in scored], disable_tqdm, "latentloop loglikelihood")
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)  # an empty continuation is certain
        for i, score in zip(scored, scores):
            results[i] = (score.logprob, score.greedy)
        for req, result in zip(requests, results):
            self._cache("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows, owners = [], []
        for n, req in enumerate(requests):
            for window in self.rolling_windows(self.tokenizer.encode(req.args[0])):
                rows.append(window)
                owners.append(n)
        totals = [0.0] * len(requests)
        for owner, score in zip(owners, self._score(rows, disable_tqdm, "latentloop rolling")):
            totals[owner] += score.logprob
        for req, total in zip(requests, totals):
            self._cache("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1] or {}, sort_keys=True, default=str), []).append(i)
        outputs: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="latentloop generate", disable=disable_tqdm)
        for key, members in groups.items():
            kwargs = dict(json.loads(key))
            for start in range(0, len(members), self.batch_size_rows):
                batch = members[start:start + self.batch_size_rows]
                texts = self.generate_batch([requests[i].args[0] for i in batch], kwargs, indices=batch)
                for i, text in zip(batch, texts):
                    outputs[i] = text
                    self._cache("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return outputs

    def generate_batch(self, contexts: Sequence[str], gen_kwargs: dict,
                       indices: Sequence[int] | None = None) -> list[str]:
        """Greedy (or sampled, with do_sample) continuations of contexts, cut at the first stop string.
        Sampled, context i draws with the seed `seed` + `indices[i]` (its request's index: the same
        draws whatever the batch size; default its index here)."""
        from .generation import generate_texts

        until = gen_kwargs.get("until") or []
        stops = [until] if isinstance(until, str) else list(until)
        asked = next((gen_kwargs[key] for key in NEW_TOKEN_KEYS if gen_kwargs.get(key) is not None), self.max_gen_toks)
        # at most half the context: clamped to the context, a request for as many tokens as the context
        # (gsm8k's default 256 on a 256-token model) left its prompt one token, not even BOS
        new_tokens = min(_positive("max_gen_toks", asked), max(1, self.max_length // 2))
        if new_tokens < int(asked):
            warn_once(f"max_gen_toks {asked} is more than half the model's context of {self.max_length} tokens: "
                      f"generating {new_tokens}, so that the prompt keeps the other half")
        budget = self.max_length - new_tokens
        # lm-eval's reading: do_sample absent and a positive temperature samples
        temperature = float(gen_kwargs.get("temperature") or 0.0)
        do_sample = gen_kwargs.get("do_sample")
        sample = temperature > 0 if do_sample is None else bool(do_sample)
        temperature = (temperature or 1.0) if sample else 0.0
        tokenizer = self.tokenizer
        prompts = [fit_prompt(tokenizer.as_prompt(tokenizer.encode(context)), budget, tokenizer.bos_id)[0]
                   for context in contexts]
        generations = generate_texts(self.model, self.tokenizer, prompts, new_tokens, stops=[s for s in stops if s],
                                     options=self.options, temperature=temperature, top_p=gen_kwargs.get("top_p"),
                                     top_k=gen_kwargs.get("top_k"), seed=int(gen_kwargs.get("seed", self._seed())),
                                     batch_size=max(1, len(prompts)), seed_offsets=indices)
        return [generation.text for generation in generations]


def register() -> bool:
    """Make `latentloop` known to lm-eval's model registry; False where lm_eval is not installed."""
    if not HAVE_LM_EVAL:
        return False
    from lm_eval.api import registry

    try:  # lm-eval fills its registry with its own models only while it is empty: fill it first
        import lm_eval.models  # noqa: F401
    except ImportError:  # pragma: no cover - a broken optional backend must not stop ours
        pass
    known = getattr(registry, "model_registry", None)
    if known is None:
        known = getattr(registry, "MODEL_REGISTRY", {})
    if MODEL_NAME not in known:
        registry.register_model(MODEL_NAME)(LatentloopLM)
    return True


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with `latentloop` registered (`python -m latentloop.eval.lm_eval_adapter`)."""
    if not register():
        why = f" (importing it failed: {LM_EVAL_IMPORT_ERROR})" if LM_EVAL_IMPORT_ERROR else ""
        print(f"latentloop: error: lm_eval is not installed (pip install 'latentloop[lm-eval]'){why}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(arg == "--include_path" or arg.startswith("--include_path=") for arg in args):
        # the bundled tasks wherever the package is installed (a path relative to the repository's
        # root found nothing outside a checkout); a user's own --include_path replaces it
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = [sys.argv[0], *args]
    try:
        cli_evaluate()
    except LatentloopError as exc:  # a run that is not there, a bad option, data missing: one line
        print(f"latentloop: error: {first_line(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        if not str(exc).startswith(LM_EVAL_UNKNOWN_TASKS):
            raise
        print(f"latentloop: error: {first_line(exc)} (the bundled tasks are in {TASKS_DIR}; `lm_eval --tasks list` "
              f"lists the others)", file=sys.stderr)
        return 2
    return 0


register()

__all__ = ["HAVE_LM_EVAL", "LatentloopLM", "MODEL_NAME", "TASKS_DIR", "main", "register"]

if __name__ == "__main__":
    sys.exit(main())
