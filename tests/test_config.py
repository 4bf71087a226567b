import os
from pathlib import Path

import pytest
import torch
import yaml

import latentloop as ll
from latentloop.archs import ARCHS
from latentloop.config import (
    PRESETS,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    apply_overrides,
    load_yaml,
    model_config,
)
from latentloop.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def test_presets_have_the_documented_sizes():
    sizes = {name: ll.build("gpt", preset=name).num_params() for name in ("test", "tiny", "small")}
    assert 0.08e6 < sizes["test"] < 0.2e6
    assert 0.5e6 < sizes["tiny"] < 1.5e6
    assert 8e6 < sizes["small"] < 13e6
    gpt2 = model_config("gpt", "gpt2")  # too big to build in a unit test: count analytically
    D, L, V = gpt2.n_embd, gpt2.n_layer, gpt2.vocab_size
    assert abs((12 * D * D * L + V * D) - 124e6) < 2e6
    assert set(PRESETS) >= {"test", "tiny", "small", "gpt2", "1b"}


@pytest.mark.parametrize("field, value, words", [
    ("n_layer", 0, "n_layer"), ("n_embd", 65, "divisible"), ("n_kv_head", 3, "n_kv_head"),
    ("mlp", "gelu", "mlp"), ("logit_softcap", -1.0, "logit_softcap"), ("vocab_size", 1, "vocab_size")])
def test_invalid_model_values_are_named(field, value, words):
    with pytest.raises(ll.ConfigError, match=words):
        model_config("gpt", "test", **{field: value})


def test_unknown_names_are_rejected():
    with pytest.raises(ll.ConfigError, match="unknown arch"):
        model_config("transformer-xl")
    with pytest.raises(ll.ConfigError, match="unknown preset"):
        model_config("gpt", "huge")
    with pytest.raises(ll.ConfigError, match="n_layers"):
        model_config("gpt", "test", n_layers=3)


def test_overrides_dotted_bare_and_typed():
    raw = apply_overrides({"model": {"preset": "test"}}, ["n_layer=3", "train.lr=1e-3", "data.source=text:x",
                                                          "tie_embeddings=true"])
    config = RunConfig.from_dict(raw)
    assert config.model.n_layer == 3 and config.model.tie_embeddings is True
    assert config.train.lr == pytest.approx(1e-3) and config.data.source == "text:x"
    with pytest.raises(ll.ConfigError, match="key=value"):
        apply_overrides({}, ["n_layer"])
    with pytest.raises(ll.ConfigError, match="unknown config field"):
        apply_overrides({}, ["bogus=1"])
    with pytest.raises(ll.ConfigError, match="train.steps"):
        RunConfig.from_dict(apply_overrides({}, ["steps=ten"]))


def test_an_arch_set_by_override_gives_its_own_fields_to_the_others():
    """`--set arch=fbt --set jitter=0` (in either order, bare or dotted): the arch the overrides name
    decides which model fields they may set, not the one the config held before them."""
    for overrides in (["arch=fbt", "jitter=0.5"], ["jitter=0.5", "model.arch=fbt"],
                      ["model.arch=fbt", "model.jitter=0.5"]):
        config = RunConfig.from_dict(apply_overrides({}, overrides))
        assert config.model.arch == "fbt" and config.model.jitter == 0.5
    with pytest.raises(ll.ConfigError, match="unknown config field 'jitter'"):
        apply_overrides({"model": {"arch": "fbt"}}, ["arch=gpt", "jitter=0.5"])


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_config_built_in_python_is_checked_as_a_yaml_file_is(arch):
    """Every config class converts and refuses its fields' values as a YAML file's are read: a wrong
    type is one ConfigError naming the field, never a TypeError from a comparison or from torch."""
    config_class = ARCHS[arch].config_class
    assert config_class(n_layer="4", n_embd=64.0).n_layer == 4
    for fields, words in (({"n_layer": 2.5}, "n_layer has an invalid value 2.5"), ({"n_layer": True}, "n_layer"),
                          ({"mlp_ratio": "wide"}, "mlp_ratio"), ({"mlp": None}, "mlp must not be null"),
                          ({"rope_theta": float("inf")}, "rope_theta must be a finite number")):
        with pytest.raises(ll.ConfigError, match=words):
            config_class(**fields)


@pytest.mark.parametrize("fields, words", [
    ({"device": None}, "device must not be null"), ({"compile": 2}, "compile must be true or false"),
    ({"trackers": {"wandb": 1}}, "trackers must be a list"), ({"betas": {0.9: 1, 0.95: 2}}, "betas must be a list"),
    ({"betas": [0.9, True]}, r"betas\[1\] must be a number"), ({"lr": "fast"}, "lr has an invalid value")])
def test_train_fields_of_the_wrong_type_are_named(fields, words):
    with pytest.raises(ll.ConfigError, match=words):
        TrainConfig(**fields)
    assert TrainConfig(betas=[0.8, "0.9"], trackers="wandb,wandb", compile=1).betas == (0.8, 0.9)


