"""Export a latentloop run as a Hugging Face model folder.

    export_hf("runs/gpt-llama", "hf/gpt-llama")     # plain LlamaForCausalLM (or Qwen2ForCausalLM)
    export_hf("runs/fbt", "hf/fbt")                 # latentloop's own modeling code (trust_remote_code)

Two paths:
- plain: a `gpt` run whose options are the Llama family's (SwiGLU, no QK-norm, no embedding norm,
  no soft-cap) becomes a `LlamaForCausalLM` folder (`MistralForCausalLM` with its sliding window, an
  imported Mistral's), or `Qwen2ForCausalLM` with q/k/v biases (and its window, if any): loads
  with `AutoModelForCausalLM.from_pretrained(DIR)`, no remote code. Parameter-free norms export as
  gains of 1 (exactly the same function) with the epsilon torch used (float32's machine epsilon
  when the run left `norm_eps` unset). The q/k RoPE half-flip of the import is applied again (it
  is its own inverse).
- custom code: anything else (the variants, or a gpt with nanochat options) is written with
  `configuration_latentloop.py` and `modeling_latentloop.py` from `latentloop/interop/hf_remote/`
  (a wrapper that knows no architecture), copies of the package files the architecture's model needs
  (`package_sources`: its model file and everything it imports, imports made local to the folder)
  and a generated `latentloop_arch.py` naming its model and config classes; the tensors are the
  package's state dict under `model.`. Self-contained (transformers, torch and pyyaml, not
  latentloop): `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`, whose
  `generate()` decodes with the architecture's latent state (see that module's docstring). A new
  architecture exports with no code here.

Either way the folder holds config.json, model.safetensors, generation_config.json (`eos_token_id`:
every id latentloop's own decoding stops at, `stop_token_ids`), the tokenizer (`tokenizer.json` +
`tokenizer_config.json`, loadable by `AutoTokenizer`; latentloop's own tokenizers prepend BOS) and a
model card, README.md (`model_card`): the architecture and its options, the training data and tokens
(an imported model's: where it came from), the final metrics of the run's log and how to load the
folder. The run is checked as `runs.load_run` checks it before the model is built (the tokenizer
against the config, the weights' header against the config on the meta device, sharded-only weights).
The folder is written into a hidden folder beside the output folder and renamed into place at the end
(inside it, the files then moved up, when --out is an existing empty folder, which is kept): a failed
export leaves nothing behind.
The remote-code folders need transformers 5 (the plain ones load on 4.x too).
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..archs import build_model, get_arch
from ..checkpoint import (
    REMOTE_MODEL_TYPE,
    check_full_weights,
    check_tokenizer_fits,
    check_weights_fit,
    find_tokenizer_file,
    load_weights,
    prompting_as_its_model,
    read_run_config,
    read_weights,
    resolve_checkpoint,
    verify_file,
)
from ..config import ModelConfig
from ..data.tokenizers import load_tokenizer, write_hf_tokenizer
from ..errors import ConfigError, InteropError, LatentloopError, OutputError
from ..util import first_line, give_default_mode, is_int, read_json_object, staged_folder
from .hf_import import (
    EXPORT_STAGING_PREFIX,
    GENERATION_DEFAULTS_KEY,
    check_out_folder,
    hf_to_latentloop_names,
    rope_half_flip,
)

REMOTE_DIR = Path(__file__).resolve().parent / "hf_remote"
REMOTE_FILES = ("configuration_latentloop.py", "modeling_latentloop.py")
AUTO_MAP = {"AutoConfig": "configuration_latentloop.LatentloopConfig",
            "AutoModelForCausalLM": "modeling_latentloop.LatentloopForCausalLM"}
PLAIN_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DEFAULT_NORM_EPS = torch.finfo(torch.float32).eps  # what F.rms_norm uses on float32 when given no epsilon
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # latentloop/
ARCH_MODULE = "latentloop_arch.py"  # generated: the exported architecture's classes
STAGING_PREFIX = EXPORT_STAGING_PREFIX  # the hidden folder beside (or inside) --out an export is written into
# the remote code loads on transformers 5 only (4.x's loader cannot copy the package files beside it); the
# plain Llama / Qwen2 folders load on 4.x too
REMOTE_TRANSFORMERS = "5.0.0"


def flat_name(module: str) -> str:
    """The file a package module becomes in the flat export folder, without `.py`: `latentloop.config`
    -> `config`, `latentloop.models.backbone` -> `backbone`, `latentloop.archs.fbt.model` -> `fbt_model`
    (an architecture's files are named by their package: every one has a `model.py`)."""
    if module.split(".")[0] != "latentloop":  # an architecture registered from outside the package
        return module.replace(".", "_")
    parts = module.split(".")[1:]
    return "_".join(parts[1:]) if parts[0] == "archs" else parts[-1]


def _imported_modules(node: ast.ImportFrom, package: str) -> list[str]:
    """The modules to copy that a `from ... import` in a module of `package` loads: latentloop's, and
    any relative import (a module of the same package); for `from . import a`, the names are the modules."""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - (node.level - 1)])
        module = f"{base}.{node.module}" if node.module else base
    else:
        module = node.module or ""
        if module.split(".")[0] != "latentloop":  # another library's (torch, ...): not copied
            return []
    return [f"{module}.{alias.name}" for alias in node.names] if node.module is None else [module]


