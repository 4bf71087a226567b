"""Checks of a Hugging Face model folder that `import_hf` runs before it reads or allocates
anything big:

- every config.json field the import reads, by type, range and consistency (`HFFields`), each
  failure one line naming the file and the field;
- the safetensors headers (every tensor's shape and dtype, read without loading a byte of
  weights) against the shapes the config implies (`read_tensor_headers`, `check_tensor_shapes`):
  a config claiming 70B parameters over a 1 MB checkpoint is refused by its first tensor;
- the memory the import will need, computed from the config and the headers, against the
  machine's (`check_memory`).

safetensors itself refuses a header whose tensors the file's bytes do not cover, so the shapes
checked here are what the files really hold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from ..config import ModelConfig
from ..errors import InteropError
from ..util import first_line, memory_limit_bytes

# Bytes per element of the safetensors dtypes a full-precision checkpoint may use; any other dtype
# (integers, float8) means a quantized or foreign checkpoint, which the import cannot express.
FLOAT_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
FP32_BYTES = 4  # the import converts every weight to float32
# What the import holds at its peaks, in order (measured with a 60M-parameter model, bf16 and fp32):
# - reading: the checkpoint as stored next to its float32 copy (an F32 tensor is its own copy, so
#   this over-counts F32 checkpoints);
# - building: nothing more; the model is built on the meta device and takes the float32 tensors
#   themselves (`hf_import.model_from_weights`);
# - checking and writing the checkpoint: the float32 weights, next to the temporaries of the
#   NaN / inf check of one tensor (`torch.isfinite` takes up to twice its float32 bytes), then next
#   to the bytes safetensors writes: a second copy of every weight before safetensors 0.8, which
#   writes from the tensors' own memory.
FINITE_CHECK_COPIES = 2  # float32 copies of the largest tensor `torch.isfinite` holds while it checks it
SAFETENSORS_WRITES_IN_PLACE = (0, 8)  # the first safetensors release whose save_file copies nothing
# RoPE: the cos and sin tables (sequence_len x head_dim float32 each) stay with the model, and
# computing them takes about as much again in temporaries.
ROPE_TABLE_COPIES = 4
# Allocator slack and temporaries on top of that: a 60M-parameter bf16 import measured 3% above the
# estimate without it at its peak (while converting; the same model stored as fp32 stayed 17% below);
# 10% covers it.
PEAK_MARGIN = 1.1
MAX_METADATA_BYTES = 64 * 1024 ** 2  # config.json / index / tokenizer_config.json: real ones are kilobytes
# Sizes and counts above int64 cannot be a tensor dimension (and would overflow float arithmetic)
MAX_CONFIG_INT = 2 ** 63 - 1
SHOWN_VALUE_CHARS = 40  # a bad value is quoted in the error line up to this many characters
REQUIRED = object()  # default of a field that must be present


def shown(value: Any) -> str:
    """A value quoted for a one-line error, shortened: a bad field may hold megabytes."""
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[:SHOWN_VALUE_CHARS] + "..."


def read_json_object(file: Path, max_bytes: int | None = MAX_METADATA_BYTES) -> dict[str, Any]:
    """A JSON file holding an object, as a dict; anything else (bigger than `max_bytes`, not
    UTF-8, not JSON, nested past Python's recursion limit, not an object) is a one-line
    InteropError naming the file."""
    try:
        size = file.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise InteropError(f"{file} is {size:,} bytes: too big for a metadata file (at most {max_bytes:,})")
        content = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise InteropError(f"cannot read {file}: not UTF-8 text") from None
    except ValueError as exc:  # not JSON, or an integer literal of thousands of digits
        raise InteropError(f"cannot read {file}: not JSON ({first_line(exc)})") from None
    except RecursionError:
        raise InteropError(f"cannot read {file}: not JSON (nested too deeply)") from None
    except OSError as exc:
        raise InteropError(f"cannot read {file}: {exc.strerror or exc}") from None
    if not isinstance(content, dict):
        raise InteropError(f"{file} is not a JSON object")
    return content


# --------------------------------------------------------------------------------------------
# config.json fields
# --------------------------------------------------------------------------------------------


def _finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (a bool, a string, NaN, an
    infinity, an integer too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


class HFFields:
    """Typed reads of one JSON object (config.json, or a section of it such as rope_parameters):
    every failure is one InteropError naming the file and the field. A field set to null counts
    as absent, as transformers treats it."""

    def __init__(self, values: dict[str, Any], file: str | Path, prefix: str = "",
                 missing: str = "not a Llama-family config"):
        self.values, self.file, self.prefix, self.missing = values, str(file), prefix, missing

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def fail(self, key: str, expected: str) -> InteropError:
        return InteropError(f"{self.file}: {self.prefix}{key} must be {expected}, got {shown(self.values.get(key))}")

    def _get(self, key: str, default: Any) -> Any:
        if self.has(key):
            return self.values[key]
        if default is REQUIRED:
            raise InteropError(f"{self.file} lacks {self.prefix}{key} ({self.missing})")
        return default

    def positive_int(self, key: str, default: Any = REQUIRED) -> Any:
        value = self._get(key, default)
        if value is default and default is not REQUIRED:
            return value
        # JSON integers only: 2e9 or 64.0 is a float, which no model class takes for a size
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(key, "a positive integer")
        if value > MAX_CONFIG_INT:
            raise self.fail(key, "at most 2^63 - 1 (a tensor dimension)")
        return value

    def positive_float(self, key: str, default: Any = REQUIRED, below: float | None = None) -> Any:
        value = self._get(key, default)
        if value is default and default is not REQUIRED:
            return value
        number = _finite(value)
        if number is None or number <= 0 or (below is not None and number >= below):
            raise self.fail(key, "a finite number > 0" + (f" and < {below:g}" if below is not None else ""))
        return number

    def number(self, key: str, default: float) -> float:
        number = _finite(self._get(key, default))
        if number is None:
            raise self.fail(key, "a finite number")
        return number

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "true or false")
        return value

    def string(self, key: str, default: Any = REQUIRED) -> Any:
        value = self._get(key, default)
        if value is default and default is not REQUIRED:
            return value
        if not isinstance(value, str):
            raise self.fail(key, "a string")
        return value

    def section(self, key: str) -> dict[str, Any]:
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self.fail(key, "an object or null")
        return value

    def token_ids(self, key: str) -> None:
        """A special token id (`bos_token_id`, ...): null, a non-negative integer, or a list of
        them (several EOS ids, Llama 3 instruct). The tokenizer checks them against its size."""
        value = self.values.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise self.fail(key, "a token id (an integer >= 0), a list of them, or null")


# --------------------------------------------------------------------------------------------
# safetensors headers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header describes it (nothing of it loaded)."""

    shape: tuple[int, ...]
    dtype: str
    file: Path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * FLOAT_DTYPE_BYTES[self.dtype]


def checkpoint_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """model.safetensors, or the shards model.safetensors.index.json names (each a file of the
    folder) and its weight_map; or a one-line InteropError."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InteropError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file, got "
                               f"{shown(weight_map)}")
        for name, shard in weight_map.items():
            # a plain file name of this folder: the index must not point elsewhere on the disk
            if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
                raise InteropError(f"{index}: weight_map[{shown(name)}] must be a file name of this folder, got "
                                   f"{shown(shard)}")
        files = [folder / shard for shard in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise InteropError(f"{index} names shard {file.name}, which is not in {folder}")
        return files, weight_map
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"], None
    found = sorted(p.name for p in folder.glob("*.bin"))
    hint = f" (found {found[0]}: PyTorch .bin checkpoints are not supported, only safetensors)" if found else ""
    raise InteropError(f"{folder} holds no model.safetensors or model.safetensors.index.json{hint}")


def read_tensor_headers(folder: Path) -> dict[str, TensorHeader]:
    """Name -> shape, dtype and file of every tensor of the checkpoint, from the safetensors
    headers alone. Refuses non-float dtypes, a tensor stored twice, and an index whose
    weight_map disagrees with what its shards hold."""
    files, weight_map = checkpoint_files(folder)
    headers: dict[str, TensorHeader] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    header = TensorHeader(tuple(piece.get_shape()), piece.get_dtype(), file)
                    if header.dtype not in FLOAT_DTYPE_BYTES:
                        raise InteropError(f"{file}: tensor {name} is {header.dtype}; only full-precision float "
                                           f"checkpoints ({', '.join(FLOAT_DTYPE_BYTES)}) can be imported")
                    if name in headers:
                        raise InteropError(f"tensor {name} is stored twice: in {headers[name].file.name} and "
                                           f"{file.name}")
                    headers[name] = header
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise InteropError(f"cannot read weights {file}: {first_line(exc)}") from None
    if weight_map is not None:
        index = folder / "model.safetensors.index.json"
        for name, header in headers.items():
            if weight_map.get(name) != header.file.name:
                raise InteropError(f"{index}: weight_map puts tensor {name} in {shown(weight_map.get(name))}, but "
                                   f"it is in {header.file.name}")
        missing = sorted(set(weight_map) - set(headers))
        if missing:
            raise InteropError(f"{index}: weight_map lists tensor {missing[0]}, which no shard holds")
    return headers


def expected_hf_tensors(config: ModelConfig, prefix: str = "model.") -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, the config.json fields that imply it) of every tensor a Hugging Face
    checkpoint of this config holds, lazily: a checker stops at the first one missing, so a
    config claiming a billion layers costs nothing. A tied checkpoint's optional lm_head copy
    is not listed."""
    D, V, hd = config.n_embd, config.vocab_size, config.head_dim
    q_rows, kv_rows, inner = config.n_head * hd, config.n_kv_head * hd, config.mlp_hidden
    yield f"{prefix}embed_tokens.weight", (V, D), "vocab_size x hidden_size"
    yield f"{prefix}norm.weight", (D,), "hidden_size"
    if not config.tie_embeddings:
        yield "lm_head.weight", (V, D), "vocab_size x hidden_size"
    attention = "num_attention_heads x head_dim"
    kv = "num_key_value_heads x head_dim"
    for i in range(config.n_layer):
        layer = f"{prefix}layers.{i}."
        yield layer + "input_layernorm.weight", (D,), "num_hidden_layers, hidden_size"
        yield layer + "post_attention_layernorm.weight", (D,), "num_hidden_layers, hidden_size"
        yield layer + "self_attn.q_proj.weight", (q_rows, D), f"{attention}, hidden_size"
        yield layer + "self_attn.k_proj.weight", (kv_rows, D), f"{kv}, hidden_size"
        yield layer + "self_attn.v_proj.weight", (kv_rows, D), f"{kv}, hidden_size"
        if config.qkv_bias:
            yield layer + "self_attn.q_proj.bias", (q_rows,), attention
            yield layer + "self_attn.k_proj.bias", (kv_rows,), kv
            yield layer + "self_attn.v_proj.bias", (kv_rows,), kv
        yield layer + "self_attn.o_proj.weight", (D, q_rows), f"hidden_size, {attention}"
        yield layer + "mlp.gate_proj.weight", (inner, D), "intermediate_size x hidden_size"
        yield layer + "mlp.up_proj.weight", (inner, D), "intermediate_size x hidden_size"
        yield layer + "mlp.down_proj.weight", (D, inner), "hidden_size x intermediate_size"


def check_tensor_shapes(config: ModelConfig, headers: dict[str, TensorHeader], config_file: Path,
                        ignored: re.Pattern[str]) -> int:
    """Every tensor the config implies is in the checkpoint with that shape, and nothing else is
    (but names matching `ignored`, e.g. old RoPE tables). Returns the parameter count."""
    used: set[str] = set()
    params = 0
    for name, shape, implied_by in expected_hf_tensors(config):
        header = headers.get(name)
        if header is None:
            raise InteropError(f"the checkpoint lacks tensor {name}, which {config_file} implies ({implied_by})")
        if header.shape != shape:
            raise InteropError(f"tensor {name} in {header.file.name} has shape {header.shape}, but {config_file} "
                               f"implies {shape} ({implied_by})")
        used.add(name)
        params += header.numel
    # some tied checkpoints store the head's copy too: its shape is checked here, that it is a copy
    # once the weights are read (`hf_import.convert_weights`)
    if config.tie_embeddings and "lm_head.weight" in headers:
        if headers["lm_head.weight"].shape != (config.vocab_size, config.n_embd):
            raise InteropError(f"tensor lm_head.weight has shape {headers['lm_head.weight'].shape}, but "
                               f"{config_file} implies {(config.vocab_size, config.n_embd)} (vocab_size x hidden_size)")
        used.add("lm_head.weight")
    unused = sorted(name for name in set(headers) - used if not ignored.match(name))
    if unused:
        what = "a bias" if any(name.endswith(".bias") for name in unused) else "a tensor"
        raise InteropError(f"the checkpoint has {what} this config cannot express: {unused[0]}"
                           + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""))
    return params


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def checkpoint_write_copies() -> int:
    """Float32 copies of the model held while its checkpoint is written: the model's own, and
    before safetensors 0.8 the bytes `save_file` serializes every tensor into first."""
    import safetensors

    release = tuple(int(part) for part in re.findall(r"\d+", safetensors.__version__)[:2])
    return 1 if release >= SAFETENSORS_WRITES_IN_PLACE else 2