def test_what_python_code_passes_for_a_field_is_taken_as_it_was():
    """Paths for strings, numpy arrays, ranges and tensors for lists, numpy scalars and bools, and any
    64-bit seed: built in Python, these configs were taken before the type checks, and still are."""
    import numpy as np

    data = DataConfig(tokenizer=Path("tok.json"), source=Path("corpus"))
    assert (data.tokenizer, data.source) == ("tok.json", "corpus")
    train = TrainConfig(betas=np.array([0.5, 0.25]), compile=np.bool_(True), seed=2**50, steps=np.int64(3))
    assert train.betas == (0.5, 0.25) and train.compile is True and train.seed == 2**50 and train.steps == 3
    assert TrainConfig(seed=str(2**62 + 1)).seed == 2**62 + 1  # a digit string exactly (a float would round it)
    lrt = ARCHS["lrt"].config_class
    assert lrt(inject_layers=range(2)).inject_layers == lrt(inject_layers=np.array([0, 1])).inject_layers == (0, 1)
    assert ModelConfig(tie_embeddings=np.bool_(True), n_layer=torch.tensor(3)).n_layer == 3
    with pytest.raises(ll.ConfigError, match="n_layer has an invalid value"):
        ModelConfig(n_layer=np.float32(0.7))  # numpy's float32 is no Python float: refused all the same
    with pytest.raises(ll.ConfigError, match="betas must be a list"):
        TrainConfig(betas={0.9, 0.95})  # a set has no order


def test_data_fields_of_the_wrong_type_are_named():
    with pytest.raises(ll.ConfigError, match="source must be a string"):
        DataConfig(source=True)
    assert DataConfig(val_fraction="0.1").val_fraction == 0.1


@pytest.mark.parametrize("items, words", [("[0.7, 1.9]", r"inject_layers\[0\] has an invalid value 0.7"),
                                          ("[true]", r"inject_layers\[0\] must be an integer")])
def test_a_list_of_integers_refuses_what_one_integer_refuses(items, words):
    with pytest.raises(ll.ConfigError, match=words):
        RunConfig.from_dict(apply_overrides({}, ["arch=lrt", f"inject_layers={items}"]))
    config = RunConfig.from_dict(apply_overrides({}, ["arch=lrt", "inject_layers=[0, 1.0]"]))
    assert config.model.inject_layers == (0, 1)


def test_round_trip_through_dict():
    config = RunConfig.from_dict({"model": {"arch": "gpt", "preset": "tiny", "n_kv_head": 2}, "train": {"steps": 7}})
    again = RunConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    assert again.model.n_kv_head == 2 and again.train.steps == 7


def test_every_yaml_config_file_parses():
    files = sorted(CONFIG_DIR.glob("*.yaml"))
    assert files, "configs/*.yaml missing"
    for file in files:
        config = RunConfig.from_dict(load_yaml(file))
        assert config.model.n_layer >= 1, file


def test_yaml_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ll.ConfigError, match="not valid YAML"):
        load_yaml(bad)
    with pytest.raises(ll.ConfigError, match="not found"):
        load_yaml(tmp_path / "missing.yaml")
    (tmp_path / "sec.yaml").write_text(yaml.safe_dump({"modle": {}}))
    with pytest.raises(ll.ConfigError, match="modle"):
        RunConfig.from_dict(load_yaml(tmp_path / "sec.yaml"))


@pytest.mark.parametrize("text, words", [
    ("model: [1, 2]", "config section 'model' must be a mapping of fields, got list"),
    ("model: abc", "config section 'model' must be a mapping of fields, got str"),
    ("train: 5", "config section 'train' must be a mapping of fields, got int"),
    ("model: {arch: [gpt]}", "arch must be a name, got list"),
    ("model: {preset: {a: 1}}", "preset must be a name, got dict"),
])
def test_a_config_section_of_the_wrong_shape_is_one_line_for_train_plan_and_a_saved_run(tmp_path, capsys, text,
                                                                                          words):
    """A section that is not a mapping, or an arch/preset that is not a name, ended `train`, `plan`
    and every command reading a run's config.json in a TypeError or ValueError traceback."""
    import json

    from latentloop.checkpoint import read_run_config
    from latentloop.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(text + "\n")
    commands = [["train", "--config", str(config), "--steps", "1", "--out", str(tmp_path / "run")]]
    if "section" in words:  # plan's own --arch and --preset replace a config's
        commands.append(["plan", "--arch", "gpt", "--preset", "test", "--tokens", "1M", "--config", str(config)])
    for argv in commands:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and words in err, err
    assert not (tmp_path / "run").exists()
    assert main(["train", "--arch", "gpt", "--preset", "test", "--set", "arch=[1]", "--out", str(tmp_path / "r")]) == 2
    assert "arch must be a name, got list" in capsys.readouterr().err
    run = tmp_path / "saved"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(yaml.safe_load(text)))
    with pytest.raises(ll.CheckpointError, match="is invalid"):
        read_run_config(run / "checkpoints" / "step_00000001")


