"""`import-hf` on bad input: every malformed config.json field, metadata file and checkpoint is
one line (exit 2, no traceback) naming the file and the field; sizes the checkpoint does not hold
or the machine cannot fit are refused before any allocation; a failed import leaves nothing at
--out. The checkpoint is a tiny random transformers Llama written with `save_pretrained`, edited
per test."""

from __future__ import annotations

import ctypes
import gc
import json
import resource
import shutil
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import latentloop as ll
from latentloop.cli import main
from latentloop.errors import OutputError
from latentloop.interop import hf_checks, hf_import

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's benchmarks/
from benchmarks.rgpt import proc_status_bytes, reset_peak_rss  # noqa: E402

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 320
BOS, EOS = 256, 257  # after the 256 byte symbols of the tokenizer below
# A Llama 3 70B config.json's shape fields: ~70.6e9 parameters, 263 GiB as float32
LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)
# Refusing a bad folder reads a few kilobytes of JSON and safetensors headers: these bounds are
# generous for a shared CI machine and far below what building a 70B model costs (the unfixed
# import allocated 4 GB over 30 s before failing)
REFUSAL_SECONDS = 5.0
REFUSAL_PYTHON_BYTES = 16 * 1024 ** 2  # tracemalloc peak
REFUSAL_RSS_BYTES = 64 * 1024 ** 2  # growth of the process's peak resident memory
IMPORT_TOL = 1e-4  # logits vs transformers (fp32), as test_interop's parity tests allow
WEIGHT_SCALE = 10.0  # transformers' 0.02 init leaves attention near uniform, where RoPE barely shows in the logits
# An import's peak over the float32 weights: reading the checkpoint, then the model holding those
# very tensors (built on the meta device). Building and initialising a second model to copy them
# into took 2x and more.
IMPORT_PEAK_OVER_FP32 = 1.5