def import_memory_bytes(config: ModelConfig, headers: dict[str, TensorHeader], params: int) -> dict[str, int]:
    """The import's peak memory, by part: the checkpoint as stored, the float32 weights, the
    temporaries of checking one tensor, the RoPE tables (see the constants above for what is held
    when)."""
    stored = sum(header.nbytes for header in headers.values())
    fp32 = params * FP32_BYTES
    check = FINITE_CHECK_COPIES * max((header.numel for header in headers.values()), default=0) * FP32_BYTES
    rope = ROPE_TABLE_COPIES * config.sequence_len * config.head_dim * FP32_BYTES
    weights = max(stored + max(fp32, check), fp32 + check, checkpoint_write_copies() * fp32)
    return {"stored": stored, "fp32": fp32, "rope": rope, "peak": int(PEAK_MARGIN * (weights + rope)),
            "peak_without_rope": int(PEAK_MARGIN * weights)}


def check_memory(config: ModelConfig, headers: dict[str, TensorHeader], params: int, folder: Path) -> None:
    """Refuse an import whose peak memory exceeds `memory_limit_bytes`: it could only end in an
    allocation failure or the kernel's OOM killer, after minutes of work."""
    limit = memory_limit_bytes()
    need = import_memory_bytes(config, headers, params)
    if limit is None or need["peak"] <= limit:
        return
    # the weights alone fit: a shorter context (smaller RoPE tables) can make the import fit
    hint = "; import with a smaller --sequence-len" if need["peak_without_rope"] <= limit else ""
    raise InteropError(f"importing {folder} needs about {_size(need['peak'])} of memory ({params:,} parameters: "
                       f"{_size(need['fp32'])} as float32, converted from {_size(need['stored'])} as stored; RoPE "
                       f"tables for {config.sequence_len:,} positions: {_size(need['rope'])}), more than the "
                       f"{_size(limit)} this machine allows (RAM or cgroup limit){hint}")


def _size(nbytes: int) -> str:
    for unit, scale in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} bytes"
