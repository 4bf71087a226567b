"""benchmarks/serve_load.py --against llama.cpp: its flags, the clear error without a llama-server
binary, the request mix both servers are sent, the load loop and the ratio / percentile summary
(fast, no server); the whole comparison at a tiny model when a llama-server binary is given (slow)."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _import_serve_load():
    """The module `benchmarks.serve_load` of this checkout; sys.path as it was after (the module puts
    the checkout and benchmarks/ on it, where benchmarks' bare module names would shadow others')."""
    saved = list(sys.path)
    sys.path.insert(0, str(REPO_ROOT))
    try:
        return importlib.import_module("benchmarks.serve_load")
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def serve_load():
    return _import_serve_load()


def test_against_flags_and_their_defaults(serve_load):
    args = serve_load.parse_args(["--against", "llama.cpp"])
    assert (args.against, args.budget, args.new_tokens, args.concurrency) == ("llama.cpp", 540.0, 128, [1, 8, 32])
    assert (args.short, args.long, args.decode, args.run, args.llama_server) == (32, 352, "auto", None, None)
    assert args.repeats == 3  # paired ratios with an interval: one repeat printed a bare ratio
    assert serve_load.parse_args([]).budget == 55.0  # the batching comparison keeps its own default
    assert serve_load.parse_args([]).repeats == 1
    args = serve_load.parse_args(["--against", "llama.cpp", "--llama-server", "/x/llama-server", "--run", "runs/a",
                                  "--budget", "60", "--repeats", "2", "--concurrency", "1", "8"])
    assert (args.llama_server, args.run, args.budget, args.repeats, args.concurrency) == (
        "/x/llama-server", Path("runs/a"), 60.0, 2, [1, 8])
    for bad in (["--against", "vllm"], ["--against", "llama.cpp", "--long", "8", "--short", "16"],
                ["--against", "llama.cpp", "--new-tokens", "0"], ["--against", "llama.cpp", "--repeats", "1"]):
        with pytest.raises(SystemExit) as error:
            serve_load.parse_args(bad)
        assert error.value.code == 2


def test_against_llama_cpp_without_the_binary_is_one_clear_line_and_exit_2(serve_load, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.delenv(serve_load.LLAMA_SERVER_ENV, raising=False)
    assert serve_load.main(["--against", "llama.cpp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-server" in err[0] and "build_llama_server.sh" in err[0]

    missing = tmp_path / "llama-server"
    assert serve_load.main(["--against", "llama.cpp", "--llama-server", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0]

    missing.write_text("not executable")  # through the environment, a file that cannot run
    monkeypatch.setenv(serve_load.LLAMA_SERVER_ENV, str(missing))
    assert serve_load.main(["--against", "llama.cpp"]) == 2
    assert str(missing) in capsys.readouterr().err

    missing.chmod(0o755)  # found: through the environment, and --llama-server before it
    assert serve_load.find_llama_server(None) == missing
    assert serve_load.find_llama_server(str(missing)) == missing


def test_the_request_mix_gives_both_servers_the_same_token_ids(serve_load):
    source = bytes(range(256)) * 8
    mix = serve_load.request_mix(256, source, short=8, long=40, size=6)
    assert [len(ids) for ids in mix] == [8, 40] * 3  # short and long alternate
    assert all(ids[0] == 256 and all(0 <= t < 256 for t in ids[1:]) for ids in mix)  # BOS, then bytes
    assert len({tuple(ids) for ids in mix}) == 6  # each from its own offset
    assert serve_load.request_mix(256, source, short=8, long=40, size=6) == mix  # the same every time
    for concurrency in (1, 8, 32):
        for client in range(concurrency):
            sent = serve_load.client_requests(client, concurrency, mix)
            for k in range(3):
                ids = next(sent)
                assert ids == mix[(client + k * concurrency) % len(mix)]
                ours = serve_load.LatentloopEndpoint.body(None, ids, 128)
                theirs = serve_load.LlamaServer.body(None, ids, 128)
                assert ours["prompt"] == theirs["prompt"] == ids
                assert (ours["max_tokens"], ours["temperature"]) == (theirs["n_predict"], theirs["temperature"]) == (
                    128, 0)
                assert theirs["ignore_eos"] is True and theirs["cache_prompt"] is False
    with pytest.raises(ValueError):
        serve_load.request_mix(256, b"short", short=8, long=40)
    # the spot check asks both for their tokens: latentloop's logprobs, llama.cpp's token ids
    assert serve_load.LatentloopEndpoint.body(None, [256, 1], 4, tokens=True)["logprobs"] == 0
    assert serve_load.LlamaServer.body(None, [256, 1], 4, tokens=True)["return_tokens"] is True


def test_latentloop_token_strings_map_back_to_their_ids(serve_load):
    from latentloop.data import ByteTokenizer
    from latentloop.serve.protocol import special_names, token_string

    tokenizer = ByteTokenizer()
    ids_of = serve_load.token_ids_by_string(tokenizer, tokenizer.vocab_size)
    specials = special_names(tokenizer)
    assert len(ids_of) == tokenizer.vocab_size
    assert all(ids_of[token_string(tokenizer, i, specials)] == i for i in range(tokenizer.vocab_size))
    reply = {"choices": [{"logprobs": {"tokens": [token_string(tokenizer, i, specials) for i in (65, 200, 256)]}}]}
    assert serve_load.reply_tokens(object(), reply, ids_of) == [65, 200, 256]


def test_the_gguf_for_llama_server_carries_the_byte_vocabulary_and_the_same_tensors(serve_load, tmp_path):
    gguf = pytest.importorskip("gguf")
    from benchmarks.engines import SHAPES, build_export, write_gguf

    _, tokenizer, hf = build_export(SHAPES["smoke"], 64, 0, tmp_path)
    write_gguf(hf, tmp_path / "plain.gguf")
    serve_load.with_byte_vocabulary(tmp_path / "plain.gguf", tmp_path / "vocab.gguf", tokenizer, 259)
    plain, vocab = gguf.GGUFReader(str(tmp_path / "plain.gguf")), gguf.GGUFReader(str(tmp_path / "vocab.gguf"))
    tokens = vocab.fields["tokenizer.ggml.tokens"].contents()
    assert vocab.fields["tokenizer.ggml.model"].contents() == "llama" and len(tokens) == 259
    assert tokens[0x41] == "<0x41>" and tokens[256] != tokens[257]
    types = vocab.fields["tokenizer.ggml.token_type"].contents()
    assert types[:256] == [gguf.TokenType.BYTE] * 256 and types[256:] == [gguf.TokenType.CONTROL] * 3
    assert (vocab.fields["tokenizer.ggml.bos_token_id"].contents(), vocab.fields["tokenizer.ggml.eos_token_id"]
            .contents(), vocab.fields["tokenizer.ggml.add_bos_token"].contents()) == (256, 257, False)
    for key in ("llama.block_count", "llama.embedding_length", "llama.rope.freq_base", "llama.context_length"):
        assert vocab.fields[key].contents() == plain.fields[key].contents()
    assert [(t.name, t.data.tobytes()) for t in vocab.tensors] == [(t.name, t.data.tobytes()) for t in plain.tensors]
    with pytest.raises(SystemExit, match="byte tokenizer"):
        serve_load.with_byte_vocabulary(tmp_path / "plain.gguf", tmp_path / "x.gguf", object(), 259)


def test_the_summary_gives_percentiles_and_ratios_over_repeats(serve_load):
    raw = {"latencies": [float(i) for i in range(1, 101)], "generated": [128] * 98 + [5, 7], "failed": 1,
           "abandoned": 2, "wall": 50.0, "prompts": [8, 40] * 50}
    cell = serve_load.summarize_cell(raw, 128)
    assert (cell["requests"], cell["failed"], cell["abandoned"], cell["short"]) == (100, 1, 2, 2)
    assert cell["req/s"] == 2.0 and cell["tokens/s"] == (128 * 98 + 12) / 50
    assert cell["p50"] == 50.5 and cell["p99"] == 99.0
    assert (cell["p50 short prompt"], cell["p50 long prompt"]) == (50.0, 51.0)  # odd and even latencies apart
    empty = serve_load.summarize_cell({"latencies": [], "generated": [], "failed": 3, "abandoned": 0, "wall": 2.0},
                                      128)
    assert empty["req/s"] == 0 and math.isnan(empty["p50"]) and math.isnan(empty["p99"])

    def fake(rps: float, p50: float, p99: float) -> dict:
        return {"requests": 10, "failed": 0, "abandoned": 0, "short": 0, "req/s": rps, "tokens/s": rps * 128,
                "p50": p50, "p99": p99}

    measured = {(1, "latentloop"): [fake(2.0, 1.0, 2.0), fake(3.0, 1.0, 2.0), fake(4.0, 1.0, 2.0)],
                (1, "llama.cpp"): [fake(2.0, 2.0, 2.0), fake(2.0, 2.0, 4.0), fake(2.0, 2.0, 8.0)],
                (8, "latentloop"): [fake(1.0, 1.0, 1.0)] * 3, (8, "llama.cpp"): [fake(1.0, 1.0, 1.0)] * 3}
    table, ratio_table, ratios = serve_load.against_summary(measured, ("latentloop", "llama.cpp"))
    assert [row[:2] for row in table[1:]] == [[1, "latentloop"], [1, "llama.cpp"], [8, "latentloop"],
                                              [8, "llama.cpp"]]
    assert table[1][5] == "3.00 [2.00–4.00]"  # req/s: median [min–max] over the repeats
    assert table[1][2] == "30 (10: p99 is a cell's slowest)"  # 10 requests a cell: its p99 is its maximum
    for n, slowest in ((51, True), (52, False)):  # where `percentile`'s p99 stops being the maximum
        assert (serve_load.percentile(list(range(n)), 0.99) == n - 1) is slowest
        assert (n < serve_load.P99_SAMPLES) is slowest
    # repeat by repeat, the geometric mean: (1 x 1.5 x 2) ** (1/3), its interval taken on the logs
    assert ratios["1"]["req/s"]["mean"] == pytest.approx(3 ** (1 / 3))
    assert 0 < ratios["1"]["req/s"]["low"] < 3 ** (1 / 3) < ratios["1"]["req/s"]["high"]
    assert ratios["1"]["p50"]["mean"] == pytest.approx(0.5)
    assert ratios["1"]["p99"]["mean"] == pytest.approx(0.5)  # (1 x 0.5 x 0.25) ** (1/3): 2x and 0.5x cancel
    assert ratios["8"]["req/s"]["mean"] == 1.0 and ratio_table[2] == [8, "1.000 [1.000, 1.000]", *["1.000 [1.000, "
                                                                                                   "1.000]"] * 2, "yes"]
    # latentloop stops at BOS / EOS, llama.cpp does not: a cell with requests stopped short is unequal work
    measured[8, "latentloop"] = [{**fake(1.0, 1.0, 1.0), "short": 2}] * 3
    _, ratio_table, ratios = serve_load.against_summary(measured, ("latentloop", "llama.cpp"))
    assert ratio_table[2][-1] == "no: 6 of latentloop's requests stopped short"
    assert ratios["8"]["stopped_short"] == {"latentloop": 6, "llama.cpp": 0} and ratio_table[1][-1] == "yes"


class _FakeCompletion(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = json.dumps({"tokens_predicted": body["n_predict"] - (body["prompt"][1] == 0)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_the_load_loop_lets_requests_in_flight_finish(serve_load):
    """Clients send back to back for the cell's seconds; every request sent is answered and counted,
    each client's prompts in the mix's order (one prompt of the mix makes the fake server stop early)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletion)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        server = serve_load.LlamaServer.__new__(serve_load.LlamaServer)
        server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        mix = [[256, 1, 2], [256, 0, 3]]  # the second is answered with one token short
        raw = asyncio.run(serve_load.load_mix(server, 2, 0.3, mix, 16))
    finally:
        httpd.shutdown()
        httpd.server_close()
    cell = serve_load.summarize_cell(raw, 16)
    assert cell["requests"] > 2 and cell["failed"] == cell["abandoned"] == 0
    assert raw["wall"] >= 0.3 and cell["req/s"] == cell["requests"] / raw["wall"]
    assert 0 < cell["short"] < cell["requests"]  # client 1 sends the second prompt every time


@pytest.mark.slow
def test_against_llama_cpp_runs_the_whole_comparison_at_a_tiny_size(tmp_path, capsys):
    """With a llama-server binary (env LLAMA_SERVER): both servers on a random-init model, a short
    budget; greedy tokens equal on the spot checks, every cell measured, the JSON written."""
    binary = os.environ.get("LLAMA_SERVER")
    if not binary or not Path(binary).is_file():
        pytest.skip("no llama-server binary (set LLAMA_SERVER; benchmarks/build_llama_server.sh builds one)")
    serve_load = _import_serve_load()
    out = tmp_path / "against.json"
    assert serve_load.main(["--against", "llama.cpp", "--concurrency", "1", "4", "--repeats", "2", "--budget", "8",
                            "--new-tokens", "16", "--short", "8", "--long", "40", "--decode", "eager",
                            "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert all(check["equal"] and check["generated"] == [16, 16] for check in results["spot_checks"])
    assert all(len(cells) == 2 and all(c["requests"] > 0 for c in cells) for cells in results["cells"].values())
    assert set(results["ratios"]) == {"1", "4"}
    assert "latentloop over llama.cpp" in capsys.readouterr().out