def test_a_config_file_that_is_not_utf8_is_one_line_and_exit_2(tmp_path, capsys):
    from latentloop.cli import main

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model:\n  arch: gpt\n# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ll.ConfigError, match="not UTF-8 text"):
        load_yaml(latin1)
    capsys.readouterr()
    assert main(["train", "--config", str(latin1), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not UTF-8" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_every_user_error_line_survives_an_exception_without_a_message():
    """`first_line` is the one way an error becomes a line: an empty message gives the class's name
    (`str(exc).splitlines()[0]` raised IndexError on it), and no module writes the other way."""
    from pathlib import Path

    from latentloop.util import first_line

    assert first_line(ValueError()) == "ValueError" and first_line(ValueError("  \n")) == "ValueError"
    assert first_line(ValueError("one\ntwo")) == "one"
    package = Path(ll.__file__).parent
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if "splitlines()[0]" in p.read_text() and p.name != "util.py"]
    assert not offenders, f"write first_line(exc) instead of str(exc).splitlines()[0] in {offenders}"


@pytest.mark.parametrize("section, field", [("train", "batch_size"), ("train", "grad_accum"), ("model", "sequence_len"),
                                            ("model", "vocab_size"), ("train", "steps")])
def test_an_integer_past_any_real_count_is_one_line(section, field):
    """99999999999999999999 (67 bits) passed the checks and overflowed torch's 64-bit arguments
    (OverflowError, "Overflow when unpacking long") in plan and train."""
    from latentloop.config import MAX_CONFIG_INT

    for value in (10**20, MAX_CONFIG_INT + 1):
        raw = {"model": {"preset": "test"}, section: {field: value}}
        if section == "model":
            raw["model"][field] = value
        with pytest.raises(ll.ConfigError, match=f"{field} must be at most"):
            RunConfig.from_dict(raw)


def test_a_bpe_vocabulary_past_any_real_one_is_refused_before_training():
    from latentloop.data.tokenizers import MAX_BPE_VOCAB_SIZE, BPETokenizer

    with pytest.raises(ll.ConfigError, match="past the"):
        BPETokenizer.train(["some text"], MAX_BPE_VOCAB_SIZE + 1)  # 4e9 aborted the process (exit 134)


@pytest.mark.parametrize("text, message", [
    ("model:\n  arch: gpt\n  n_layer: 2\n  n_layer: 3\n",
     r"line 4: 'n_layer' is given twice in one section \(first at line 3\)"),
    ("model:\n  arch: gpt\n  on: 2\n", r"line 3: the key 'on' is read as bool True, not a name"),
    ("train:\n  1: 2\n", r"line 2: the key '1' is read as int 1, not a name"),
    ("null: 2\n", r"line 1: the key 'null' is read as NoneType None"),
])
def test_a_config_file_whose_meaning_yaml_would_change_silently_is_refused(tmp_path, text, message):
    """PyYAML keeps the last of a key written twice, and reads `on:`, `null:`, `1:` as a bool, None
    or a number, which crashed the config's construction with a TypeError."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_yaml(path)


def test_a_merge_key_may_be_overridden_and_a_pipe_is_read(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("base: &b\n  n_layer: 2\nmodel:\n  <<: *b\n  n_layer: 3\n")
    assert load_yaml(path)["model"] == {"n_layer": 3}
    # a mapping merged elsewhere before its own turn comes (PyYAML writes the merge into it in place):
    # its override of a merged key is not "given twice"
    path.write_text("templates:\n  small: &small\n    <<: {n_layer: 2, n_embd: 64}\n    n_layer: 3\n"
                    "model:\n  <<: *small\n  arch: gpt\n")
    assert load_yaml(path)["model"] == {"n_layer": 3, "n_embd": 64, "arch": "gpt"}
    read, write = os.pipe()  # `--config <(...)`: a path that is no regular file
    os.write(write, b"model:\n  arch: gpt\n")
    os.close(write)
    try:
        assert load_yaml(f"/dev/fd/{read}") == {"model": {"arch": "gpt"}}
    finally:
        os.close(read)


def test_a_yaml_alias_bomb_is_refused_in_one_short_line():
    """600 bytes of YAML aliases are a list of 10**9 strings: the refusal put the whole value's repr in its
    message and ran out of memory (a MemoryError traceback after 100 s; review). The message shows a few
    items of a few levels."""
    source = "x: &b0 [" + ", ".join(['"lol"'] * 10) + "]\n"
    for level in range(1, 9):
        source += f"b{level}: &b{level} [" + ", ".join([f"*b{level - 1}"] * 10) + "]\n"
    value = yaml.safe_load(source)["b8"]  # 10**8 leaves, shared: cheap to hold, not to print
    for given, said in (({"train": {"muon_exclude": value}}, "train.muon_exclude must be names"),
                        ({"model": value}, "config section 'model' must be a mapping of fields"),
                        ({"model": {"arch": value}}, "arch must be a name, got list")):  # a later review's
        with pytest.raises(ConfigError) as refused:
            RunConfig.from_dict(given)
        message = str(refused.value)
        assert said in message and len(message) < 400, message[:500]