def _write_tokenizer(folder) -> None:
    """A byte-level BPE without merges: ids 0-255 are the bytes, then <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({"<s>": BOS, "</s>": EOS})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def _save_llama(folder, shard: bool = False) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="40KB" if shard else "5GB")
    _write_tokenizer(folder)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-originals")
    _save_llama(root / "llama")
    _save_llama(root / "sharded", shard=True)
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    return root


@pytest.fixture
def llama(originals, tmp_path):
    shutil.copytree(originals / "llama", tmp_path / "hf")
    return tmp_path / "hf"


@pytest.fixture
def sharded(originals, tmp_path):
    shutil.copytree(originals / "sharded", tmp_path / "hf")
    return tmp_path / "hf"


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if the import gets as far as loading weights or building a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the import read weights or built a model before refusing the folder")

    monkeypatch.setattr(hf_import, "build_model", refuse)
    monkeypatch.setattr(hf_import, "load_file", refuse)


def _edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def _refused(folder, out, capsys, *extra) -> str:
    """Run import-hf, assert one line on stderr, exit 2, and nothing left at --out or beside it."""
    before = sorted(p.name for p in out.parent.iterdir()) if out.parent.is_dir() else None
    capsys.readouterr()
    code = main(["import-hf", str(folder), "--out", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("latentloop: error: "), err
    assert "Traceback" not in err
    if out.is_dir():
        assert not any(out.iterdir()), "the import wrote into --out"
    after = sorted(p.name for p in out.parent.iterdir()) if out.parent.is_dir() else None
    assert after == before, "the import left a staging folder beside --out"
    return err


# --------------------------------------------------------------------------------------------
# config.json fields
# --------------------------------------------------------------------------------------------


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("changes, words", [
    ({"rms_norm_eps": {}}, "rms_norm_eps must be a finite number > 0"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be"),
    ({"rms_norm_eps": 2.0}, "rms_norm_eps must be"),
    ({"max_position_embeddings": "abc"}, "max_position_embeddings must be a positive integer, got 'abc'"),
    ({"head_dim": "x"}, "head_dim must be a positive integer, got 'x'"),
    ({"vocab_size": 2e9}, "vocab_size must be a positive integer, got 2000000000.0"),
    ({"hidden_size": 10 ** 30}, "hidden_size must be at most 2^63 - 1"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"hidden_size": None}, "lacks hidden_size"),
    ({"hidden_size": 30}, "hidden_size (30) must be divisible by num_attention_heads (4)"),
    ({"hidden_size": 36, "head_dim": None}, "must be even for RoPE"),
    ({"num_key_value_heads": 3}, "num_key_value_heads (3) must divide num_attention_heads (4)"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads must be a positive integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"attention_bias": "no"}, "attention_bias must be true or false"),
    ({"hidden_act": ["silu"]}, "hidden_act must be a string"),
    ({"eos_token_id": "x"}, "eos_token_id must be a token id"),
    ({"bos_token_id": [0, -1]}, "bos_token_id must be a token id"),
    ({"sliding_window": "x"}, "sliding_window must be a positive integer"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object or null"),
    ({"rope_parameters": None, "rope_scaling": "linear"}, "rope_scaling must be an object or null"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_parameters.rope_theta"),
    ({"rope_parameters": None, "rope_theta": -1}, "rope_theta must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": 3}}, "rope_parameters.rope_type must be a string"),
    ({"rope_parameters": {k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}},
     "lacks rope_parameters.factor (rope type llama3 needs it)"),
    ({"rope_parameters": None, "rope_scaling": {"type": "llama3", "factor": 8.0}},
     "lacks rope_scaling.low_freq_factor (rope type llama3 needs it)"),
    ({"rope_parameters": LLAMA3_ROPE | {"low_freq_factor": "1"}}, "rope_parameters.low_freq_factor must be"),
    ({"rope_parameters": LLAMA3_ROPE | {"low_freq_factor": 4.0}}, "low_freq_factor must be below high_freq_factor"),
    ({"rope_parameters": LLAMA3_ROPE | {"original_max_position_embeddings": 16.5}},
     "original_max_position_embeddings must be a positive integer"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.5}}, "factor must be a number >= 1"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": {}}}, "factor must be a finite number"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": "half"}}, "partial_rotary_factor"),
])
def test_malformed_config_fields_are_one_line_errors(changes, words, llama, tmp_path, capsys, no_allocation):
    _edit_config(llama, **changes)
    err = _refused(llama, tmp_path / "run", capsys)
    assert words in err and f"{llama / 'config.json'}" in err


@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe\x00\x01binary\x80", "not UTF-8 text"),
    (b"model_type = llama", "not JSON"),
    (b"[" * 100_000, "not JSON"),  # nested past Python's recursion limit, or past json's own
    (b'{"vocab_size": ' + b"1" * 5000 + b"}", "not JSON"),  # an integer literal Python refuses to parse
    (b"[1, 2]", "is not a JSON object"),
])
def test_unreadable_config_json_is_one_line_error(content, words, llama, tmp_path, capsys, no_allocation):
    (llama / "config.json").write_bytes(content)
    err = _refused(llama, tmp_path / "run", capsys)
    assert words in err and "config.json" in err


@pytest.mark.parametrize("name, content, words", [
    ("tokenizer.json", b"\x89PNG\r\n\x1a\n\x00\x00", "tokenizer.json: not UTF-8 text"),
    ("tokenizer.json", b"not json", "tokenizer.json: not JSON"),
    ("tokenizer.json", b'"a string"', "tokenizer.json is not a JSON object"),
    ("tokenizer_config.json", b"\xff\xfe", "tokenizer_config.json: not UTF-8 text"),
    ("tokenizer_config.json", b"[]", "tokenizer_config.json is not a JSON object"),
    ("chat_template.jinja", b"{{ \xff }}", "chat_template.jinja: not UTF-8 text"),
    # passed over without a word: the end tokens only it names (Llama 3 Instruct's) were lost
    ("generation_config.json", b"{not json", "generation_config.json: Expecting property name"),
    ("generation_config.json", b"[1]", "generation_config.json must hold a JSON object, got list"),
])
def test_unreadable_tokenizer_files_are_one_line_errors(name, content, words, llama, tmp_path, capsys):
    (llama / name).write_bytes(content)
    assert words in _refused(llama, tmp_path / "run", capsys)


# --------------------------------------------------------------------------------------------
# The checkpoint against the config
# --------------------------------------------------------------------------------------------


def _edit_index(folder, edit) -> None:
    index = folder / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    edit(content["weight_map"])
    index.write_text(json.dumps(content))


def _list_values(weight_map):
    for name in weight_map:
        weight_map[name] = [weight_map[name]]


def _outside(weight_map):
    weight_map["lm_head.weight"] = "../elsewhere/model.safetensors"


def _wrong_shard(weight_map):
    """One tensor of a shard holding several moved to another shard (both still listed)."""
    shards = sorted(set(weight_map.values()))
    crowded = next(s for s in shards if list(weight_map.values()).count(s) > 1)
    name = next(n for n, s in weight_map.items() if s == crowded)
    weight_map[name] = next(s for s in shards if s != crowded)


def _extra_name(weight_map):
    weight_map["model.layers.9.mlp.up_proj.weight"] = weight_map["lm_head.weight"]


def _not_a_map(weight_map):
    weight_map.clear()


@pytest.mark.parametrize("edit, words", [
    (_list_values, "must be a file name of this folder, got ['model-"),
    (_outside, "must be a file name of this folder, got '../elsewhere"),
    (_wrong_shard, "weight_map puts tensor model."),
    (_extra_name, "weight_map lists tensor model.layers.9.mlp.up_proj.weight, which no shard holds"),
    (_not_a_map, "weight_map must be a non-empty object"),
])
def test_malformed_safetensors_index_is_one_line_error(edit, words, sharded, tmp_path, capsys, no_allocation):
    _edit_index(sharded, edit)
    err = _refused(sharded, tmp_path / "run", capsys)
    assert words in err and "model.safetensors.index.json" in err


def _rewrite_weights(folder, change) -> None:
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_integer_and_misshapen_tensors_are_refused_from_the_headers(llama, tmp_path, capsys, no_allocation):
    _rewrite_weights(llama, lambda w: w.update({"model.norm.weight": w["model.norm.weight"].long()}))
    assert "tensor model.norm.weight is I64" in _refused(llama, tmp_path / "run", capsys)
    _rewrite_weights(llama, lambda w: w.update({"model.norm.weight": torch.ones(33)}))
    err = _refused(llama, tmp_path / "run", capsys)
    assert "model.norm.weight in model.safetensors has shape (33,)" in err and "implies (32,) (hidden_size)" in err


def _all_time_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def test_70b_config_over_a_tiny_checkpoint_is_refused_before_any_allocation(llama, tmp_path, capsys,
                                                                             no_allocation):
    _edit_config(llama, **LLAMA_70B)
    # the peak's growth from now: VmHWM reset to the current RSS (Linux), else getrusage's all-time peak
    # (which an earlier, larger test may already hold above anything this one allocates)
    peak_was_reset = reset_peak_rss()
    rss_before = proc_status_bytes("VmRSS") if peak_was_reset else _all_time_peak_rss()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        err = _refused(llama, tmp_path / "run", capsys)
        elapsed = time.perf_counter() - start
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss_growth = (proc_status_bytes("VmHWM") if peak_was_reset else _all_time_peak_rss()) - rss_before
    assert "model.embed_tokens.weight" in err and "(128256, 8192)" in err and "(320, 32)" in err
    assert elapsed < REFUSAL_SECONDS and python_peak < REFUSAL_PYTHON_BYTES and rss_growth < REFUSAL_RSS_BYTES, \
        (elapsed, python_peak, rss_growth)


@pytest.mark.parametrize("changes, words", [
    ({"vocab_size": 2_000_000_000}, "implies (2000000000, 32) (vocab_size x hidden_size)"),
    ({"num_hidden_layers": 10 ** 9}, "n_layer must be in [1, 1024], got 1000000000"),
    ({"num_hidden_layers": 1000}, "lacks tensor model.layers.2.input_layernorm.weight"),  # stops at the first
    ({"intermediate_size": 4096}, "model.layers.0.mlp.gate_proj.weight in model.safetensors has shape (48, 32)"),
    # the weights match, but the RoPE tables of 10^12 positions would need 2^45 bytes and more
    ({"max_position_embeddings": 10 ** 12}, "import with a smaller --sequence-len"),
])
def test_sizes_the_checkpoint_or_machine_cannot_hold_are_refused(changes, words, llama, tmp_path, capsys,
                                                                  no_allocation):
    _edit_config(llama, **changes)
    start = time.perf_counter()
    assert words in _refused(llama, tmp_path / "run", capsys)
    assert time.perf_counter() - start < REFUSAL_SECONDS


def test_memory_limit_refuses_what_cannot_fit(llama, tmp_path, capsys, monkeypatch):
    config = hf_import.config_from_hf(json.loads((llama / "config.json").read_text()))
    headers = hf_checks.read_tensor_headers(llama)
    params = hf_checks.check_tensor_shapes(config, headers, llama / "config.json", hf_import.IGNORED_TENSORS)
    need = hf_checks.import_memory_bytes(config, headers, params)
    assert params == sum(p.numel() for p in transformers.LlamaForCausalLM.from_pretrained(llama).parameters())
    assert need["peak"] >= need["stored"] + params * hf_checks.FP32_BYTES  # the checkpoint next to its float32 copy
    limit = hf_checks.memory_limit_bytes()
    assert limit is None or limit > need["peak"]  # the machine's own limit is read, and this one fits

    monkeypatch.setattr(hf_checks, "memory_limit_bytes", lambda: need["peak"] - 1)
    err = _refused(llama, tmp_path / "run", capsys)
    assert f"{params:,} parameters" in err and "more than the" in err and "this machine allows" in err
    monkeypatch.setattr(hf_checks, "memory_limit_bytes", lambda: need["peak"])
    assert main(["import-hf", str(llama), "--out", str(tmp_path / "run")]) == 0


# --------------------------------------------------------------------------------------------
# --out: nothing there unless the import succeeds
# --------------------------------------------------------------------------------------------


def test_out_naming_a_file_is_refused_and_left_alone(llama, tmp_path, capsys, no_allocation):
    (tmp_path / "taken").write_text("keep me")
    assert f"--out {tmp_path / 'taken'} is a file" in _refused(llama, tmp_path / "taken", capsys)
    assert (tmp_path / "taken").read_text() == "keep me"
    err = _refused(llama, tmp_path / "taken" / "run", capsys)
    assert f"{tmp_path / 'taken'} is a file, not a folder" in err


def test_nan_weights_leave_nothing_in_out(llama, tmp_path, capsys):
    def poison(weights):
        weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")

    _rewrite_weights(llama, poison)
    err = _refused(llama, tmp_path / "new" / "run", capsys)
    assert "model.layers.1.mlp.down_proj.weight holds NaN or inf" in err and "model.safetensors" in err
    assert not (tmp_path / "new").exists()  # the parent made for --out is removed again
    (tmp_path / "empty").mkdir()
    _refused(llama, tmp_path / "empty", capsys)
    assert not any((tmp_path / "empty").iterdir())


def test_a_failure_while_writing_leaves_nothing_in_out(llama, tmp_path, capsys, monkeypatch):
    def full_disk(run_dir, *args, **kwargs):
        (run_dir / "checkpoints").mkdir()
        raise OutputError(f"cannot write checkpoint {run_dir}: No space left on device")

    monkeypatch.setattr(hf_import, "save_weights_checkpoint", full_disk)
    assert "No space left" in _refused(llama, tmp_path / "a" / "b" / "run", capsys)
    assert not (tmp_path / "a").exists()


def test_import_into_an_empty_folder_and_from_bf16(llama, tmp_path, capsys):
    """The good paths around the checks: a bf16 checkpoint (headers of another dtype) imports into
    an existing empty folder, which the staged run replaces; nothing else is left beside it."""
    _rewrite_weights(llama, lambda w: w.update({k: v.bfloat16() for k, v in w.items()}))
    (tmp_path / "run").mkdir()
    assert main(["import-hf", str(llama), "--out", str(tmp_path / "run"), "--sequence-len", "32"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    model, _ = ll.load(tmp_path / "run")
    stored = load_file(str(llama / "model.safetensors"))
    torch.testing.assert_close(model.ln_f.weight.detach(), stored["model.norm.weight"].float(), rtol=0, atol=0)
    assert model.config.sequence_len == 32


# --------------------------------------------------------------------------------------------
# What transformers itself would run
# --------------------------------------------------------------------------------------------


def _scale_weights(folder) -> None:
    """Matrices scaled up from transformers' tiny init, so that a RoPE mistake shows in the logits."""
    _rewrite_weights(folder, lambda w: w.update({k: v * WEIGHT_SCALE for k, v in w.items() if "norm" not in k}))


