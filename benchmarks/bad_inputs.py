"""The bad-input tally: every way a user can get the command line wrong that we know of, each run
in-process through `latentloop.cli.main`; a case passes when it ends with exit code 2 and exactly
one line on stderr (no traceback) naming the problem, and nothing already written was changed.
Then what lies beyond the command line: the sandbox's verdict against a program that walks its
frames (where the sandbox can run), and `latentloop serve` answering hostile requests (deeply nested
JSON, bodies too large to buffer, declared or chunked, prompts of 15 MB beside a normal request whose
slowdown is tallied, SIGTERM with requests in flight) and staying healthy.

    python -m benchmarks.bad_inputs [--json tally.json] [--verbose] [--only server]

It builds what the cases need in a temporary folder first (a corpus, three tiny trained runs, a
corrupt run, files where folders are expected, Hugging Face folders with one thing wrong, an fsdp2
run with a planted, a bit-flipped and a cut-short `dcp/`), about two minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from latentloop.cli import main

EXIT_USAGE = 2


CHAT_INPUT = "hello\n"  # what `chat` cases read on stdin: one message, then the end of input


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            _stdin(io.StringIO(CHAT_INPUT)):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own rejections
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # a traceback: the case fails
            return -1, f"{type(exc).__name__}: {exc}"
    return code, err.getvalue().strip()


@contextlib.contextmanager
def _stdin(stream):
    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


def screen_lines(stderr: str) -> list[str]:
    """The lines a terminal would show: a carriage return (progress bars) rewrites its line."""
    return [shown for line in stderr.split("\n") if (shown := line.split("\r")[-1].strip())]


def _digest(folder: Path) -> str:
    """A fingerprint of every file under `folder` (names and bytes), to show nothing was touched."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ".lock"):
        h.update(str(path.relative_to(folder)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def build_fixtures(root: Path) -> dict[str, str]:
    corpus = root / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 400)
    (root / "empty.txt").write_text("")
    (root / "a_file").write_text("not a folder")
    (root / "bad.yaml").write_text("model: [unclosed\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    runs = {}
    from latentloop.archs import ARCHS

    for arch in ARCHS:  # a tiny trained run of every registered architecture
        runs[arch] = root / arch
        code, err = _run(["train", "--arch", arch, "--preset", "test", "--data", f"text:{corpus}", "--steps", "2",
                          "--set", "batch_size=2", "--out", str(runs[arch]), "--no-progress"])
        if code != 0:
            raise SystemExit(f"fixture run {arch} failed: {err}")
    corrupt = root / "corrupt"
    shutil.copytree(runs["gpt"], corrupt)
    for weights in corrupt.rglob("model.safetensors"):
        weights.write_bytes(b"\x00" * 64)
    badconfig = root / "badconfig"
    shutil.copytree(runs["gpt"], badconfig)
    for config in badconfig.rglob("config.json"):
        config.write_text('{"model": {"arch": "gpt", "n_layer": 64, "n_embd": 131072, "n_head": 1}}')
    tok = root / "tok"
    tok.mkdir()
    code, err = _run(["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "300", "--out", str(tok)])
    if code != 0:
        raise SystemExit(f"fixture tokenizer failed: {err}")
    hf = root / "hf_bad"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return {"root": str(root), "corpus": str(corpus), "empty": str(root / "empty.txt"),
            "file": str(root / "a_file"), "badyaml": str(root / "bad.yaml"), "listyaml": str(root / "list.yaml"),
            "corrupt": str(corrupt), "badconfig": str(badconfig), "tok": str(tok), "hf": str(hf),
            **{arch: str(path) for arch, path in runs.items()}, **_hf_fixtures(root, tok),
            **_sharded_fixtures(root, corpus), "busy_port": str(_busy_port()), **_template_fixtures(root),
            **_checkpoint_fixtures(root, runs["gpt"]), "serve_small": _serve_small_run(root, tok)}


def server_fixtures(root: Path) -> dict[str, str]:
    """What `server_cases` alone needs (`--only server`): the template runs and the small BPE run."""
    corpus = root / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 400)
    tok = root / "tok"
    tok.mkdir()
    code, err = _run(["tokenizer", "train", "--data", f"text:{corpus}", "--vocab-size", "300", "--out", str(tok)])
    if code != 0:
        raise SystemExit(f"fixture tokenizer failed: {err}")
    return {"root": str(root), **_template_fixtures(root), "serve_small": _serve_small_run(root, tok)}


def _serve_small_run(root: Path, tok: Path) -> str:
    """A random-init gpt of the `small` preset (512 tokens of context) with the fixtures' BPE tokenizer:
    a normal request takes tens of milliseconds, and a 15 MB one-word prompt took a tokenizer thread
    for seconds."""
    import torch

    from latentloop.api import build
    from latentloop.data.tokenizers import BPETokenizer
    from latentloop.runs import save_run

    tokenizer = BPETokenizer.load(tok)
    torch.manual_seed(0)
    save_run(build("gpt", preset="small", vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id), tokenizer,
             root / "serve_small")
    return str(root / "serve_small")


# The files of a plain checkpoint, and those `generate` reads (the others a resume reads)
CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "state.json", "trainer.json",
                    "trainer.safetensors")
LOADED = ("model.safetensors", "config.json", "tokenizer.json")


def _flipped(name: str) -> str:
    """The fixture key (and folder) of a run with a bit flipped in its checkpoint's file `name`."""
    return "flip_" + name.replace(".", "_")


def _checkpoint_fixtures(root: Path, run: Path) -> dict[str, str]:
    """Copies of a trained run with one thing wrong in its checkpoint each: a bit flipped in one file, a
    hand-edited step (checksums rewritten to agree), NaN weights (likewise); and a config in Latin-1."""
    from safetensors.torch import load_file, save_file

    from latentloop import checkpoint as ckpt

    (root / "latin1.yaml").write_bytes("model:\n  arch: gpt\n# caf\u00e9\n".encode("latin-1"))
    made = {"latin1yaml": str(root / "latin1.yaml")}
    for name in CHECKPOINT_FILES:
        copy = Path(shutil.copytree(run, root / _flipped(name)))
        target = ckpt.resolve_checkpoint(copy) / name
        raw = bytearray(target.read_bytes())
        raw[len(raw) * 2 // 3] ^= 0x01
        target.write_bytes(bytes(raw))
        made[_flipped(name)] = str(copy)
    for key, step in (("step_minus", -1), ("step_huge", 999999)):
        copy = Path(shutil.copytree(run, root / key))
        checkpoint = ckpt.resolve_checkpoint(copy)
        state = json.loads((checkpoint / "state.json").read_text())
        (checkpoint / "state.json").write_text(json.dumps({**state, "step": step}))
        ckpt.write_checksums(checkpoint)
        made[key] = str(copy)
    # a run whose state.json names another text file than it trained on (checksums rewritten to agree):
    # eval without --data reads a run's own text only when its tokens are what training recorded
    copy = Path(shutil.copytree(run, root / "redirected"))
    checkpoint = ckpt.resolve_checkpoint(copy)
    state = json.loads((checkpoint / "state.json").read_text())
    (checkpoint / "state.json").write_text(json.dumps({**state, "data_source": f"text:{root / 'a_file'}"}))
    ckpt.write_checksums(checkpoint)
    made["redirected"] = str(copy)
    copy = Path(shutil.copytree(run, root / "nan_weights"))
    checkpoint = ckpt.resolve_checkpoint(copy)
    weights = load_file(str(checkpoint / "model.safetensors"))
    weights["wte.weight"][0, 0] = float("nan")
    save_file(weights, str(checkpoint / "model.safetensors"))
    ckpt.write_checksums(checkpoint)
    made["nan_weights"] = str(copy)
    return made

# Chat templates that would hang or exhaust the process that renders them.
TEMPLATES = {
    "tpl_loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "tpl_lipsum": "{{ lipsum(10**7) }}",
    "tpl_huge": "{{ 'a' * 10**10 }}",
    "tpl_indent": "{{ messages | tojson(indent=10**10) }}",
    # one that loops only on a message that says "loop": it passes serve's startup probe
    "tpl_cond": "{% for m in messages %}{% if m['content'] == 'loop' %}{% for i in range(100000) %}"
                "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
                "{{ m['role'] + ': ' + m['content'] + '\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
    "tpl_nothing": "{# nothing #}",  # renders nothing: no reply to train on, no prompt to answer (issue 49)
    # and one that works, for the cases about something else
    "tpl_plain": "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
}


def _template_fixtures(root: Path) -> dict[str, str]:
    """Runs whose Hugging Face tokenizer carries one of TEMPLATES, and a chat file with a 5,000-digit number."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from latentloop.api import build
    from latentloop.data.tokenizers import HFTokenizer
    from latentloop.runs import save_run

    made = {}
    for name, template in TEMPLATES.items():
        folder = root / f"{name}_tokenizer"
        folder.mkdir()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(["hello world, the latent loop carries state forward. " * 40], trainer=trainer)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}))
        hf = HFTokenizer.from_pretrained_folder(folder)
        save_run(build("gpt", preset="test", vocab_size=hf.vocab_size, bos_id=hf.bos_id), hf, root / name)
        made[name] = str(root / name)
    digits = root / "digits.jsonl"
    digits.write_text('{"question": ' + "9" * 5000 + ', "answer": "x"}\n')
    made["digits"] = str(digits)
    return made


# A Llama-3-70B shape: its config.json over a checkpoint of a few KB must be refused before allocating.
LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)
TINY_LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1}


def _hf_llama(root: Path, tok: Path, name: str, changes: dict | None = None, poison: bool = False,
              index_lists: bool = False, tokenizer_bytes: bytes | None = None) -> str:
    """A tiny Llama checkpoint folder as Hugging Face saves one, with one thing wrong."""
    import torch
    from safetensors.torch import save_file

    from latentloop.interop.hf_checks import expected_hf_tensors
    from latentloop.interop.hf_import import config_from_hf

    folder = root / name
    folder.mkdir()
    weights = {n: torch.randn(shape) * 0.02 for n, shape, _ in expected_hf_tensors(config_from_hf(TINY_LLAMA))}
    if poison:
        weights["model.norm.weight"][0] = float("nan")
    save_file(weights, str(folder / "model.safetensors"))
    if index_lists:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {n: ["model.safetensors"] for n in weights}}))
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA | (changes or {})))
    if tokenizer_bytes is None:
        shutil.copy(tok / "tokenizer.json", folder / "tokenizer.json")
    else:
        (folder / "tokenizer.json").write_bytes(tokenizer_bytes)
    return str(folder)


def _hf_fixtures(root: Path, tok: Path) -> dict[str, str]:
    return {"hfok": _hf_llama(root, tok, "hf_ok"), "hf70b": _hf_llama(root, tok, "hf_70b", LLAMA_70B),
            "hfeps": _hf_llama(root, tok, "hf_eps", {"rms_norm_eps": {}}),
            "hfrope": _hf_llama(root, tok, "hf_rope", {"rope_scaling": {"rope_type": "llama3"}}),
            "hfvocab": _hf_llama(root, tok, "hf_vocab", {"vocab_size": 2e9}),
            "hfbintok": _hf_llama(root, tok, "hf_bintok", tokenizer_bytes=b"\x89PNG\r\n\x1a\n\x00\xff"),
            "hfnan": _hf_llama(root, tok, "hf_nan", poison=True),
            "hfindex": _hf_llama(root, tok, "hf_index", index_lists=True),
            "hfnothing": _hf_empty_template(root, tok)}


class _Payload:
    """A pickle that would create MARKER when unpickled: it must never be."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _sharded_fixtures(root: Path, corpus: Path) -> dict[str, str]:
    """An fsdp2 run (one process) whose dcp/ is then planted with a payload, bit-flipped or cut short."""
    import pickle

    from latentloop.checkpoint import write_sharded_checksums

    sharded = root / "sharded"
    code, err = _run(["train", "--arch", "gpt", "--preset", "test", "--data", f"text:{corpus}", "--steps", "2",
                      "--set", "batch_size=2", "--set", "train.strategy=fsdp2", "--set", "train.full_weights=false",
                      "--out", str(sharded), "--no-progress"])
    if code != 0:
        raise SystemExit(f"fixture sharded run failed: {err}")
    made = {}
    for name in ("dcp_planted", "dcp_flipped", "dcp_cut"):
        folder = root / name
        shutil.copytree(sharded, folder)
        dcp = next(folder.glob("checkpoints/step_*/dcp"))
        if name == "dcp_planted":  # an attacker rewrites the checksums too: the allow-list must stop it
            (dcp / ".metadata").write_bytes(pickle.dumps(_Payload(root / PWNED)))
            (dcp / "checksums.json").unlink()
            write_sharded_checksums(dcp)
        elif name == "dcp_flipped":
            shard = next(dcp.glob("*.distcp"))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 1
            shard.write_bytes(bytes(data))
        else:
            metadata = dcp / ".metadata"
            metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
            (dcp / "checksums.json").unlink()
        made[name] = str(folder)
    return made


PWNED = "pwned"  # the file a planted payload would create under the fixtures' root


def _busy_port() -> int:
    """A port something listens on for the whole tally (kept open by a module-level socket)."""
    import socket

    global _LISTENER
    _LISTENER = socket.create_server(("127.0.0.1", 0))
    return _LISTENER.getsockname()[1]


_LISTENER = None


CASES: list[tuple[str, list[str]]] = [
    # train
    ("unknown arch", ["train", "--arch", "nope", "--out", "{root}/o1"]),
    ("unknown preset", ["train", "--preset", "huge", "--out", "{root}/o2"]),
    ("impossible shape", ["train", "--set", "n_head=3", "--out", "{root}/o3"]),
    ("unknown field", ["train", "--set", "wings=2", "--out", "{root}/o4"]),
    ("ambiguous override", ["train", "--set", "nonsense", "--out", "{root}/o5"]),
    ("infinite lr", ["train", "--lr", "inf", "--out", "{root}/o6"]),
    ("nan lr", ["train", "--lr", "nan", "--out", "{root}/o7"]),
    ("infinite softcap", ["train", "--set", "logit_softcap=inf", "--out", "{root}/o8"]),
    ("steps 0", ["train", "--steps", "0", "--out", "{root}/o9"]),
    ("huge seed", ["train", "--seed", "100000000000000000000000", "--out", "{root}/o10"]),
    ("negative seed", ["train", "--seed", "-1", "--out", "{root}/o11"]),
    ("batch size 0", ["train", "--batch-size", "0", "--out", "{root}/o12"]),
    ("missing data", ["train", "--data", "text:{root}/missing.txt", "--out", "{root}/o13"]),
    ("empty data", ["train", "--data", "text:{empty}", "--out", "{root}/o14"]),
    ("unknown source", ["train", "--data", "ftp:x", "--out", "{root}/o15"]),
    ("missing config", ["train", "--config", "{root}/missing.yaml", "--out", "{root}/o16"]),
    ("invalid YAML", ["train", "--config", "{badyaml}", "--out", "{root}/o17"]),
    ("YAML not a mapping", ["train", "--config", "{listyaml}", "--out", "{root}/o18"]),
    ("out is a file", ["train", "--data", "text:{corpus}", "--preset", "test", "--out", "{file}"]),
    ("out under a file", ["train", "--data", "text:{corpus}", "--preset", "test", "--out", "{file}/run"]),
    ("out holds a run", ["train", "--data", "text:{corpus}", "--preset", "test", "--out", "{gpt}"]),
    ("resume nothing", ["train", "--resume", "--out", "{root}/nothing"]),
    ("resume another run", ["train", "--resume", "--arch", "fbt", "--out", "{gpt}"]),
    ("iso on gpt", ["train", "--iso", "flops", "--data", "text:{corpus}", "--out", "{root}/o19"]),
    ("init-from missing", ["train", "--init-from", "{root}/missing", "--data", "text:{corpus}", "--out", "{root}/o20"]),
    ("init-from corrupt", ["train", "--init-from", "{corrupt}", "--data", "text:{corpus}", "--out", "{root}/o21"]),
    ("device cuda", ["train", "--device", "cuda", "--data", "text:{corpus}", "--out", "{root}/o22"]),
    ("device cuda:abc", ["train", "--device", "cuda:abc", "--data", "text:{corpus}", "--out", "{root}/o23"]),
    ("device tpu", ["train", "--device", "tpu", "--data", "text:{corpus}", "--out", "{root}/o24"]),
    ("diverging run", ["train", "--lr", "1e30", "--preset", "test", "--steps", "4", "--data", "text:{corpus}",
                       "--set", "batch_size=2", "--out", "{root}/o25", "--no-progress"]),
    # eval
    ("eval no run", ["eval", "{root}/missing"]),
    ("eval not a run", ["eval", "{file}"]),
    ("eval corrupt weights", ["eval", "{corrupt}", "--data", "text:{corpus}"]),
    ("eval oversized config", ["eval", "{badconfig}", "--data", "text:{corpus}"]),
    ("eval limit without tasks", ["eval", "{gpt}", "--limit", "3"]),
    ("eval unknown task", ["eval", "{gpt}", "--tasks", "nope"]),
    ("eval regime on gpt", ["eval", "{gpt}", "--regime", "soft", "--data", "text:{corpus}"]),
    ("eval passes 0", ["eval", "{fbt}", "--regime", "fused", "--passes", "0", "--data", "text:{corpus}"]),
    ("eval passes text", ["eval", "{fbt}", "--regime", "fused", "--passes", "many", "--data", "text:{corpus}"]),
    ("eval passes without fused", ["eval", "{fbt}", "--passes", "2", "--data", "text:{corpus}"]),
    ("eval steps 0", ["eval", "{rgpt}", "--steps", "0", "--data", "text:{corpus}"]),
    ("eval exit nan", ["eval", "{rgpt}", "--exit-threshold", "nan", "--data", "text:{corpus}"]),
    ("eval cache mode", ["eval", "{rgpt}", "--cache-mode", "half", "--data", "text:{corpus}"]),
    ("eval batch 0", ["eval", "{gpt}", "--batch-size", "0"]),
    ("eval data missing", ["eval", "{gpt}", "--data", "text:{root}/missing.txt"]),
    ("eval a run pointing at other text", ["eval", "{redirected}"]),
    # generate
    ("prompt too long", ["generate", "{gpt}", "--prompt", "y" * 200]),
    ("top-p 1.5", ["generate", "{gpt}", "--prompt", "x", "--top-p", "1.5"]),
    ("top-p 0", ["generate", "{gpt}", "--prompt", "x", "--top-p", "0"]),
    ("top-k 0", ["generate", "{gpt}", "--prompt", "x", "--top-k", "0"]),
    ("temperature nan", ["generate", "{gpt}", "--prompt", "x", "--temperature", "nan"]),
    ("temperature negative", ["generate", "{gpt}", "--prompt", "x", "--temperature", "-1"]),
    ("generate huge seed", ["generate", "{gpt}", "--prompt", "x", "--seed", "100000000000000000000000"]),
    ("max-new-tokens -1", ["generate", "{gpt}", "--prompt", "x", "--max-new-tokens", "-1"]),
    ("non-UTF-8 prompt", ["generate", "{gpt}", "--prompt", "caf\udce9"]),
    ("regime on gpt", ["generate", "{gpt}", "--prompt", "x", "--regime", "soft"]),
    ("unknown regime", ["generate", "{fbt}", "--prompt", "x", "--regime", "hard"]),
    ("passes unbounded", ["generate", "{fbt}", "--prompt", "x", "--regime", "fused", "--passes", "1000000000"]),
    ("steps unbounded", ["generate", "{rgpt}", "--prompt", "x", "--steps", "100000"]),
    ("exit without cache", ["generate", "{rgpt}", "--prompt", "x", "--exit-threshold", "0.1", "--no-cache"]),
    ("interleaved without cache", ["generate", "{lrt}", "--prompt", "x", "--prefill", "interleaved", "--no-cache"]),
    ("generate no run", ["generate", "{root}/missing", "--prompt", "x"]),
    ("generate device", ["generate", "{gpt}", "--prompt", "x", "--device", "cuda:abc"]),
    # tokenizer
    ("vocab too small", ["tokenizer", "train", "--data", "text:{corpus}", "--vocab-size", "10", "--out", "{root}/t1"]),
    ("tokenizer overwrite", ["tokenizer", "train", "--data", "text:{corpus}", "--vocab-size", "300", "--out", "{tok}"]),
    ("tokenizer over a run", ["tokenizer", "train", "--data", "text:{corpus}", "--vocab-size", "300",
                              "--out", "{gpt}"]),
    ("tokenizer under a file", ["tokenizer", "train", "--data", "text:{corpus}", "--vocab-size", "300",
                                "--out", "{file}/tok"]),
    ("tokenizer missing data", ["tokenizer", "train", "--data", "text:{root}/missing.txt", "--vocab-size", "300",
                                "--out", "{root}/t2"]),
    # analyze, compare, demo
    ("analyze wrong arch", ["analyze", "depth", "{gpt}"]),
    ("analyze no run", ["analyze", "contraction", "{root}/missing"]),
    ("analyze out is a file", ["analyze", "contraction", "{fbt}", "--passes", "2", "--out", "{file}"]),
    ("analyze negative threshold", ["analyze", "depth", "{rgpt}", "--exit-threshold", "-1"]),
    ("compare no run", ["compare", "{root}/missing"]),
    ("compare out is a file", ["compare", "{gpt}", "--out", "{file}"]),
    ("demo minutes nan", ["demo", "--minutes", "nan", "--out", "{root}/d1"]),
    ("demo minutes negative", ["demo", "--minutes", "-1", "--out", "{root}/d2"]),
    ("demo unknown arch", ["demo", "--archs", "nope", "--out", "{root}/d3"]),
    ("demo unknown preset", ["demo", "--preset", "huge", "--out", "{root}/d4"]),
    # serve, import, export
    ("serve open host without key", ["serve", "{gpt}", "--host", "0.0.0.0"]),
    ("serve no run", ["serve", "{root}/missing"]),
    ("import-hf missing", ["import-hf", "{root}/missing", "--out", "{root}/i1"]),
    ("import-hf unsupported", ["import-hf", "{hf}", "--out", "{root}/i2"]),
    ("export no run", ["export", "{root}/missing", "--format", "hf", "--out", "{root}/e1"]),
    ("export plain nanochat", ["export", "{gpt}", "--format", "hf", "--plain", "--out", "{root}/e2"]),
    # reliability, round 2: checkpoints of fsdp2 runs
    ("export-dcp planted dcp metadata", ["export-dcp", "{dcp_planted}"]),
    ("resume planted dcp metadata", ["train", "--resume", "--out", "{dcp_planted}", "--steps", "3", "--no-progress",
                                     "--set", "train.strategy=none"]),  # fsdp2 in-process would leave a group up
    ("export-dcp flipped shard bit", ["export-dcp", "{dcp_flipped}"]),
    ("export-dcp cut-short dcp metadata", ["export-dcp", "{dcp_cut}"]),
    # import-hf checks before it allocates
    ("import-hf 70B config", ["import-hf", "{hf70b}", "--out", "{root}/i3"]),
    ("import-hf eps not a number", ["import-hf", "{hfeps}", "--out", "{root}/i4"]),
    ("import-hf llama3 rope without factor", ["import-hf", "{hfrope}", "--out", "{root}/i5"]),
    ("import-hf vocab 2e9", ["import-hf", "{hfvocab}", "--out", "{root}/i6"]),
    ("import-hf binary tokenizer", ["import-hf", "{hfbintok}", "--out", "{root}/i7"]),
    ("import-hf NaN weights", ["import-hf", "{hfnan}", "--out", "{root}/i8"]),
    ("import-hf weight_map lists", ["import-hf", "{hfindex}", "--out", "{root}/i9"]),
    ("import-hf out is a file", ["import-hf", "{hfok}", "--out", "{file}"]),
    # chat templates that would hang or exhaust the renderer (each waits out the 5 s limit)
    ("chat looping template", ["chat", "{tpl_loop}"]),
    ("chat lipsum(10**7)", ["chat", "{tpl_lipsum}"]),
    ("chat 'a'*10**10", ["chat", "{tpl_huge}"]),
    ("chat tojson indent 10**10", ["chat", "{tpl_indent}"]),
    ("sft looping template", ["train", "--stage", "sft", "--init-from", "{tpl_loop}", "--data",
                              "chat:task:addition_steps:n=8", "--steps", "1", "--batch-size", "2",
                              "--out", "{root}/s1", "--no-progress"]),
    ("serve looping template (startup probe)", ["serve", "{tpl_loop}", "--port", "0"]),
    ("chat temperature nan", ["chat", "{tpl_plain}", "--temperature", "nan"]),
    ("sft row with a 5,000-digit number", ["train", "--stage", "sft", "--init-from", "{gpt}", "--data",
                                           "chat:{digits}:question=user,answer=assistant", "--steps", "1",
                                           "--out", "{root}/s2", "--no-progress"]),
    # serve's port
    ("serve port 99999", ["serve", "{gpt}", "--port", "99999"]),
    ("serve port 65536", ["serve", "{gpt}", "--port", "65536"]),
    ("serve port in use", ["serve", "{gpt}", "--port", "{busy_port}"]),
]

# Cases that must leave no folder behind (nothing written on a refusal).
NOTHING_WRITTEN = ["i3", "i4", "i5", "i6", "i7", "i8", "i9", "s1", "s2"]

# reliability, round 3 (issue 49): a chat template that renders nothing is refused by import, SFT and chat
CASES += [
    ("import-hf template renders nothing", ["import-hf", "{hfnothing}", "--out", "{root}/i10"]),
    ("sft template renders nothing", ["train", "--stage", "sft", "--init-from", "{tpl_nothing}", "--data",
                                      "chat:task:addition_steps:n=8", "--steps", "1", "--batch-size", "2",
                                      "--out", "{root}/s3", "--no-progress"]),
    ("chat template renders nothing", ["chat", "{tpl_nothing}"]),
]
NOTHING_WRITTEN += ["i10", "s3"]


# reliability, round 3 (issue 49): checkpoints verified on load, a config that is not UTF-8
CASES += [
    ("config not UTF-8", ["train", "--config", "{latin1yaml}", "--out", "{root}/o40"]),
    ("resume state.json step -1", ["train", "--resume", "--steps", "3", "--out", "{step_minus}", "--no-progress"]),
    ("resume state.json step 999999", ["train", "--resume", "--steps", "3", "--out", "{step_huge}",
                                       "--no-progress"]),
    ("NaN weights (checksums agree)", ["generate", "{nan_weights}", "--prompt", "x"]),
] + [(f"flipped bit in {name}: {'generate' if name in LOADED else 'resume'}",
      ["generate", f"{{{_flipped(name)}}}", "--prompt", "x"] if name in LOADED else
      ["train", "--resume", "--steps", "3", "--out", f"{{{_flipped(name)}}}", "--no-progress"])
     for name in CHECKPOINT_FILES]
NOTHING_WRITTEN += ["o40"]


def _option_cases() -> list[tuple[str, list[str]]]:
    """From the registry: for every architecture, each declared decoding option given a value outside
    what it declares (a choice it does not offer, a number under its minimum), on `generate`."""
    from latentloop.archs import ARCHS

    cases = []
    for arch, spec in ARCHS.items():
        for option in spec.options:
            if option.choices:
                bad = f"not-a-{option.name}"
            elif option.minimum is not None:
                bad = str(option.kind(option.minimum) - 1)
            else:
                continue
            argv = ["generate", f"{{{arch}}}", "--prompt", "x", option.flag, bad]
            cases.append((f"{arch} {option.flag} {bad}", argv))
    return cases


CASES += _option_cases()

def _hf_empty_template(root: Path, tok: Path) -> str:
    """A tiny Llama folder whose tokenizer's chat template renders nothing."""
    folder = Path(_hf_llama(root, tok, "hf_nothing"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATES["tpl_nothing"]}))
    return str(folder)


def run_cases(fixtures: dict[str, str], verbose: bool) -> list[dict]:
    watched = {name: Path(fixtures[name]) for name in ("gpt", "fbt", "rgpt", "lrt", "tok")}
    before = {name: _digest(path) for name, path in watched.items()}
    results = []
    for name, template in CASES:
        argv = [part.format(**fixtures) for part in template]
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        start = time.perf_counter()
        code, err = _run(argv)
        one_line = len(screen_lines(err)) == 1
        ok = code == EXIT_USAGE and one_line
        results.append({"case": name, "exit": code, "one_line": one_line, "ok": ok, "stderr": err[-300:],
                        "seconds": round(time.perf_counter() - start, 2)})
        if verbose or not ok:
            print(f"{'ok ' if ok else 'BAD'} {name}: exit {code}: {' | '.join(screen_lines(err))}"[:300])
    untouched = {name: _digest(path) == before[name] for name, path in watched.items()}
    results.append({"case": "nothing already written changed", "ok": all(untouched.values()), "detail": untouched})
    root = Path(fixtures["root"])
    written = [name for name in NOTHING_WRITTEN if (root / name).exists()]
    results.append({"case": "a refused import writes nothing", "ok": not written, "detail": written})
    results.append({"case": "a planted DCP payload never ran", "ok": not (root / PWNED).exists()})
    return results


# -- beyond the command line: the sandbox's verdict and the server under hostile requests ----------
FRAME_WALK = """
import sys
def rewrite(frame):
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            for value in list(scope.values()):
                if type(value) is dict:
                    for key in list(value):
                        try:
                            value[key] = b"passed" if isinstance(value[key], bytes) else "passed"
                        except Exception:
                            pass
        frame = frame.f_back
rewrite(sys._getframe(1))
try:
    import socket
    socket.socket()
except PermissionError as error:
    tb = error.__traceback__
    while tb is not None:
        rewrite(tb.tb_frame)
        tb = tb.tb_next
"""
WRONG_ADD_ONE = "def add_one(x):\n    return x\n"
CHECK_ADD_ONE = "def check(candidate):\n    assert candidate(1) == 2\n\ncheck(add_one)\n"


def sandbox_cases() -> list[dict]:
    """A failing program that walks its frames (and a traceback's) must not pass; skipped without bwrap/root."""
    from latentloop.errors import SandboxUnavailable
    from latentloop.eval.sandbox import require_sandbox, run_untrusted

    try:
        require_sandbox()
    except SandboxUnavailable as error:
        return [{"case": "sandbox: frame walking", "ok": None, "detail": f"skipped: {error}"}]
    walked = run_untrusted(WRONG_ADD_ONE + FRAME_WALK, tests=CHECK_ADD_ONE)
    equal = run_untrusted("class Yes:\n    def __eq__(self, other):\n        return True\n"
                          "def add_one(x):\n    return Yes()\n", tests=CHECK_ADD_ONE)
    cases = [{"case": "sandbox: frame walking keeps a failing verdict", "ok": walked.status in ("failed", "error"),
              "detail": walked.status},
             {"case": "sandbox: an answer equal to anything is no pass", "ok": not equal.passed,
              "detail": equal.status}]
    # issue 49: a str subclass equal to anything is refused ("error"), and a wrong candidate's own
    # builtin (or a prompt helper it redefines) does not answer the tests' assertions
    text = run_untrusted("class S(str):\n    def __eq__(self, other):\n        return True\n"
                         "def add_one(x):\n    return S('1')\n", tests=CHECK_ADD_ONE)
    cases.append({"case": "sandbox: a str subclass equal to anything is refused", "ok": text.status == "error",
                  "detail": text.status})
    from latentloop.eval.generation import humaneval_program

    halve = {"task_id": "forged/halve", "prompt": 'def halve(x):\n    """Half of x."""\n', "entry_point": "halve",
             "test": "def check(candidate):\n    assert abs(candidate(3.0) - 1.5) < 1e-6\n"}
    rotate = {"task_id": "forged/unrotate", "entry_point": "unrotate",
              "prompt": 'def rotate(s):\n    return s[1:] + s[:1]\n\n\ndef unrotate(s):\n    """Undo rotate."""\n',
              "test": "def check(candidate):\n    assert candidate(rotate('loop')) == 'loop'\n"}
    for name, problem, completion in (
            ("def abs", halve, "    return 0.0\n\n\ndef abs(x):\n    return 0\n"),
            ("abs = lambda", halve, "    return 0.0\n\n\nabs = lambda x: 0\n"),
            ("a prompt helper redefined", rotate, "    return s\n\n\ndef rotate(s):\n    return s\n")):
        program, tests, exports = humaneval_program(problem, completion)
        forged = run_untrusted(program, tests=tests, exports=exports)
        cases.append({"case": f"sandbox: a wrong candidate with {name} is no pass", "ok": forged.status == "failed",
                      "detail": forged.status})
    return cases


HEALTH_WHILE_RENDERING_S = 4.0  # how long /health is asked while the looping render runs (its limit: 5 s)
HEALTH_ANSWER_S = 1.0  # an answer slower than this counts as the server being held up
HOSTILE_PROMPT_CHARS = 15_000_000  # a one-word prompt under the 16 MiB body cap (issue 49: 130 s of a tokenizer)
HOSTILE_TOKENIZE_CHARS = 10_000_000  # /tokenize's (issue 49: 111 s)
LONG_PROMPT_CHARS = 500_000  # within what a completions body may need, past what the context holds
HOSTILE_REQUESTS = 4  # as many as the server's tokenizer threads
HOSTILE_REFUSED_S = 5.0  # each must be refused within this (it took minutes)
NORMAL_RUNS = 5  # the normal request alone, for its median
HOSTILE_TRIALS = 3  # the normal request beside the hostile ones, for its median
NORMAL_SLOWDOWN = 2.0  # the most the hostile ones may slow the normal request (median beside / median alone)
NORMAL_REQUEST = {"prompt": "def add(a, b):\n    return a + b\n" * 8, "max_tokens": 4, "temperature": 0}
CHUNKED_BODY_MB = 300  # a chunked body without Content-Length (issue 49: reset at ~21 MiB)
IN_FLIGHT = 8  # requests decoding when SIGTERM comes (issue 49: 3-6 of 8 saw a dropped connection)
IN_FLIGHT_REQUEST = {"prompt": "def add", "max_tokens": 400, "temperature": 0}  # seconds on the small model
AFTER_SIGNAL_S = 1.0  # how long new requests are sent after SIGTERM
SERVER_START_S = 120.0


def _start_server(run: str, *flags: str):
    """`latentloop serve RUN` in a child process on a free loopback port, once /health answers:
    (process, port), or (process, None) when it did not start."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "latentloop", "serve", run, "--port", str(port), *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + SERVER_START_S
    while _call(port, "GET", "/health")[0] != 200:
        if server.poll() is not None or time.monotonic() > deadline:
            return server, None
        time.sleep(0.5)
    return server, port


def _stop_server(server) -> None:
    import subprocess

    if server.poll() is None:
        server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _call(port: int, method: str, path: str, body=None, headers: dict | None = None,
          timeout: float = 20) -> tuple[int | str, bytes, float]:
    """(status, reply body, seconds) of one request on a connection of its own; status "dropped"
    when the connection broke (refused, reset, closed) before a reply."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.monotonic()
    try:
        connection.request(method, path, body=body, headers=headers or {},
                           encode_chunked=body is not None and not isinstance(body, bytes))
        reply = connection.getresponse()
        return reply.status, reply.read(), time.monotonic() - start
    except OSError as error:
        return "dropped", repr(error).encode(), time.monotonic() - start
    finally:
        connection.close()


def _message(reply: bytes) -> str:
    try:
        return json.loads(reply)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return reply[:120].decode(errors="replace")


JSON = {"Content-Type": "application/json"}


def server_cases(fixtures: dict[str, str]) -> list[dict]:
    """`latentloop serve` in child processes on free loopback ports, each request bounded in time:
    hostile bodies and a looping chat template against the template run; huge prompts beside a
    normal request, and SIGTERM with requests in flight, against the small BPE run."""
    server, port = _start_server(fixtures["tpl_cond"], "--request-timeout", "30")
    try:
        if port is None:
            return [{"case": "serve: started", "ok": False, "detail": server.stderr.read().decode()[-300:]}]
        results = _body_cases(port) + _template_loop_cases(port, Path(fixtures["tpl_cond"]).name)
        results.append({"case": "serve: still healthy after all", "ok": _call(port, "GET", "/health")[0] == 200})
    finally:
        _stop_server(server)
    server, port = _start_server(fixtures["serve_small"], "--request-timeout", "60")
    try:
        if port is None:
            return results + [{"case": "serve: the small run started", "ok": False,
                               "detail": server.stderr.read().decode()[-300:]}]
        results += _huge_prompt_cases(port)
        results += _sigterm_cases(server, port)
    finally:
        _stop_server(server)
    return results


def _body_cases(port: int) -> list[dict]:
    import socket

    nested = b"[" * 100_000 + b"]" * 100_000
    status = _call(port, "POST", "/v1/completions", nested, JSON)[0]
    results = [{"case": "serve: JSON nested 100k deep is a 400", "ok": status == 400, "detail": status}]
    with socket.create_connection(("127.0.0.1", port), timeout=20) as raw:  # a body never sent
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 300000000\r\n\r\n")
        reply = raw.recv(200)
    results.append({"case": "serve: a 300 MB body is refused before it arrives (413)",
                    "ok": reply.startswith(b"HTTP/1.1 413"),
                    "detail": reply.split(b"\r\n")[0].decode(errors="replace")})

    def chunks():  # sent whole before the reply is read, as http.client sends
        for _ in range(CHUNKED_BODY_MB):
            yield b"[" * 2**20

    status, reply, seconds = _call(port, "POST", "/v1/completions", chunks(), JSON, timeout=60)
    results.append({"case": f"serve: a {CHUNKED_BODY_MB} MB chunked body without Content-Length is a 413",
                    "ok": status == 413 and "larger than" in _message(reply),
                    "detail": f"{status} in {seconds:.2f} s: {_message(reply)}"})
    return results


def _template_loop_cases(port: int, model: str) -> list[dict]:
    """A chat request whose rendering loops; /health is asked meanwhile and must answer at once."""
    import threading

    chat = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "loop"}]}).encode()
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(status=_call(port, "POST", "/v1/chat/completions",
                                                                         chat, JSON, timeout=60)[0]))
    started = time.monotonic()
    worker.start()
    waits = []
    while worker.is_alive() and time.monotonic() - started < HEALTH_WHILE_RENDERING_S:
        status, _, seconds = _call(port, "GET", "/health")
        waits.append(seconds if status == 200 else float("inf"))
        time.sleep(0.2)
    worker.join(timeout=60)
    slowest = max(waits, default=float("inf"))
    status = outcome.get("status")
    return [{"case": "serve: /health answers while a chat template loops",
             "ok": bool(waits) and slowest < HEALTH_ANSWER_S, "detail": f"{len(waits)} asked, slowest {slowest:.2f} s"},
            {"case": "serve: the looping render ends in an error, not a hang",
             "ok": isinstance(status, int) and 400 <= status < 600, "detail": status}]


