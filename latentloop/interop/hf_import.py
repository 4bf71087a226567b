"""Import a Hugging Face Llama-family checkpoint (Llama 1-3, SmolLM, Mistral without a sliding
window, Qwen2) into a latentloop run folder with the `gpt` arch and the model's own tokenizer.

    run_dir = import_hf("path/to/hf-folder", "runs/llama")     # or an org/name on the Hub
    model, tokenizer = latentloop.load("runs/llama")

The folder needs `config.json`, `model.safetensors` (or shards with `model.safetensors.index.json`)
and `tokenizer.json`. The run folder is what training writes (config.json, tokenizer.json,
checkpoints/step_00000000/ with model.safetensors, config and tokenizer copies, state.json), minus
optimizer state: `eval`, `generate` and `train --init-from RUN` work on it; `--resume` does not.

The mapping (exact: the tests compare logits with transformers' own classes):
- embed_tokens -> wte; norm -> ln_f; input_layernorm / post_attention_layernorm -> ln_1 / ln_2
  (learned_norms, norm_eps = rms_norm_eps); lm_head -> lm_head unless tied (a tied checkpoint's
  stored lm_head must be a copy of the embeddings);
- q_proj, k_proj, v_proj (and their biases, Qwen2) concatenated into the fused c_qkv; the second
  half of every q and k head negated (latentloop's `apply_rope` turns the other way round than
  Hugging Face's, and flipping that half in both q and k leaves every attention score unchanged);
- o_proj -> attn.c_proj; gate_proj / up_proj / down_proj -> mlp.c_gate / c_fc / c_proj (SwiGLU);
- no QK-norm, no embedding norm, no soft-cap; rope_theta and `linear` / `llama3` rope scaling.
Anything else (another family, another activation, an o_proj bias, YaRN, a sliding window shorter
than the imported context, ...) is refused with one line naming it.

Before any weight is read or any model built, `hf_checks` checks every config.json field the
import reads, the safetensors headers against the shapes the config implies, and the memory the
import needs against the machine's; a bad folder costs milliseconds, not an allocation of the
size its config claims. The run is written into a hidden folder beside --out and renamed into
place at the end (inside it, the files then moved up, when --out is an existing empty folder, which is
kept; a symlinked --out is written through to its target): a failed import leaves nothing there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..archs import build_model
from ..checkpoint import random_inits_skipped, save_weights_checkpoint
from ..config import DataConfig, ModelConfig, RunConfig, TrainConfig, model_config
from ..data.chat import EmptyChatTemplateError, check_template_renders
from ..data.tokenizers import CHAT_TEMPLATE_FILE, TOKENIZER_FILE, HFTokenizer, read_generation_config
from ..errors import ConfigError, DataError, InteropError, LatentloopError
from ..util import first_line, nearest_existing, remove_abandoned_staging, staged_folder, warn_once
from .hf_checks import (
    MAX_METADATA_BYTES,
    HFFields,
    TensorHeader,
    check_memory,
    check_tensor_shapes,
    read_json_object,
    read_tensor_headers,
    shown,
)

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")  # model_type values of the Llama family we can express
QKV_BIAS_FAMILIES = ("qwen2",)  # families whose q, k, v projections always carry biases
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}  # HF rope type -> latentloop rope_scaling
# transformers' defaults for fields a Llama config may leave out
DEFAULT_ROPE_THETA = 10000.0
# What transformers' config classes (5.x) give a key a config.json lacks, where it decides the attention
# or the context (a Mistral config without max_position_embeddings is 131,072 tokens long, not Llama's 2,048)
ABSENT_KEY_DEFAULTS = {"llama": {"max_position_embeddings": 2048},
                       "mistral": {"sliding_window": 4096, "max_position_embeddings": 131072},
                       "qwen2": {"sliding_window": 4096, "max_window_layers": 28, "max_position_embeddings": 32768}}
DEFAULT_RMS_NORM_EPS = 1e-6
# what an import reads (transformers 5 saves a chat template as chat_template.jinja, beside the tokenizer)
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]
# Mistral's repositories also hold the original format's consolidated.safetensors (as large as the model,
# never read: the Hugging Face weights' index names the files that are)
HUB_IGNORED = ["consolidated*.safetensors"]
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")  # old checkpoints stored RoPE tables
# A source's generation_config.json but for these (the tokenizer keeps the ids; the rest is transformers'
# bookkeeping) is its recommended decoding (do_sample, temperature, top_p, ...): kept in the checkpoint's
# state (`GENERATION_DEFAULTS_KEY`), so that an export writes it again rather than decoding greedily
GENERATION_NOT_KEPT = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                       "transformers_version", "_from_model_config")
GENERATION_DEFAULTS_KEY = "generation_defaults"
STAGING_PREFIX = ".importing-"  # the hidden folder beside (or inside) --out that the run is written into first
EXPORT_STAGING_PREFIX = ".exporting-"  # the same for an export (`hf_export`), which checks its --out here too
STAGING_PREFIXES = (STAGING_PREFIX, EXPORT_STAGING_PREFIX)  # what a killed process may have left in an --out


def rope_half_flip(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Negate the second half of every head's rows of a q or k projection (weight or bias): turns
    Hugging Face's RoPE direction into latentloop's and back (it is its own inverse)."""
    shaped = weight.reshape(n_heads, -1, *weight.shape[1:]).clone()
    shaped[:, shaped.shape[1] // 2:] *= -1
    return shaped.reshape(weight.shape)


# --------------------------------------------------------------------------------------------
# Finding and reading a checkpoint folder
# --------------------------------------------------------------------------------------------


def resolve_source(source: str | Path) -> Path:
    """A local folder, or `org/name` fetched from the Hugging Face Hub (config, safetensors and
    tokenizer files only) through `huggingface_hub.snapshot_download` and its cache."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InteropError(f"{path} is not a folder (expected a Hugging Face model folder with config.json)")
        return path
    if not REPO_ID.match(str(source)):
        raise InteropError(f"no folder {path} (and {str(source)!r} is not a Hub name like org/name)")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise InteropError(f"no folder {path}; fetching {source} from the Hub needs huggingface_hub "
                           f"(pip install 'latentloop[hf]')") from None
    # a relative path that does not exist (models/llama) reads as a Hub name too: every failure below
    # says first that there is no such folder, in case that was meant
    not_local = f"no folder {path}, and"
    try:
        return Path(snapshot_download(repo_id=str(source), allow_patterns=HUB_FILES, ignore_patterns=HUB_IGNORED))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise InteropError(f"{not_local} {source} cannot be fetched from the Hugging Face Hub: offline "
                               f"(HF_HUB_OFFLINE is set) and not in the local Hugging Face cache; download it "
                               f"elsewhere and pass its folder") from None
        raise InteropError(f"{not_local} {source} cannot be fetched: the Hugging Face Hub is unreachable and it is "
                           f"not in the local cache") from None
    except RepositoryNotFoundError:
        raise InteropError(f"{not_local} {source} is not a model on the Hugging Face Hub (or it is "
                           f"gated/private)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise InteropError(f"{not_local} {source} cannot be fetched from the Hugging Face Hub: "
                           f"{first_line(exc)}") from None


def read_hf_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise InteropError(f"{folder} holds no config.json (not a Hugging Face model folder)")
    return read_json_object(file)


def read_hf_weights(headers: dict[str, TensorHeader]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint files the headers were read from (see `read_tensor_headers`);
    a tensor holding NaN or inf is refused, naming it and its file."""
    weights: dict[str, torch.Tensor] = {}
    for file in sorted({header.file for header in headers.values()}):
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise InteropError(f"cannot read weights {file}: {first_line(exc)}") from None
        for name, tensor in tensors.items():
            if not bool(torch.isfinite(tensor).all()):
                raise InteropError(f"{file}: tensor {name} holds NaN or inf; a checkpoint with non-finite weights "
                                   f"cannot be imported")
        weights.update(tensors)
    return weights


# --------------------------------------------------------------------------------------------
# Config and weights
# --------------------------------------------------------------------------------------------


def _rope_settings(hf: HFFields) -> dict[str, Any]:
    """rope_theta and scaling as transformers reads them, each field checked for the rope type's
    needs. transformers 5 writes `rope_parameters` (`{"rope_type": "default", ...}` into every
    config); a non-empty `rope_scaling` (the older layout, and what model cards tell users to add by
    hand, e.g. YaRN for Qwen2.5) replaces it whole, in transformers 5 as in 4, which reads only that."""
    params = HFFields(hf.section("rope_parameters"), hf.file, "rope_parameters.")
    scaling = HFFields(hf.section("rope_scaling"), hf.file, "rope_scaling.")
    rope = scaling if scaling.values else params
    if rope.has("rope_theta"):
        theta = rope.positive_float("rope_theta")
    else:
        theta = hf.positive_float("rope_theta", DEFAULT_ROPE_THETA)
        # transformers drops rope_parameters' theta with the rest of that section: either choice would
        # be wrong for someone (transformers' theta, or the one the model was saved with), so ask
        dropped = params.positive_float("rope_theta") if rope is scaling and params.has("rope_theta") else theta
        if dropped != theta:
            raise InteropError(f"{hf.file}: rope_scaling replaces rope_parameters, and transformers then uses "
                               f"rope_theta {theta:g}, not rope_parameters' {dropped:g}: add the model's "
                               f"rope_theta to rope_scaling")
    type_key = "rope_type" if rope.has("rope_type") else "type"  # transformers' order: rope_type, type, default
    rope_type = rope.string(type_key, "default")
    if rope_type not in ROPE_TYPES:
        raise InteropError(f"rope_scaling type {rope_type!r} is not supported (supported: "
                           f"{', '.join(t for t in ROPE_TYPES if t != 'default')})")
    fields = HFFields(rope.values, hf.file, rope.prefix, missing=f"rope type {rope_type} needs it")
    partial = fields if fields.has("partial_rotary_factor") else hf
    if partial.number("partial_rotary_factor", 1.0) != 1.0:
        raise InteropError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    settings: dict[str, Any] = {"rope_theta": theta, "rope_scaling": ROPE_TYPES[rope_type]}
    if rope_type in ("linear", "llama3"):
        factor = fields.positive_float("factor")
        if factor < 1:  # transformers refuses it too: scaling stretches the trained context, never shrinks it
            raise fields.fail("factor", f"a number >= 1 for rope type {rope_type}")
        settings["rope_factor"] = factor
    if rope_type == "llama3":
        low = fields.positive_float("low_freq_factor")
        high = fields.positive_float("high_freq_factor")
        if low >= high:
            raise fields.fail("low_freq_factor", f"below high_freq_factor ({high:g})")
        settings.update(rope_low_freq_factor=low, rope_high_freq_factor=high,
                        rope_original_max_positions=fields.positive_int("original_max_position_embeddings"))
    return settings


def config_from_hf(hf: dict[str, Any], sequence_len: int | None = None, bos_id: int = 0,
                   file: str | Path = "config.json") -> ModelConfig:
    """The `gpt` config that expresses a Hugging Face Llama-family config exactly, or a one-line
    InteropError naming what it cannot express or the field of `file` that is malformed."""
    fields = HFFields(hf, file)
    family = hf.get("model_type")
    if any(key in hf for key in ("num_local_experts", "num_experts", "moe_intermediate_size")):
        raise InteropError(f"model_type {shown(family)} is a mixture of experts, which is not supported")
    if family not in SUPPORTED_FAMILIES:
        raise InteropError(f"model_type {shown(family)} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)}: "
                           f"the Llama family)")
    if hf.get("quantization_config"):
        raise InteropError("quantized checkpoints are not supported (import the full-precision weights)")
    act_key = "hidden_act" if fields.has("hidden_act") else "hidden_activation"
    act = fields.string(act_key, "silu")
    if act != "silu":
        raise InteropError(f"hidden_act {shown(act)} is not supported (only silu: SwiGLU)")
    if fields.boolean("attention_bias", False):
        raise InteropError("attention_bias=true is not supported (it puts a bias on o_proj; only q/k/v biases "
                           "can be expressed)")
    if fields.boolean("mlp_bias", False):
        raise InteropError("mlp_bias=true is not supported (MLP projections without biases only)")
    D, n_head = fields.positive_int("hidden_size"), fields.positive_int("num_attention_heads")
    n_layer, vocab = fields.positive_int("num_hidden_layers"), fields.positive_int("vocab_size")
    intermediate = fields.positive_int("intermediate_size")
    if D % n_head:
        raise InteropError(f"{file}: hidden_size ({D}) must be divisible by num_attention_heads ({n_head})")
    head_dim = fields.positive_int("head_dim", None)
    if head_dim is not None and head_dim * n_head != D:
        raise InteropError(f"head_dim {head_dim} != hidden_size / num_attention_heads ({D} / {n_head}) is not "
                           f"supported")
    if (D // n_head) % 2:
        raise InteropError(f"{file}: head_dim (hidden_size / num_attention_heads = {D // n_head}) must be even "
                           f"for RoPE")
    n_kv_head = fields.positive_int("num_key_value_heads", n_head)
    if n_kv_head > n_head or n_head % n_kv_head:
        raise InteropError(f"{file}: num_key_value_heads ({n_kv_head}) must divide num_attention_heads ({n_head})")
    # a key the file lacks takes the family's config-class default, as transformers reads it (Mistral's
    # 4096-token window was read as none: logits differed past 4,096 tokens); an explicit null is none
    defaults = ABSENT_KEY_DEFAULTS[family]
    positions = fields.positive_int("max_position_embeddings", defaults["max_position_embeddings"])
    if sequence_len is not None and sequence_len > positions:  # the user's choice, but not one to make unawares
        warn_once(f"--sequence-len {sequence_len} is past the {positions} positions this model was made for "
                  f"(max_position_embeddings): RoPE at the positions past them was never trained, and the "
                  f"import does not rescale it")
    sequence_len = sequence_len or positions
    window = fields.positive_int("sliding_window", None) if "sliding_window" in fields.values \
        else defaults.get("sliding_window")
    # as transformers reads it: a config's own `layer_types` where it lists them; else Mistral slides
    # wherever `sliding_window` is set (it has no switch: `use_sliding_window` is Qwen2's), and Qwen2
    # only with the switch on, in its layers from `max_window_layers` on
    layer_types = fields.values.get("layer_types")
    if isinstance(layer_types, list):
        uses_window = window is not None and "sliding_attention" in layer_types
    elif family == "mistral":
        uses_window = window is not None
    else:
        first_sliding = fields.number("max_window_layers", defaults.get("max_window_layers", n_layer))
        uses_window = fields.boolean("use_sliding_window", False) and window is not None and first_sliding < n_layer
    if uses_window and sequence_len > window:
        raise InteropError(f"sliding-window attention (window {window}) is not supported beyond the window: "
                           f"import with --sequence-len {window} or less, where it equals full attention")
    norm_eps = fields.positive_float("rms_norm_eps", DEFAULT_RMS_NORM_EPS, below=1.0)
    tie = fields.boolean("tie_word_embeddings", False)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer reads these
        fields.token_ids(name)
    try:
        return model_config(
            ModelConfig.arch, None, vocab_size=vocab, sequence_len=sequence_len, n_layer=n_layer, n_embd=D,
            n_head=n_head, n_kv_head=n_kv_head, mlp="swiglu", intermediate_size=intermediate, tie_embeddings=tie,
            logit_softcap=0.0, bos_id=bos_id, embed_norm=False, qk_norm=False, learned_norms=True, norm_eps=norm_eps,
            qkv_bias=family in QKV_BIAS_FAMILIES, attention_window=window if uses_window else 0,
            **_rope_settings(fields))
    except ConfigError as exc:
        raise InteropError(f"cannot express this config: {exc}") from None


def hf_to_latentloop_names(config: ModelConfig, prefix: str = "model.") -> dict[str, str]:
    """Hugging Face tensor name -> latentloop name, for everything but q/k/v (fused separately)."""
    names = {f"{prefix}embed_tokens.weight": "wte.weight", f"{prefix}norm.weight": "ln_f.weight"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(config.n_layer):
        hf, ll = f"{prefix}layers.{i}.", f"blocks.{i}."
        names.update({hf + "input_layernorm.weight": ll + "ln_1.weight",
                      hf + "post_attention_layernorm.weight": ll + "ln_2.weight",
                      hf + "self_attn.o_proj.weight": ll + "attn.c_proj.weight",
                      hf + "mlp.gate_proj.weight": ll + "mlp.c_gate.weight",
                      hf + "mlp.up_proj.weight": ll + "mlp.c_fc.weight",
                      hf + "mlp.down_proj.weight": ll + "mlp.c_proj.weight"})
    return names


def _check_tied_copy(head: torch.Tensor, embedding: torch.Tensor) -> None:
    """A tied checkpoint's stored lm_head.weight must be the embeddings' copy: tied, the model drops
    it, but transformers 5 then does not tie and uses the stored head (transformers 4 ties), so a
    different head has no one meaning to import."""
    if head.dtype != embedding.dtype:  # stored in two precisions: compared as the import keeps them
        head, embedding = head.float(), embedding.float()
    if not torch.equal(head, embedding):
        raise InteropError("config.json has tie_word_embeddings=true, but the checkpoint's lm_head.weight differs "
                           "from model.embed_tokens.weight: set tie_word_embeddings to false (keep the stored head) "
                           "or remove lm_head.weight (tie the embeddings)")


def convert_weights(hf_weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama-family state dict -> latentloop `gpt` state dict (float32)."""
    weights = {k: v for k, v in hf_weights.items() if not IGNORED_TENSORS.match(k)}
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise InteropError(f"the checkpoint lacks tensor {name}")
        used.add(name)
        return weights[name].float()

    for hf_name, ll_name in hf_to_latentloop_names(config).items():
        out[ll_name] = take(hf_name)
    if config.tie_embeddings and "lm_head.weight" in weights:  # some tied checkpoints store the copy too
        _check_tied_copy(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
        used.add("lm_head.weight")
    parts = ("weight", "bias") if config.qkv_bias else ("weight",)
    for i in range(config.n_layer):
        for part in parts:
            q, k, v = (take(f"model.layers.{i}.self_attn.{p}_proj.{part}") for p in "qkv")
            out[f"blocks.{i}.attn.c_qkv.{part}"] = torch.cat(
                [rope_half_flip(q, config.n_head), rope_half_flip(k, config.n_kv_head), v])
    unused = sorted(set(weights) - used)
    if unused:
        what = "a bias" if any(name.endswith(".bias") for name in unused) else "a tensor"
        raise InteropError(f"the checkpoint has {what} this config cannot express: {unused[0]}"
                           + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""))
    return out


def model_from_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model of `config` holding `weights` themselves: built on the meta device and the tensors
    assigned into it, so the import never holds a second float32 copy of the model, nor spends the
    time to initialise one randomly only to overwrite it."""
    # no random initialisation: it would be overwritten, and on meta its first call imports torch._dynamo (seconds)
    with torch.device("meta"), random_inits_skipped():
        model = build_model(config)
    expected = model.state_dict()
    for name, tensor in weights.items():
        if expected[name].shape != tensor.shape:
            raise InteropError(f"tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                               f"{tuple(expected[name].shape)}")
    model.load_state_dict(weights, strict=True, assign=True)
    model.reset_rope()  # the RoPE tables are computed, not loaded: on the CPU now that the weights are there
    unloaded = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if unloaded:  # neither read from the checkpoint nor computed: the model would fail on first use
        raise InteropError(f"cannot import this config: the model's {unloaded[0]} is neither a checkpoint tensor "
                           f"nor computed by the model")
    return model


# --------------------------------------------------------------------------------------------
# The whole import
# --------------------------------------------------------------------------------------------


def check_out_folder(out: Path) -> Path:
    """--out must name a folder to create, or an empty one, where this process can create it (or,
    for an existing empty folder, write into it): checked before any work is done (import's and
    export's). Returns the folder to write: `out`, or the folder a symlinked `out` points at (the
    staged rename would replace the link itself, or fail on it after all the work)."""
    if out.is_symlink():
        out = Path(os.path.realpath(out))
    try:
        if out.exists() and not out.is_dir():
            raise InteropError(f"--out {out} is a file; give a folder to create")
        if out.is_dir():  # what a killed import or export left inside it does not make it full
            for prefix in STAGING_PREFIXES:  # named as `staged_folder` names them: `.` is the folder's own name
                remove_abandoned_staging(out, prefix, Path(os.path.abspath(out)).name)
        if out.is_dir() and any(out.iterdir()):
            raise InteropError(f"{out} exists and is not empty; choose another output folder")
    except OSError as exc:
        raise InteropError(f"cannot use --out {out}: {exc.strerror or exc}") from None
    if out.is_dir():  # written into where it is (`util.staged_folder`): its parent need not take new entries
        if not os.access(out, os.W_OK | os.X_OK):
            raise InteropError(f"cannot write into --out {out}: it is not writable")
        return out
    ancestor = nearest_existing(out)  # `out` itself is not there (an existing folder returned above)
    if not ancestor.is_dir():
        raise InteropError(f"cannot create --out {out}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InteropError(f"cannot create --out {out}: {ancestor} is not writable")
    return out


def read_hf_tokenizer(folder: Path, config: ModelConfig, hf: dict[str, Any]) -> HFTokenizer:
    """The folder's tokenizer.json with the special tokens its config names; the files are checked
    to be UTF-8 JSON objects first, so a binary file is one line naming it. A chat template that
    renders no reply or an empty prompt is refused (`check_template_renders`)."""
    for name, max_bytes in ((TOKENIZER_FILE, None), ("tokenizer_config.json", MAX_METADATA_BYTES)):
        if (folder / name).is_file():  # a vocabulary's tokenizer.json may be large: no cap on it
            read_json_object(folder / name, max_bytes)
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        try:
            (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            raise InteropError(f"cannot read {folder / CHAT_TEMPLATE_FILE}: not UTF-8 text") from None
    try:
        # prompted as transformers prompts this model (BOS first only where the post-processor puts it), which
        # the run's tokenizer file keeps (`adds_bos`); a model trained here with the same file gets BOS always
        tokenizer = HFTokenizer.from_pretrained_folder(folder, vocab_size=config.vocab_size, config=hf, adds_bos=None)
    except DataError as exc:
        raise InteropError(str(exc)) from None
    if tokenizer.vocab_size > config.vocab_size:
        raise InteropError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {config.vocab_size} "
                           f"embedding rows")
    if tokenizer.chat_template is not None:
        try:
            check_template_renders(tokenizer)
        except EmptyChatTemplateError as exc:  # SFT would train on nothing, chat answer an empty prompt
            raise InteropError(f"{folder}: {exc}") from None
        except LatentloopError:
            pass  # any other problem of the template shows where it is used (SFT, chat), not for base use
    return tokenizer


def import_hf(source: str | Path, out: str | Path, sequence_len: int | None = None) -> dict[str, Any]:
    """Read a Hugging Face checkpoint (folder or Hub name) into a new latentloop run folder.
    Returns a summary (run folder, checkpoint, parameters, config).

    Everything that can be checked is checked before anything big is read or allocated: the
    config's fields, the checkpoint's tensor shapes and dtypes (from the safetensors headers)
    against the config, the memory needed against the machine's, the tokenizer. The run is then
    written into a hidden folder beside `out` and renamed into place (an existing empty `out` is
    kept: `util.staged_folder`), so a failure leaves nothing at `out`."""
    out = Path(out)
    out = check_out_folder(out)  # a symlinked --out: its target
    if sequence_len is not None and sequence_len < 1:
        raise InteropError(f"--sequence-len must be >= 1, got {sequence_len}")
    folder = resolve_source(source)
    hf = read_hf_config(folder)
    config = config_from_hf(hf, sequence_len, file=folder / "config.json")  # refuses unsupported families first
    headers = read_tensor_headers(folder)
    params = check_tensor_shapes(config, headers, folder / "config.json", IGNORED_TENSORS)
    check_memory(config, headers, params, folder)
    tokenizer = read_hf_tokenizer(folder, config, hf)
    config.bos_id = tokenizer.bos_id
    weights = convert_weights(read_hf_weights(headers), config)  # the checkpoint as stored is freed here
    model = model_from_weights(config, weights)
    del weights  # the model holds these very tensors now
    state = {"step": 0, "tokens_seen": 0, "flops_seen": 0.0, "elapsed": 0.0,
             "imported_from": str(source), "model_type": hf.get("model_type")}
    defaults = {k: v for k, v in read_generation_config(folder).items() if k not in GENERATION_NOT_KEPT}
    if defaults:
        state[GENERATION_DEFAULTS_KEY] = defaults
    checkpoint = _write_run(out, config, tokenizer, model, state)
    return {"run": str(out), "checkpoint": str(checkpoint), "source": str(source), "model_type": hf.get("model_type"),
            "params": model.num_params(), "model": config.to_dict()}


def _write_run(out: Path, config: ModelConfig, tokenizer: HFTokenizer, model: torch.nn.Module,
               state: dict[str, Any]) -> Path:
    """The run folder (config, tokenizer, metrics, one weights-only checkpoint), written into a
    staging folder beside `out` and renamed onto it at the end; on any failure the staging folder
    and every parent folder made for it are removed again. Returns the checkpoint's final path."""
    try:
        with staged_folder(out, STAGING_PREFIX) as staging:
            run = RunConfig(model=config, train=TrainConfig(), data=DataConfig(tokenizer=str(out / TOKENIZER_FILE)))
            run.save_json(staging / "config.json")
            tokenizer.save(staging)
            (staging / "metrics.jsonl").write_text("")
            checkpoint = save_weights_checkpoint(staging, 0, model, state)
    except OSError as exc:
        raise InteropError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out / checkpoint.relative_to(staging)