def _logits_match_transformers(folder, run) -> None:
    model, _ = ll.load(run)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.manual_seed(2)
    idx = torch.randint(0, VOCAB, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, reference(idx).logits, rtol=0, atol=IMPORT_TOL)


def test_rope_scaling_added_by_hand_wins_over_rope_parameters(llama, tmp_path, capsys):
    """transformers 5 writes rope_parameters (type default) into every config.json; a rope_scaling
    added by hand (as model cards say) replaces it in transformers, so in the import too."""
    assert json.loads((llama / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    _scale_weights(llama)
    _edit_config(llama, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert main(["import-hf", str(llama), "--out", str(tmp_path / "run")]) == 0
    model, _ = ll.load(tmp_path / "run")
    assert (model.config.rope_scaling, model.config.rope_factor) == ("linear", 4.0)
    _logits_match_transformers(llama, tmp_path / "run")


@pytest.mark.parametrize("changes, words", [
    # a scaling it cannot express is refused, not dropped for rope_parameters' default
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     "rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic' is not supported"),
    # transformers drops rope_parameters' theta along with it and runs 10000: neither can be right for sure
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {"rope_type": "linear",
                                                                                        "factor": 4.0}},
     "transformers then uses rope_theta 10000, not rope_parameters' 500000: add the model's rope_theta"),
])
def test_rope_scaling_beside_rope_parameters_that_cannot_be_imported_is_refused(changes, words, llama, tmp_path,
                                                                                capsys, no_allocation):
    _edit_config(llama, **changes)
    assert words in _refused(llama, tmp_path / "run", capsys)


