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
  (learned_norms, norm_eps = rms_norm_eps); lm_head -> lm_head unless tied;
- q_proj, k_proj, v_proj (and their biases, Qwen2) concatenated into the fused c_qkv; the second
  half of every q and k head negated (latentloop's `apply_rope` turns the other way round than
  Hugging Face's, and flipping that half in both q and k leaves every attention score unchanged);
- o_proj -> attn.c_proj; gate_proj / up_proj / down_proj -> mlp.c_gate / c_fc / c_proj (SwiGLU);
- no QK-norm, no embedding norm, no soft-cap; rope_theta and `linear` / `llama3` rope scaling.
Anything else (another family, another activation, an o_proj bias, YaRN, a sliding window shorter
than the imported context, ...) is refused with one line naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..archs import build_model
from ..checkpoint import save_weights_checkpoint
from ..config import DataConfig, ModelConfig, RunConfig, TrainConfig, model_config
from ..data.tokenizers import TOKENIZER_FILE, HFTokenizer
from ..errors import ConfigError, DataError, InteropError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")  # model_type values of the Llama family we can express
QKV_BIAS_FAMILIES = ("qwen2",)  # families whose q, k, v projections always carry biases
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}  # HF rope type -> latentloop rope_scaling
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "generation_config.json"]
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")  # old checkpoints stored RoPE tables


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
    try:
        return Path(snapshot_download(repo_id=str(source), allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise InteropError(f"cannot fetch {source}: offline (HF_HUB_OFFLINE is set) and it is not in the "
                               f"local Hugging Face cache; download it elsewhere and pass its folder") from None
        raise InteropError(f"cannot fetch {source}: the Hugging Face Hub is unreachable and it is not in the "
                           f"local cache") from None
    except RepositoryNotFoundError:
        raise InteropError(f"{source} is not a model on the Hugging Face Hub (or it is gated/private)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise InteropError(f"cannot fetch {source} from the Hugging Face Hub: {str(exc).splitlines()[0]}") from None


def read_hf_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise InteropError(f"{folder} holds no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise InteropError(f"cannot read {file}: {exc}") from None
    if not isinstance(config, dict):
        raise InteropError(f"{file} is not a JSON object")
    return config


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise InteropError(f"cannot read {index}: {exc}") from None
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        found = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {found[0]}: PyTorch .bin checkpoints are not supported, only safetensors)" if found else ""
        raise InteropError(f"{folder} holds no model.safetensors or model.safetensors.index.json{hint}")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            weights.update(load_file(str(folder / shard)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise InteropError(f"cannot read weights {folder / shard}: {str(exc).splitlines()[0]}") from None
    return weights


# --------------------------------------------------------------------------------------------
# Config and weights
# --------------------------------------------------------------------------------------------


def _rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling from either layout: transformers 5's `rope_parameters` or the
    older top-level `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise InteropError(f"rope_scaling type {rope_type!r} is not supported (supported: "
                           f"{', '.join(t for t in ROPE_TYPES if t != 'default')})")
    if float(merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise InteropError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    settings: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": ROPE_TYPES[rope_type]}
    if rope_type in ("linear", "llama3"):
        settings["rope_factor"] = float(merged["factor"])
    if rope_type == "llama3":
        settings.update(rope_low_freq_factor=float(merged["low_freq_factor"]),
                        rope_high_freq_factor=float(merged["high_freq_factor"]),
                        rope_original_max_positions=int(merged["original_max_position_embeddings"]))
    return settings


def config_from_hf(hf: dict[str, Any], sequence_len: int | None = None, bos_id: int = 0) -> ModelConfig:
    """The `gpt` config that expresses a Hugging Face Llama-family config exactly, or a one-line
    InteropError naming what it cannot express."""
    family = hf.get("model_type")
    if any(key in hf for key in ("num_local_experts", "num_experts", "moe_intermediate_size")):
        raise InteropError(f"model_type {family!r} is a mixture of experts, which is not supported")
    if family not in SUPPORTED_FAMILIES:
        raise InteropError(f"model_type {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)}: "
                           f"the Llama family)")
    if hf.get("quantization_config"):
        raise InteropError("quantized checkpoints are not supported (import the full-precision weights)")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise InteropError(f"hidden_act {act!r} is not supported (only silu: SwiGLU)")
    if hf.get("attention_bias"):
        raise InteropError("attention_bias=true is not supported (it puts a bias on o_proj; only q/k/v biases "
                           "can be expressed)")
    if hf.get("mlp_bias"):
        raise InteropError("mlp_bias=true is not supported (MLP projections without biases only)")
    try:
        D, n_head = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        n_layer, vocab = int(hf["num_hidden_layers"]), int(hf["vocab_size"])
        intermediate = int(hf["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InteropError(f"config.json lacks a usable {exc} (not a Llama-family config)") from None
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * n_head != D:
        raise InteropError(f"head_dim {head_dim} != hidden_size / num_attention_heads ({D} / {n_head}) is not "
                           f"supported")
    positions = int(hf.get("max_position_embeddings", 2048))
    sequence_len = sequence_len or positions
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", family == "mistral") and window is not None
    if uses_window and sequence_len > int(window):
        raise InteropError(f"sliding-window attention (window {window}) is not supported beyond the window: "
                           f"import with --sequence-len {window} or less, where it equals full attention")
    try:
        return model_config(
            "gpt", None, vocab_size=vocab, sequence_len=sequence_len, n_layer=n_layer, n_embd=D, n_head=n_head,
            n_kv_head=int(hf.get("num_key_value_heads") or n_head), mlp="swiglu", intermediate_size=intermediate,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), logit_softcap=0.0, bos_id=bos_id,
            embed_norm=False, qk_norm=False, learned_norms=True, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=family in QKV_BIAS_FAMILIES, **_rope_settings(hf))
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


# --------------------------------------------------------------------------------------------
# The whole import
# --------------------------------------------------------------------------------------------


def import_hf(source: str | Path, out: str | Path, sequence_len: int | None = None) -> dict[str, Any]:
    """Read a Hugging Face checkpoint (folder or Hub name) into a new latentloop run folder.
    Returns a summary (run folder, checkpoint, parameters, config)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out} exists and is not empty; choose another output folder")
    if sequence_len is not None and sequence_len < 1:
        raise InteropError(f"--sequence-len must be >= 1, got {sequence_len}")
    folder = resolve_source(source)
    hf = read_hf_config(folder)
    config = config_from_hf(hf, sequence_len)  # refuses unsupported families before reading any weights
    try:
        tokenizer = HFTokenizer.from_pretrained_folder(folder, vocab_size=config.vocab_size, config=hf)
    except DataError as exc:
        raise InteropError(str(exc)) from None
    if tokenizer.vocab_size > config.vocab_size:
        raise InteropError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {config.vocab_size} "
                           f"embedding rows")
    config.bos_id = tokenizer.bos_id
    model = build_model(config)
    weights = convert_weights(read_hf_weights(folder), config)
    expected = model.state_dict()
    for name, tensor in weights.items():
        if expected[name].shape != tensor.shape:
            raise InteropError(f"tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                               f"{tuple(expected[name].shape)}")
    model.load_state_dict(weights, strict=True)
    run = RunConfig(model=config, train=TrainConfig(), data=DataConfig(tokenizer=str(out / TOKENIZER_FILE)))
    out.mkdir(parents=True, exist_ok=True)
    run.save_json(out / "config.json")
    tokenizer.save(out)
    (out / "metrics.jsonl").write_text("")
    state = {"step": 0, "tokens_seen": 0, "flops_seen": 0.0, "elapsed": 0.0,
             "imported_from": str(source), "model_type": hf.get("model_type")}
    checkpoint = save_weights_checkpoint(out, 0, model, state)
    return {"run": str(out), "checkpoint": str(checkpoint), "source": str(source), "model_type": hf.get("model_type"),
            "params": model.num_params(), "model": config.to_dict()}
