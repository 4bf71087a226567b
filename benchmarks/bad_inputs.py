"""The bad-input tally: every way a user can get the command line wrong that we know of, each run
in-process through `latentloop.cli.main`; a case passes when it ends with exit code 2 and exactly
one line on stderr (no traceback) naming the problem, and nothing already written was changed.

    python -m benchmarks.bad_inputs [--json tally.json] [--verbose]

It builds what the cases need in a temporary folder first (a corpus, three tiny trained runs, a
corrupt run, files where folders are expected), about a minute on 2 CPU cores.
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


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own rejections
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # a traceback: the case fails
            return -1, f"{type(exc).__name__}: {exc}"
    return code, err.getvalue().strip()


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
    for arch in ("gpt", "fbt", "rgpt", "lrt"):
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
            **{arch: str(path) for arch, path in runs.items()}}


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
    ("eval run's own text data", ["eval", "{gpt}"]),
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
]


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
    return results


def main_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="also write every case's result as JSON")
    p.add_argument("--verbose", action="store_true", help="print every case, not only the failing ones")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LATENTLOOP_CACHE"] = str(Path(tmp) / "cache")
        fixtures = build_fixtures(Path(tmp))
        results = run_cases(fixtures, args.verbose)
    passed = sum(r["ok"] for r in results)
    print(f"{passed} passed, {len(results) - passed} failed")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main_cli())