def test_rope_theta_in_rope_scaling_is_the_one_transformers_uses(llama, tmp_path, capsys):
    _scale_weights(llama)
    _edit_config(llama, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                 rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    assert main(["import-hf", str(llama), "--out", str(tmp_path / "run")]) == 0
    assert ll.load(tmp_path / "run")[0].config.rope_theta == 5e5
    _logits_match_transformers(llama, tmp_path / "run")


def test_a_tied_checkpoints_stored_head_must_be_the_embeddings(llama, tmp_path, capsys):
    """tie_word_embeddings=true over a stored lm_head.weight: transformers 5 uses that head untied,
    transformers 4 ties; only a copy of the embeddings means the same to both."""
    _edit_config(llama, tie_word_embeddings=True)
    err = _refused(llama, tmp_path / "run", capsys)  # the saved (untied) model's own head
    assert "tie_word_embeddings=true" in err and "lm_head.weight differs from model.embed_tokens.weight" in err
    assert "set tie_word_embeddings to false" in err and "remove lm_head.weight" in err
    _rewrite_weights(llama, lambda w: w.update({"lm_head.weight": w["model.embed_tokens.weight"].clone()}))
    assert main(["import-hf", str(llama), "--out", str(tmp_path / "run")]) == 0
    assert ll.load(tmp_path / "run")[0].config.tie_embeddings


def test_a_missing_relative_folder_is_named_when_it_reads_as_a_hub_name(llama, tmp_path, capsys, monkeypatch):
    """`models/llama` that does not exist looks like a Hub name: offline, the error still says that
    there is no such folder, in case a folder was meant."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)
    err = _refused(Path("models/llama"), tmp_path / "run", capsys)
    assert "no folder models/llama" in err and "offline" in err


# --------------------------------------------------------------------------------------------
# Chat templates written for transformers
# --------------------------------------------------------------------------------------------


GENERATION_TAG_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}assistant: "
    "{% generation %}{% set inside = 'scoped' %}{{ m['content'] + eos_token }}{% endgeneration %}{{ inside }}"
    "{% else %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


def test_a_template_with_transformers_generation_tag_renders_as_without_it():
    """transformers' `{% generation %}` marks the assistant's text (return_assistant_tokens_mask);
    here it renders its body as it stands (in a scope of its own, as transformers renders it)."""
    from latentloop.data.chat import render_template, template_spans

    plain = GENERATION_TAG_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain = plain.replace("{% set inside = 'scoped' %}", "")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    context = {"messages": messages, "add_generation_prompt": False, "bos_token": "<s>", "eos_token": "</s>"}
    text = render_template(GENERATION_TAG_TEMPLATE, context)
    assert text == render_template(plain, context) == "<s>user: hi\nassistant: hello</s>user: bye\nassistant: ciao</s>"
    assert template_spans(GENERATION_TAG_TEMPLATE, context) == template_spans(plain, context)


# --------------------------------------------------------------------------------------------
# Memory while importing
# --------------------------------------------------------------------------------------------


def _save_mid_llama(folder) -> int:
    """A ~7M-parameter float32 Llama: big enough that the import's memory shows above the noise.
    Returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    return sum(p.numel() for p in model.parameters())


def test_the_import_builds_no_second_model(llama, tmp_path, monkeypatch):
    """The model is built on the meta device and takes the converted tensors themselves: no second
    float32 copy, no random initialisation, and every tensor real (RoPE tables recomputed)."""
    devices = []
    real_build = hf_import.build_model

    def spy(config):
        devices.append(torch.empty(0).device.type)
        return real_build(config)

    monkeypatch.setattr(hf_import, "build_model", spy)
    hf_import.import_hf(llama, tmp_path / "run")
    assert devices == ["meta"]
    _logits_match_transformers(llama, tmp_path / "run")


def _return_free_memory() -> None:
    """Hand the memory freed so far (the model written above, the warm-up import) back to the system:
    the import would otherwise reuse it without its resident size growing, and measure as free."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pytest.skip("needs glibc's malloc_trim to measure the import's own memory")


def test_import_peak_memory_is_about_one_float32_copy(llama, tmp_path, monkeypatch):
    if not reset_peak_rss():
        pytest.skip("needs Linux's resettable peak RSS (/proc/self/clear_refs)")
    params = _save_mid_llama(tmp_path / "mid")
    hf_import.import_hf(llama, tmp_path / "warm-up")  # what a first import loads once (modules, tokenizer code)
    folder = tmp_path / "mid"
    config = hf_import.config_from_hf(json.loads((folder / "config.json").read_text()))
    headers = hf_checks.read_tensor_headers(folder)
    estimate = hf_checks.import_memory_bytes(config, headers, params)["peak"]
    # the peak up to writing the checkpoint: what safetensors then holds depends on its version
    # (`hf_checks.checkpoint_write_copies`), not on the import
    peak_before_writing = []
    real_save = hf_import.save_weights_checkpoint

    def save(*args, **kwargs):
        peak_before_writing.append(proc_status_bytes("VmHWM"))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(hf_import, "save_weights_checkpoint", save)
    _return_free_memory()
    reset_peak_rss()
    before = proc_status_bytes("VmRSS")
    hf_import.import_hf(folder, tmp_path / "run")
    growth, growth_before_writing = proc_status_bytes("VmHWM") - before, peak_before_writing[0] - before
    fp32 = params * hf_checks.FP32_BYTES
    assert growth_before_writing < IMPORT_PEAK_OVER_FP32 * fp32, (growth_before_writing, fp32)
    assert growth <= estimate, (growth, estimate)  # check_memory's estimate is not below what it takes