def _huge_prompt_cases(port: int) -> list[dict]:
    """Four 15 MB one-word prompts (every tokenizer thread of the server) and a normal request at
    once: the four get 400 within seconds, and the normal request's time is compared with its time
    alone in this run (medians); a prompt within the body's bound but past the context's gets 400
    before it is tokenized; /tokenize of 10 MB gets 400 at once."""
    from concurrent.futures import ThreadPoolExecutor

    normal = json.dumps(NORMAL_REQUEST).encode()
    hostile = json.dumps({"prompt": "a" * HOSTILE_PROMPT_CHARS, "max_tokens": 4}).encode()
    _call(port, "POST", "/v1/completions", normal, JSON)  # warm: the first request's one-off costs
    alone = sorted(_call(port, "POST", "/v1/completions", normal, JSON)[2] for _ in range(NORMAL_RUNS))
    beside, refused = [], []
    with ThreadPoolExecutor(HOSTILE_REQUESTS + 1) as pool:
        for _ in range(HOSTILE_TRIALS):
            attacks = [pool.submit(_call, port, "POST", "/v1/completions", hostile, JSON, 120)
                       for _ in range(HOSTILE_REQUESTS)]
            time.sleep(0.05)  # the hostile bodies are on their way (as in the measurement)
            status, reply, seconds = pool.submit(_call, port, "POST", "/v1/completions", normal, JSON, 120).result()
            beside.append(seconds if status == 200 else float("inf"))
            refused += [future.result() for future in attacks]
    median_alone, median_beside = alone[len(alone) // 2], sorted(beside)[len(beside) // 2]
    ratio = median_beside / median_alone
    slowest = max(seconds for _, _, seconds in refused)
    all_refused = all(status == 413 and "can need" in _message(reply) for status, reply, _ in refused)
    long_prompt = json.dumps({"prompt": "a" * LONG_PROMPT_CHARS}).encode()
    long_status, long_reply, long_seconds = _call(port, "POST", "/v1/completions", long_prompt, JSON)
    long_text = json.dumps({"prompt": "a" * HOSTILE_TOKENIZE_CHARS}).encode()
    status, reply, seconds = _call(port, "POST", "/tokenize", long_text, JSON, timeout=120)
    return [{"case": f"serve: {HOSTILE_REQUESTS} one-word prompts of 15 MB are refused (413) by their size, unread",
             "ok": all_refused and slowest < HOSTILE_REFUSED_S,
             "detail": f"{len(refused)} refused, slowest {slowest:.2f} s: {_message(refused[0][1])}"},
            {"case": f"serve: a normal request beside them takes at most {NORMAL_SLOWDOWN:g}x its time alone",
             "ok": ratio <= NORMAL_SLOWDOWN,
             "detail": f"{ratio:.2f}x: median {median_beside * 1000:.0f} ms beside ({HOSTILE_TRIALS} trials), "
                       f"{median_alone * 1000:.0f} ms alone ({NORMAL_RUNS} runs)"},
            {"case": "serve: a 500 KB prompt, past the context, is refused (400) before tokenizing",
             "ok": long_status == 400 and "can hold" in _message(long_reply) and long_seconds < HOSTILE_REFUSED_S,
             "detail": f"{long_status} in {long_seconds:.2f} s: {_message(long_reply)}"},
            {"case": "serve: /tokenize of 10 MB is refused (400) before tokenizing",
             "ok": status == 400 and seconds < HOSTILE_REFUSED_S,
             "detail": f"{status} in {seconds:.2f} s: {_message(reply)}"}]


def _sigterm_cases(server, port: int) -> list[dict]:
    """SIGTERM while IN_FLIGHT requests decode: each gets its completion or a 503 with one message
    (never a dropped connection), and requests sent after the signal get 503 while the server drains."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    body = json.dumps(IN_FLIGHT_REQUEST).encode()
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        in_flight = [pool.submit(_call, port, "POST", "/v1/completions", body, JSON, 120) for _ in range(IN_FLIGHT)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every request is decoding or queued
            status, reply, _ = _call(port, "GET", "/v1/stats")
            stats = json.loads(reply) if status == 200 else {}
            if stats.get("active_rows", 0) + stats.get("queued", 0) >= IN_FLIGHT:
                break
            time.sleep(0.02)
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        after = []
        while time.monotonic() - signalled < AFTER_SIGNAL_S:
            status, reply, _ = _call(port, "POST", "/v1/completions", body, JSON)
            if status == "dropped":  # the server has stopped listening
                break
            after.append((status, reply))
        replies = [future.result()[:2] for future in in_flight]
    try:
        server.wait(timeout=30)
        exited = True
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: stopped by the caller
        exited = False

    def answered(status, reply) -> bool:
        return status == 200 or (status == 503 and _message(reply).startswith("the server is shutting down"))

    counts = {str(status): sum(s == status for s, _ in replies) for status in {s for s, _ in replies}}
    return [{"case": f"serve: SIGTERM with {IN_FLIGHT} requests in flight: each completes or gets a 503",
             "ok": all(answered(status, reply) for status, reply in replies), "detail": counts},
            {"case": "serve: requests after SIGTERM get 503 while the server drains, then it exits",
             "ok": bool(after) and all(status == 503 for status, _ in after) and exited,
             "detail": f"{len(after)} sent in {AFTER_SIGNAL_S:g} s: {sorted({str(s) for s, _ in after})}; "
                       f"exited {exited}"}]


# -- code in the cache: a planted library never runs, a damaged one is built again (issue 49) ---------
PLANTED_LIBRARY = ('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                   '  FILE *f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); }\n}\n')
LOAD_KERNELS = ("from pathlib import Path\nfrom latentloop.inference import native\n"
                "lib = native.native_library('rows_linear')\n"
                "print(Path(lib._name).name if lib is not None else 'none', native.native_status('rows_linear'))\n")


def _load_kernels(cache: Path) -> tuple[int, str, str]:
    import subprocess

    done = subprocess.run([sys.executable, "-c", LOAD_KERNELS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LATENTLOOP_CACHE": str(cache), "LATENTLOOP_NATIVE": "1"})
    return done.returncode, done.stdout.strip(), done.stderr.strip()


def kernel_cases(root: Path) -> list[dict]:
    """A library planted in a cache others may write (kernels/ mode 777, and owned by another user where
    this runs as root) never runs; a truncated, empty, text or foreign file under a kernel's name is built
    again (no SIGBUS, no traceback). Skipped without a C compiler."""
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return [{"case": "kernels in the cache", "ok": None, "detail": "no C compiler"}]
    good = root / "kernel-cache"
    good.mkdir(mode=0o700)
    code, out, err = _load_kernels(good)
    name = out.split()[0]
    if code != 0 or name == "none":
        return [{"case": "kernels in the cache", "ok": False, "detail": f"no kernel builds here: {out} {err}"}]
    results = []
    marker = root / "planted-ran"
    (root / "planted.c").write_text(PLANTED_LIBRARY)
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(root / "planted.c"), "-o",
                    str(root / "planted.so")], check=True, capture_output=True)
    owners = ["writable by others"] + (["owned by another user"] if os.getuid() == 0 else [])
    for owner in owners:
        shared = root / f"shared-cache-{owner.split()[0]}"
        (shared / "kernels").mkdir(parents=True)
        shutil.copy(root / "planted.so", shared / "kernels" / name)
        from latentloop.inference.cache_trust import record_digest

        record_digest(shared / "kernels" / name)
        if owner == "owned by another user":
            for path in (shared, shared / "kernels", shared / "kernels" / name):
                os.chown(path, 12345, 12345)
        shared.chmod(0o1777)
        (shared / "kernels").chmod(0o777 if owner == "writable by others" else 0o755)
        code, out, err = _load_kernels(shared)
        results.append({"case": f"cache: a library planted in a cache {owner} never runs",
                        "ok": code == 0 and not marker.exists() and out.startswith("none")
                        and len(screen_lines(err)) == 1, "detail": f"exit {code}: {err[-160:]}"})
    library = good / "kernels" / name
    built = library.read_bytes()
    for damage, content in (("cut short", built[: len(built) // 3]), ("empty", b""), ("text", b"not a library\n"),
                            ("foreign ELF", (root / "planted.so").read_bytes())):
        library.write_bytes(content)
        code, out, err = _load_kernels(good)
        results.append({"case": f"cache: a kernel library {damage} is built again",
                        "ok": code == 0 and out.split()[-1] == "native" and library.read_bytes() == built
                        and not marker.exists(), "detail": f"exit {code}: {out} {err[-160:]}"})
    return results

def main_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="also write every case's result as JSON")
    p.add_argument("--verbose", action="store_true", help="print every case, not only the failing ones")
    p.add_argument("--only", choices=("server",), default=None,
                   help="run one group of cases, building only its fixtures (server: `latentloop serve`'s)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LATENTLOOP_CACHE"] = str(Path(tmp) / "cache")
        if args.only == "server":
            results, beyond = [], server_cases(server_fixtures(Path(tmp)))
        else:
            fixtures = build_fixtures(Path(tmp))
            results = run_cases(fixtures, args.verbose)
            beyond = sandbox_cases() + kernel_cases(Path(tmp)) + server_cases(fixtures)
    for result in beyond:
        if args.verbose or not result["ok"]:
            print(f"{'ok ' if result['ok'] else 'BAD' if result['ok'] is False else '-- '} {result['case']}: "
                  f"{result.get('detail', '')}")
    results += beyond
    skipped = sum(r["ok"] is None for r in results)
    results = [r for r in results if r["ok"] is not None]
    passed = sum(r["ok"] for r in results)
    print(f"{passed} passed, {len(results) - passed} failed" + (f", {skipped} skipped" if skipped else ""))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main_cli())