def _flattened(text: str, package: str) -> str:
    """`text` (a module of `package`) with each latentloop import rewritten to the flat folder's names."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and _imported_modules(node, package)]
    for node in sorted(imports, key=lambda n: n.lineno, reverse=True):
        indent = lines[node.lineno - 1][:node.col_offset]
        if node.module is None and node.level:  # `from . import a as b`: modules
            statement = "; ".join(f"from . import {flat_name(m)} as {alias.asname or alias.name}"
                                  for m, alias in zip(_imported_modules(node, package), node.names))
        else:
            names = ", ".join(alias.name + (f" as {alias.asname}" if alias.asname else "") for alias in node.names)
            statement = f"from .{flat_name(_imported_modules(node, package)[0])} import {names}"
        lines[node.lineno - 1:node.end_lineno] = [indent + statement + "\n"]
    return "".join(lines)


def package_sources(model_class: type, config_class: type) -> dict[str, str]:
    """File name -> text of the package modules an exported model runs on: the modules of
    `model_class` and `config_class`, the options checker, and every latentloop module they import
    (relative imports, lazy ones included), flattened into one folder (`flat_name`) with their imports
    rewritten to it; plus the generated `latentloop_arch.py`, which names the two classes and imports
    every module by name, so that transformers' loader (which copies the files a module imports with
    `from .name import`) copies them all."""
    wanted = [model_class.__module__, config_class.__module__, "latentloop.models.options"]
    found: dict[str, Path] = {}
    while wanted:
        module = wanted.pop()
        if module in found:
            continue
        path = Path(importlib.import_module(module).__file__)
        found[module] = path
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                wanted.extend(_imported_modules(node, package))
    files: dict[str, str] = {}
    for module, path in found.items():
        name = flat_name(module) + ".py"
        if name in files or name in REMOTE_FILES + (ARCH_MODULE,):
            raise InteropError(f"cannot export: two package modules flatten to {name}")
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        files[name] = _flattened(path.read_text(), package)
    modules = sorted(name.removesuffix(".py") for name in files)
    files[ARCH_MODULE] = "\n".join([
        '"""Generated by `latentloop export`: the architecture of this folder, and every package file it runs on."""',
        "",
        f"from .{flat_name(model_class.__module__)} import {model_class.__name__} as MODEL_CLASS",
        f"from .{flat_name(config_class.__module__)} import {config_class.__name__} as CONFIG_CLASS",
        "",
        "# imported by name so that transformers copies each file along (it follows `from .name import`)",
        *[f"from .{name} import __name__ as _{name}_module  # noqa: F401" for name in modules],
        "",
        '__all__ = ["CONFIG_CLASS", "MODEL_CLASS"]',
        ""])
    return files


def plain_blockers(config: ModelConfig) -> list[str]:
    """The options that keep a run from being a plain Llama / Qwen2 model (empty: none)."""
    blockers = [] if get_arch(config.arch).model_class.EXPORTS_AS_LLAMA else [f"arch={config.arch}"]
    if config.qk_norm:
        blockers.append("qk_norm=true")
    if config.embed_norm:
        blockers.append("embed_norm=true")
    if config.mlp != "swiglu":
        blockers.append(f"mlp={config.mlp}")
    if config.logit_softcap > 0:
        blockers.append(f"logit_softcap={config.logit_softcap:g}")
    return blockers


def _rope_config(config: ModelConfig) -> dict[str, Any]:
    """rope_theta / rope_scaling in the layout both transformers 4 and 5 read."""
    out: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_scaling": None}
    if config.rope_scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": config.rope_factor}
    elif config.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": config.rope_factor,
                               "low_freq_factor": config.rope_low_freq_factor,
                               "high_freq_factor": config.rope_high_freq_factor,
                               "original_max_position_embeddings": config.rope_original_max_positions}
    return out


def _plain_weights(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """latentloop gpt state dict -> Hugging Face Llama / Qwen2 names (the inverse of the import)."""
    D, hd = config.n_embd, config.head_dim
    filled = dict(state)
    for name in ["ln_f.weight"] + [f"blocks.{i}.ln_{j}.weight" for i in range(config.n_layer) for j in (1, 2)]:
        filled.setdefault(name, torch.ones(D))  # parameter-free norms: a gain of one is the same function
    out = {hf: filled[ll].contiguous() for hf, ll in hf_to_latentloop_names(config).items()}
    sizes = [config.n_head * hd, config.n_kv_head * hd, config.n_kv_head * hd]
    for i in range(config.n_layer):
        for part in ("weight", "bias") if config.qkv_bias else ("weight",):
            q, k, v = filled[f"blocks.{i}.attn.c_qkv.{part}"].split(sizes)
            prefix = f"model.layers.{i}.self_attn."
            out[prefix + f"q_proj.{part}"] = rope_half_flip(q, config.n_head).contiguous()
            out[prefix + f"k_proj.{part}"] = rope_half_flip(k, config.n_kv_head).contiguous()
            out[prefix + f"v_proj.{part}"] = v.contiguous()
    return out


def stop_token_ids(tokenizer) -> list[int]:
    """The ids latentloop's own decoding stops at, each once, EOS first: the tokenizer's stop ids, a
    chat tokenizer's end of turn (`latentloop.chat`, the server) and BOS (documents are packed as
    [BOS] + text, so BOS is what these models predict after one)."""
    chat = getattr(tokenizer, "chat_tokens", None)
    return list(dict.fromkeys([*tokenizer.stop_ids, *((chat.end,) if chat is not None else ()), tokenizer.bos_id]))


def _special_ids(tokenizer) -> dict[str, Any]:
    ends = stop_token_ids(tokenizer)  # several: a list, as Hugging Face configs write them
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": ends[0] if len(ends) == 1 else ends,
            "pad_token_id": tokenizer.pad_id}


# The weights' type an export may write (`export --dtype`): float32 keeps every bit the run trained;
# bfloat16 / float16 halve the folder, as Hub checkpoints are stored, rounding each weight once.
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_hf(run: str | Path, out: str | Path, plain: bool | None = None, show_progress: bool = False,
              dtype: str = "float32") -> dict[str, Any]:
    """Write `run` (its latest checkpoint) as a Hugging Face folder. plain=None: plain when the
    options allow it, else custom code; True: plain or a one-line error naming what blocks it;
    False: always custom code. `show_progress`: each stage named on stderr as it starts (loading
    and writing a large model take a while, and each is one call). `dtype`: the floating-point
    tensors' type in the folder and its config's `torch_dtype` (`EXPORT_DTYPES`). Returns a summary.

    The run is checked first as `runs.load_run` checks it (one `CheckpointError` line each): a
    checkpoint with sharded weights only, a tokenizer that does not fit the model's vocabulary or BOS,
    weights (checksum, NaN / inf, and their names and shapes against the config, on the meta device)
    that do not fit the config; the model is built only then. A symlinked `out` is written through
    to its target. The folder is written into a hidden staging folder beside `out` and renamed onto
    it at the end (an existing empty `out` is kept: staged inside it, the files moved up, config.json
    last): a failure (a full disk, ...) leaves nothing at `out` (an `OutputError` line), so a retry
    works."""
    def stage(text: str) -> None:
        if show_progress:
            print(f"export: {text}", file=sys.stderr, flush=True)

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    out = Path(out)
    target = check_out_folder(out)  # a symlinked --out: its target, resolved before any work
    checkpoint = resolve_checkpoint(run)
    # the checks `runs.load_run` makes, in its order, before anything as large as the model is read or built
    check_full_weights(checkpoint)
    run_config = read_run_config(checkpoint)
    config = run_config.model
    tokenizer_file = find_tokenizer_file(checkpoint)
    tokenizer = prompting_as_its_model(load_tokenizer(str(tokenizer_file)), checkpoint)  # an old import's too
    check_tokenizer_fits(tokenizer, config, tokenizer_file)
    blockers = plain_blockers(config)
    if plain and blockers:
        raise InteropError(f"cannot export as a plain Llama model: {', '.join(blockers)} (these are not Llama "
                           f"options; export without --plain to ship latentloop's modeling code)")
    as_plain = not blockers if plain is None else plain
    stage(f"loading {checkpoint}")
    weights = read_weights(checkpoint)  # checked against its checksum and for NaN / inf
    check_weights_fit(config, checkpoint, build_model, {name: tuple(t.shape) for name, t in weights.items()})
    model = build_model(config)
    load_weights(model, checkpoint, weights)
    del weights
    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    del model
    if as_plain:
        # a sliding window (an imported Mistral's or Qwen2's, kept by `attention_window`) is written as those
        # families write it: exported as Llama it was lost, and the model attended fully past it
        family = "qwen2" if config.qkv_bias else "mistral" if config.attention_window else "llama"
        hf_config = {
            "architectures": [PLAIN_CLASSES[family]], "model_type": family,
            "vocab_size": config.vocab_size, "hidden_size": config.n_embd, "intermediate_size": config.mlp_hidden,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.sequence_len,
            "rms_norm_eps": config.norm_eps if config.norm_eps is not None else DEFAULT_NORM_EPS,
            "tie_word_embeddings": config.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "use_cache": True, "torch_dtype": "float32", **_rope_config(config),
            **_special_ids(tokenizer)}
        window = config.attention_window or None
        if family == "qwen2":  # every layer slides (transformers' layer_types from max_window_layers on)
            hf_config.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
        elif family == "mistral":
            hf_config.update(sliding_window=window)
        weights = _plain_weights(state, config)
        kind = hf_config["architectures"][0]
        code: dict[str, str] = {}
    else:
        spec = get_arch(config.arch)
        # the defaults a user may edit in config.json; an option that applies only under another's
        # value (fbt's passes, under regime fused) is left out, so the defaults are always consistent
        decoding = {option.name: option.default for option in spec.options
                    if option.default is not None and option.applies_if is None}
        hf_config = {"architectures": ["LatentloopForCausalLM"], "model_type": REMOTE_MODEL_TYPE, "auto_map": AUTO_MAP,
                     "latentloop": config.to_dict(), "decoding": decoding, "torch_dtype": "float32",
                     "transformers_version": REMOTE_TRANSFORMERS, **_special_ids(tokenizer)}
        weights = {f"model.{name}": tensor.contiguous() for name, tensor in state.items()}
        code = package_sources(spec.model_class, spec.config_class)
        kind = "LatentloopForCausalLM (trust_remote_code)"
    weights = {name: t.to(EXPORT_DTYPES[dtype]) if t.is_floating_point() else t for name, t in weights.items()}
    overflowed = next((name for name, t in weights.items() if t.is_floating_point() and not t.isfinite().all()), None)
    if overflowed is not None:  # float16 tops out at 65,504: a larger weight became inf without a word
        raise InteropError(f"{overflowed} does not fit {dtype}: a weight beyond its range "
                           f"(±{torch.finfo(EXPORT_DTYPES[dtype]).max:,.0f}) would be written as inf; export in "
                           f"bfloat16 or float32")
    hf_config["torch_dtype"] = dtype
    size_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    params = sum(t.numel() for t in state.values())
    card = model_card(checkpoint, run_config, params, as_plain, kind)
    stage(f"writing {out / 'model.safetensors'} ({size_mb:,.1f} MiB) and the tokenizer")
    _write_folder(target, weights, hf_config, tokenizer, config.sequence_len, code, card,
                  generation_defaults(checkpoint))
    return {"run": str(run), "checkpoint": str(checkpoint), "out": str(out), "format": kind, "dtype": dtype,
            "plain_blockers": blockers, "model_card": str(out / "README.md")}


def _write_folder(out: Path, weights: dict[str, torch.Tensor], hf_config: dict[str, Any], tokenizer,
                  sequence_len: int, code: dict[str, str], card: str, generation_defaults: dict[str, Any]) -> None:
    """The export's files, written into a staging folder beside `out` and renamed onto it at the end
    (an existing empty `out`: staged inside it and moved up, `util.staged_folder`). On any failure the staging
    folder and every parent folder made for it are removed again; an I/O error (a full disk, no
    permission, ...) is one `OutputError` line."""
    try:
        with staged_folder(out, STAGING_PREFIX) as staging:
            if code:  # custom code: the wrapper and the package files the architecture runs on
                for name in REMOTE_FILES:
                    shutil.copyfile(REMOTE_DIR / name, staging / name)
                for name, text in code.items():
                    (staging / name).write_text(text)
            save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
            give_default_mode(staging / "model.safetensors")  # safetensors writes 0600: unreadable to colleagues
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
            generation = {**generation_defaults, **_special_ids(tokenizer)}  # an import's decoding, our ids
            (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            write_hf_tokenizer(tokenizer, staging, model_max_length=sequence_len)
            (staging / "README.md").write_text(card)
    except OSError as exc:
        raise OutputError(f"cannot write {out}: {exc.strerror or exc}") from None
    except SafetensorError as exc:  # safetensors reports its I/O errors (a full disk, ...) as its own
        raise OutputError(f"cannot write {out / 'model.safetensors'}: {first_line(exc)}") from None


# --------------------------------------------------------------------------------------------
# The model card
# --------------------------------------------------------------------------------------------


MAX_BASES = 16  # how far back `generation_defaults` follows runs trained from runs (a cycle ends there too)


def generation_defaults(checkpoint: Path) -> dict[str, Any]:
    """The recommended decoding an imported model came with (`hf_import`'s `GENERATION_DEFAULTS_KEY` in
    its checkpoint's state), for this checkpoint or the run it was trained from (`init_from`, and that
    run's base, ...): a fine-tune of an instruct model keeps its base's. {} where none is recorded or
    a base is no longer where it was."""
    for _ in range(MAX_BASES):
        state = read_json_object(checkpoint / "state.json")
        defaults, base = state.get(GENERATION_DEFAULTS_KEY), state.get("init_from")
        if isinstance(defaults, dict):
            return defaults
        if not isinstance(base, str):
            return {}
        try:
            checkpoint = resolve_checkpoint(base)
        except LatentloopError:  # moved or deleted since: nothing to inherit
            return {}
    return {}


def _run_facts(checkpoint: Path) -> tuple[dict, list[dict]]:
    """The checkpoint's state.json (step, tokens, FLOPs) and its run's metrics log (the rows up to
    the checkpoint's step), each empty where the checkpoint has none (an imported model)."""
    if (checkpoint / "state.json").is_file():
        verify_file(checkpoint, "state.json")  # a damaged or edited copy is one line, as every checkpoint file
    state = read_json_object(checkpoint / "state.json")  # {}: an older checkpoint unchecked, the card says "unknown"
    last = state.get("step")
    log = checkpoint.parent.parent / "metrics.jsonl"
    rows = []
    if log.is_file():
        for line in log.read_bytes().splitlines():
            try:
                # decoded strictly first: json.loads of bytes lets encoded surrogates through
                row = json.loads(line.decode("utf-8"))
            except ValueError:  # cut short by a crash, not JSON, or not UTF-8: the card reports the whole rows
                continue
            step = row.get("step") if isinstance(row, dict) else None
            # a step that is not an int (missing, null, text) is a damaged row: the card names each row's step
            if is_int(step) and (not is_int(last) or step <= last):
                rows.append(row)
    return state, rows


def _number(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


UNKNOWN = "unknown"  # what the card says for a fact state.json lacks or holds as something other than a number


def _finite(value: Any) -> bool:
    """A number the card can print: an int or a finite float (not a bool, text, null or JSON's 1e400)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(state: dict, name: str) -> int | None:
    """state[name] as a count (a non-negative int, or a float holding one), else None."""
    value = state.get(name)
    if _finite(value) and value >= 0 and float(value).is_integer():
        return int(value)
    return None


def _batch(train, sequence_len: int, state: dict) -> str:
    """The global batch as the trainer ran it (`train.step.accumulation`, which the interop package may
    not import): state.json's `global_batch` (sequences over every process) where it has one, else
    from the config: `train.batch_tokens` over micro-batch x sequence length x processes when set,
    else `train.grad_accum`."""
    world = _count(state, "world_size") if "world_size" in state else 1  # older checkpoints: one process
    if not world:
        return f"batch {UNKNOWN}"
    per_step = _count(state, "global_batch")
    if not per_step:
        per_micro = train.batch_size * sequence_len * world
        if not train.batch_tokens:
            per_step = train.batch_size * train.grad_accum * world
        elif train.batch_tokens % per_micro == 0:
            per_step = train.batch_tokens // sequence_len
        else:  # a config the trainer refuses: it never ran with it
            return f"batch {UNKNOWN}"
    accumulation, left = divmod(per_step, train.batch_size * world)
    split = f"{train.batch_size} x {accumulation} accumulation x {world} processes" if not left else \
        f"{world} processes"  # a config edited since: its micro-batch no longer divides the batch it ran
    return f"batch {per_step:,} sequences of {sequence_len} tokens ({per_step * sequence_len:,} tokens; {split})"


def _tokenizer_name(setting: str) -> str:
    """The run's `data.tokenizer` as the card names it: `byte`, or a tokenizer file's name only (its path
    is one on the machine that trained the run; the file itself ships in the folder as tokenizer.json)."""
    return "`byte`" if setting == "byte" else f"`{Path(setting).name}` (shipped as tokenizer.json)"


def _shown_path(source: str) -> str:
    """A run or model the card names (where an imported model came from, the run a fine-tune started
    from): a Hub name or relative path as it is, an absolute one by its last part only (it is a path on
    the machine that made the run)."""
    return Path(source).name if os.path.isabs(source) else source


# an absolute path inside a data source (`text:/home/me/My Data/corpus.txt`, `mix:/a/x.txt=0.3,...`): it
# starts the source or follows a `:`, `,` or `=`, and runs to the next of them
_SOURCE_PATH = re.compile(r"(?<![^,=:])/[^,=:]*")


def _shown_source(source: str) -> str:
    """A run's data source as the card names it: each absolute path by its last part only (a file,
    a glob or a folder: the folders above are the training machine's), the rest as it is."""
    return _SOURCE_PATH.sub(lambda found: Path(found.group()).name or found.group(), source)


def _shown_checkpoint(checkpoint: Path) -> str:
    """The exported checkpoint as the card names it: from the run's folder name down, not the path on
    the machine that exported it."""
    if checkpoint.parent.name == "checkpoints":
        return f"{checkpoint.parent.parent.name}/checkpoints/{checkpoint.name}"
    return checkpoint.name


def _training_lines(run_config, state: dict) -> list[str]:
    """The card's "Training" section: the run's data, tokens and recipe; for an imported model
    (`latentloop import-hf` records `imported_from`), where it came from instead: latentloop did not
    train it, and the config's training defaults describe no run. Each number from state.json is
    printed only when it is one (`_finite`), else "unknown"."""
    config, train, data = run_config.model, run_config.train, run_config.data
    if isinstance(state.get("imported_from"), str):
        family = state.get("model_type")
        family = f" ({family})" if isinstance(family, str) else ""
        return [f"- imported from `{_shown_path(state['imported_from'])}`{family} with `latentloop import-hf`: "
                f"latentloop did not train this model (its training data and recipe are the source's)",
                f"- tokenizer: the source's own (vocabulary {config.vocab_size:,})"]
    step, tokens = _count(state, "step"), _count(state, "tokens_seen")
    flops = state.get("flops_seen")
    init_from = state.get("init_from")
    started = f", started from `{_shown_path(init_from)}`" if isinstance(init_from, str) and init_from else ""
    return [f"- data: `{_shown_source(data.source)}`, tokenizer {_tokenizer_name(data.tokenizer)} "
            f"(vocabulary {config.vocab_size:,})",
            f"- stage: {train.stage}{started}",
            f"- steps: {UNKNOWN if step is None else step}, tokens: {UNKNOWN if tokens is None else f'{tokens:,}'}"
            + (f", training FLOPs: {flops:.4g}" if _finite(flops) and flops > 0 else ""),
            f"- optimizer {train.optimizer}, learning rate {train.lr:g}, {_batch(train, config.sequence_len, state)}, "
            f"precision {train.dtype}"]


def model_card(checkpoint: Path, run_config, params: int, plain: bool, kind: str) -> str:
    """README.md of an exported folder: the Hub's metadata block, then the architecture and its
    options (the arch's own config fields and decoding options, from the registry), the training
    data and tokens, the final metrics of the run's log and how to load the folder."""
    config = run_config.model
    spec = get_arch(config.arch)
    state, rows = _run_facts(checkpoint)
    base_fields = {f for f in ModelConfig.__dataclass_fields__}
    own = {name: getattr(config, name) for name in type(config).__dataclass_fields__ if name not in base_fields}
    shape = {name: getattr(config, name) for name in ("n_layer", "n_embd", "n_head", "n_kv_head", "sequence_len",
                                                      "vocab_size", "mlp", "tie_embeddings")}
    final_val = next((row for row in reversed(rows) if "val_loss" in row), None)
    final_train = next((row for row in reversed(rows) if "loss" in row), None)
    remote = "" if plain else ", trust_remote_code=True"
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             f"tags: [latentloop, {config.arch}]", "---", "",
             f"# {checkpoint.parent.parent.name if checkpoint.parent.name == 'checkpoints' else checkpoint.name}", "",
             f"A latentloop **{config.arch}** model: {spec.summary.rstrip('.')}. Exported by "
             f"`latentloop export --format hf` from `{_shown_checkpoint(checkpoint)}` as {kind}.", "",
             "## Architecture", "",
             f"- parameters: {params:,}",
             *(f"- {name}: {_number(value)}" for name, value in shape.items())]
    if own:
        lines += ["", f"{config.arch}'s own options (its config fields):", "",
                  *(f"- {name}: {_number(value)}" for name, value in own.items())]
    if spec.options:
        lines += ["", "Decoding options (latentloop's `generate` / `serve` flags; `config.json`'s `decoding` holds the "
                      "defaults the remote code uses):", "",
                  *(f"- `{option.name}` (default {option.default!r}): {option.help_text}" for option in spec.options)]
    lines += ["", "## Training", "", *_training_lines(run_config, state),
              "", "## Final metrics", ""]
    if final_val or final_train:
        if final_train:
            lines.append(f"- training loss at step {final_train['step']}: {_number(final_train['loss'])}")
        if final_val:
            lines += [f"- validation {name.removeprefix('val_')} at step {final_val['step']}: {_number(value)}"
                      for name, value in final_val.items() if name.startswith("val_") and value is not None]
    else:
        imported = isinstance(state.get("imported_from"), str)
        lines.append("- none: an imported model, which latentloop did not train" if imported
                     else "- none: the run has no metrics log beside this checkpoint (an imported model?)")
    lines += ["", "## How to load it", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("PATH/TO/THIS/FOLDER"{remote})',
              f'tokenizer = AutoTokenizer.from_pretrained("PATH/TO/THIS/FOLDER"{remote})',
              'ids = tokenizer("def main():", return_tensors="pt").input_ids',
              "print(tokenizer.decode(model.generate(ids, max_new_tokens=32)[0]))", "```", ""]
    if not plain:
        lines += ["The folder carries latentloop's modeling code (`modeling_latentloop.py` and the files beside it), "
                  f"so it needs transformers {REMOTE_TRANSFORMERS.split('.')[0]} or newer "
                  f"(`pip install 'transformers>={REMOTE_TRANSFORMERS}'`: transformers 4.x cannot load this "
                  "folder's code), torch and pyyaml, not latentloop; `generate()` decodes with the "
                  "architecture's latent state. The tokenizer (AutoTokenizer reads config.json first) also "
                  "needs `trust_remote_code=True`.", ""]
    lines += ["The run itself, with latentloop: `latentloop generate RUN --prompt ...`, `latentloop serve RUN` "
              "(an OpenAI-compatible server with a chat page), or `latentloop.load(RUN)` in Python.", ""]
    return "\n".join(lines)
