"""The chat page of `latentloop serve` (GET /) and the stream's per-token extension field.

- Without a browser: the page and its files are served (no key needed) and name nothing outside the
  server (no CDN: the machine may be offline); /page/config declares exactly the loaded model's
  options; OpenAI's own client parses a stream that carries `latentloop.tokens`, and the tokens'
  pieces join to the streamed text.
- In a real browser (Playwright driving Debian's chromium; skipped where either is missing, unless
  LATENTLOOP_REQUIRE_BROWSER=1, as CI sets): the page builds one control per declared option of an
  rgpt model, streams a reply equal to the API's greedy completion of the same body, sends a changed
  control in its next request, and shades each token by the exit depth the model reported for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ServeProcess, serving

import latentloop as ll
from latentloop.archs import ARCHS
from latentloop.data import ByteTokenizer
from latentloop.runs import save_run

CHAT_TOK = ByteTokenizer(chat=True)
CONTEXT = 256
ARCH = "rgpt"  # the issue's run: an arch whose model reports an exit depth per token
CALL_TIMEOUT_S = 60.0
BROWSER_TIMEOUT_MS = 60_000
COMPOSING_WAIT_MS = 300  # long enough for a request the page should not send to show up
CHROMIUM = "/usr/bin/chromium"
# Chromium as the probe of this machine starts it: headless, as root, and with no connection of its own
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# An untrained rgpt at this seed exits after 2 or 3 of its 4 steps under the state criterion at 0.5
ADAPTIVE = {"exit_threshold": "0.5", "exit_criterion": "state"}
MESSAGE = "hello there"


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_page")
    torch.manual_seed(0)
    model = ll.build(ARCH, preset="test", sequence_len=CONTEXT, vocab_size=CHAT_TOK.vocab_size)
    run = save_run(model, CHAT_TOK, folder / ARCH).parents[1]
    with serving({"page": ServeProcess(run, folder / "serve.log", "--threads", "1")}) as servers:
        yield servers["page"], model


def _greedy(server, body: dict) -> str:
    reply = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=CALL_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_the_page_is_served_whole_and_offline(chat_server):
    server, model = chat_server
    page = httpx.get(server.url + "/", timeout=CALL_TIMEOUT_S)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name, kind in (("chat.js", "text/javascript"), ("chat.css", "text/css")):
        assert f'"page/{name}"' in page.text  # relative: the page works under a proxy's path too
        reply = httpx.get(server.url + f"/page/{name}", timeout=CALL_TIMEOUT_S)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind)
        # nothing fetched from another host: no absolute URL in the page's files
        assert not re.search(r"https?://", reply.text), name
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)
    config = httpx.get(server.url + "/page/config", timeout=CALL_TIMEOUT_S).json()
    assert config["arch"] == ARCH and config["chat"] is True and config["context"] == CONTEXT
    # the registry's declarations for this arch, in their order, with their defaults and bounds
    declared = ARCHS[ARCH].options
    assert [option["name"] for option in config["options"]] == [option.name for option in declared]
    assert [option["default"] for option in config["options"]] == [option.default for option in declared]
    helps = {option["name"]: option["help"] for option in config["options"]}
    # a field that applies only under another's value says so on the page (rgpt's min_steps)
    assert helps["min_steps"].endswith("; only with exit_threshold > 0"), helps["min_steps"]
    missing = httpx.get(server.url + "/page/nothing.js", timeout=CALL_TIMEOUT_S)
    assert missing.status_code == 404 and "the chat page" in missing.json()["error"]["message"]


def test_openai_client_parses_the_stream_and_its_token_pieces_join_to_the_text(chat_server):
    """OpenAI's client ignores the extension field (it keeps it as an extra); each chunk's tokens
    give pieces that join to the chunk's text, each with the exit depth the model reported."""
    openai = pytest.importorskip("openai")
    server, _ = chat_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=CALL_TIMEOUT_S, max_retries=0)
    body = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 12, "temperature": 0.0,
            "exit_threshold": float(ADAPTIVE["exit_threshold"]), "exit_criterion": ADAPTIVE["exit_criterion"]}
    text, depths = "", []
    stream = client.chat.completions.create(model=ARCH, stream=True, messages=body["messages"],
                                            max_tokens=body["max_tokens"], temperature=0.0,
                                            extra_body={k: body[k] for k in ADAPTIVE})
    for chunk in stream:
        piece = chunk.choices[0].delta.content or "" if chunk.choices else ""
        text += piece
        tokens = (chunk.model_extra or {}).get("latentloop", {}).get("tokens")
        if tokens:
            assert "".join(t["text"] for t in tokens) == piece
            depths += [t["info"]["exit_steps"] for t in tokens if "exit_steps" in t["info"]]
    assert text == _greedy(server, body)
    assert depths and all(1 <= d <= 4 for d in depths)


# -- in a real browser ----------------------------------------------------------------------------------


def _browser():
    """Playwright's sync API and Debian's chromium, or a skip (a failure where CI requires them)."""
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("playwright (pip install playwright)")
        sync_playwright = None
    if not (Path(CHROMIUM).exists() or shutil.which("chromium")):
        missing.append("chromium (apt-get install chromium)")
    if missing:
        why = "the browser test needs " + " and ".join(missing)
        if os.environ.get("LATENTLOOP_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{why} (LATENTLOOP_REQUIRE_BROWSER=1)")
        pytest.skip(why)
    return sync_playwright, CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")


@contextlib.contextmanager
def _launched(tmp_path):
    """Debian's chromium under Playwright, closed at the end (a skip where either is missing)."""
    sync_playwright, chromium = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS,
                                    env={**os.environ, "HOME": str(tmp_path)})
        try:
            yield browser
        finally:
            browser.close()


def _alpha(style: str) -> float:
    found = re.search(r"rgba\(\s*\d+,\s*\d+,\s*\d+,\s*([0-9.]+)\)", style)
    return float(found.group(1)) if found else 0.0


def test_the_page_streams_greedy_replies_sends_its_controls_and_shades_exit_depths(chat_server, tmp_path):
    server, model = chat_server
    with _launched(tmp_path) as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(BROWSER_TIMEOUT_MS)
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(json.loads(r.post_data))
                if r.url.endswith("/v1/chat/completions") else None)
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-state=idle]")
        # what the page takes for an empty reply is what the server refuses as one (Python's strip)
        spaces = "".join(chr(i) for i in range(0x3001) if chr(i).isspace())
        assert all(page.evaluate("t => isBlank(t)", c) for c in spaces)
        assert not page.evaluate("t => isBlank(t)", spaces + "x")
        # one control per option the model declares, from the registry's declarations
        names = page.eval_on_selector_all("#options input, #options select", "els => els.map(e => e.name)")
        assert names == [option.name for option in model.OPTIONS]

        ended = ".turn.assistant .content[data-final], .turn.error"  # a reply that ended, or its error

        def ask(text: str) -> str:
            before = page.locator(ended).count()
            page.fill("#message", text)
            page.press("#message", "Enter")
            # this reply ended and the page is idle again (waiting for the "streaming" state first
            # missed a reply that had ended before the wait began: a 60 s timeout in a full run)
            page.wait_for_function(f"n => document.querySelectorAll({json.dumps(ended)}).length > n "
                                   f"&& document.body.dataset.state === 'idle'", arg=before)
            assert page.locator(".turn.error").count() == 0, page.text_content(".turn.error")
            return page.locator(".turn.assistant .content").last.get_attribute("data-final")

        page.fill("#max_tokens", "16")
        first = ask(MESSAGE)
        assert len(sent) == 1 and sent[0]["stream"] is True and sent[0]["temperature"] == 0
        assert not set(ADAPTIVE) & set(sent[0])  # untouched controls send nothing: the model's defaults
        assert first == _greedy(server, sent[0]) and first  # the streamed reply is the API's greedy one

        # an input method's Enter (composing CJK text) confirms the text, it does not send it
        page.fill("#message", "half-typed")
        page.dispatch_event("#message", "keydown", {"key": "Enter", "isComposing": True})
        page.wait_for_timeout(COMPOSING_WAIT_MS)
        assert len(sent) == 1 and page.input_value("#message") == "half-typed"
        page.fill("#message", "")

        for name, value in ADAPTIVE.items():  # change controls: the next request carries them
            control = page.locator(f"#option-{name}")
            if control.evaluate("e => e.tagName") == "SELECT":
                control.select_option(value)
            else:
                control.fill(value)
        second = ask(MESSAGE)
        assert len(sent) == 2
        assert sent[1]["exit_threshold"] == float(ADAPTIVE["exit_threshold"])
        assert sent[1]["exit_criterion"] == ADAPTIVE["exit_criterion"]
        assert sent[1]["messages"][:2] == [{"role": "user", "content": MESSAGE},
                                            {"role": "assistant", "content": first}]  # the conversation so far
        assert second == _greedy(server, sent[1])

        # the second reply's tokens are shaded by their exit depth, deeper darker, with a legend
        reply = page.locator(".turn.assistant").last
        tokens = reply.locator(".tok")
        infos = [json.loads(info) for info in tokens.evaluate_all("els => els.map(e => e.dataset.info)")]
        styles = tokens.evaluate_all("els => els.map(e => e.style.backgroundColor)")
        assert "".join(tokens.evaluate_all("els => els.map(e => e.textContent)")) == second
        assert page.input_value("#shade-key") == "exit_steps"
        shaded = [(info["exit_steps"], _alpha(style)) for info, style in zip(infos, styles) if "exit_steps" in info]
        depths = sorted({depth for depth, _ in shaded})
        assert len(depths) >= 2, shaded  # the exit depth varies over this reply
        for low, high in zip(depths, depths[1:]):
            assert max(a for d, a in shaded if d == low) < min(a for d, a in shaded if d == high)
        assert page.text_content("#scale-low") == str(depths[0])
        assert page.text_content("#scale-high") == str(depths[-1])
        page.screenshot(path=str(tmp_path / "chat_page.png"), full_page=True)

        # an empty reply (max tokens 0) is not kept: the server refuses an empty assistant turn, and
        # every later message of the conversation got a 400 (12-06 review)
        page.fill("#max_tokens", "0")
        assert ask(MESSAGE) == ""
        page.fill("#max_tokens", "16")
        ask(MESSAGE)  # no error turn (ask asserts it)
        assert [m["content"] for m in sent[-1]["messages"]] == [MESSAGE, first, MESSAGE, second, MESSAGE]


@pytest.mark.parametrize("stops", [(), ("b\n",), ("\n\n", "é")])
def test_each_tokens_piece_of_a_release_joins_to_its_text(stops):
    """The extension's pieces: those of one release join to its text exactly (multi-byte characters
    decoded across tokens, text held back for a stop string), each with its own token's facts."""
    from latentloop.serve.scheduler import token_facts
    from latentloop.serve.text import RowText

    tok = ByteTokenizer()
    ids = tok.encode("xa€b\nab\n\ncé z")
    text = RowText(tok, {}, stops)
    seen = []
    for i, token in enumerate(ids):
        stopped = text.add(token, info=token_facts({"i": i, "flag": True, "name": "x", "nan": float("nan")}))
        released, entries = text.release(final=stopped or i == len(ids) - 1)
        if entries:
            assert "".join(entry.text for entry in entries) == released
        assert all(entry.info == {"i": entry_i} for entry, entry_i in zip(entries, [e.info["i"] for e in entries]))
        seen += [entry.info["i"] for entry in entries]
        if stopped:
            break
    assert seen == sorted(seen) and len(set(seen)) == len(seen)  # each token once, in order


def _stream(*pieces: tuple[str, dict | None], done: bool = True) -> str:
    """A chat completions stream as the server sends it: one chunk per (text, info) piece, with the
    extension field, then [DONE] unless the stream is cut."""
    events = []
    for text, info in pieces:
        chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text},
                                                                  "finish_reason": None}]}
        if info is not None:
            chunk["latentloop"] = {"tokens": [{"text": text, "info": info}]}
        events.append(f"data: {json.dumps(chunk)}\n\n")
    if done:
        events.append("data: [DONE]\n\n")
    return "".join(events)


def test_the_page_stops_resets_keeps_typed_text_and_marks_cut_replies(chat_server, tmp_path):
    """The page's own logic, with the API answered by the test (held, cut, refused): a message typed
    while a reply streams stays in the box; Stop ends the request; New conversation during a reply
    discards it (its old turns leaked into the next request); a stream cut before [DONE] is shown as
    incomplete and not sent back; a conversation past the context drops its oldest exchange and is
    sent again; a failed /page/config names the server's error; a token with no text of its own is
    not drawn (nor counted in the scale); only new tokens are painted while the scale holds."""
    server, _ = chat_server
    with _launched(tmp_path) as browser:
        page = browser.new_page()
        page.set_default_timeout(BROWSER_TIMEOUT_MS)
        held, sent = [], []

        def answer(route):
            sent.append(json.loads(route.request.post_data))
            held.append(route)

        page.route("**/v1/chat/completions", answer)
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-state=idle]")

        def send(text: str) -> None:
            page.fill("#message", text)
            page.press("#message", "Enter")

        def reply_to(route, body: str, status: int = 200) -> None:
            route.fulfill(status=status, body=body, headers={"content-type": "text/event-stream"
                                                             if status == 200 else "application/json"})

        def idle() -> None:
            page.wait_for_function("document.body.dataset.state === 'idle'")

        def streaming() -> None:
            page.wait_for_function("document.body.dataset.state === 'streaming'")

        send("one")
        streaming()
        send("typed while busy")
        page.wait_for_timeout(COMPOSING_WAIT_MS)
        assert page.input_value("#message") == "typed while busy" and len(sent) == 1
        page.click("#stop")
        idle()
        assert page.text_content("#status").startswith("stopped")

        page.fill("#message", "")
        send("two")  # answered whole: the conversation holds it
        streaming()
        reply_to(held[-1], _stream(("fine", {"exit_steps": 2}), (" thanks", {"exit_steps": 3})))
        idle()
        assert page.text_content("#status").startswith("done")

        send("three")  # cut before [DONE]: shown as incomplete, not kept
        streaming()
        reply_to(held[-1], _stream(("half", {"exit_steps": 1}), done=False))
        idle()
        assert page.locator(".turn.assistant.incomplete").count() == 1
        assert "ended before the server finished" in page.text_content(".turn.error")

        send("four")  # the conversation so far: the cut reply and its message are not in it
        streaming()
        assert [m["content"] for m in sent[-1]["messages"]] == ["two", "fine thanks", "four"]
        # too long for the context: the page leaves out the oldest exchange and asks again
        overflow = json.dumps({"error": {"message": "the prompt (300 tokens, with BOS) + max_tokens (64) exceeds the "
                                                   "model's context of 256 tokens",
                                        "type": "invalid_request_error", "param": "max_tokens"}})
        reply_to(held[-1], overflow, 400)
        for _ in range(BROWSER_TIMEOUT_MS // COMPOSING_WAIT_MS):  # the page's routes are served while it waits
            if len(held) == 5:
                break
            page.wait_for_timeout(COMPOSING_WAIT_MS)
        assert len(held) == 5 and [m["content"] for m in sent[-1]["messages"]] == ["four"]
        assert page.locator(".turn.left-out").count() == 0  # not before a shorter request is accepted
        # a token with no text of its own (a character's first bytes) is not drawn nor counted
        reply_to(held[-1], _stream(("", {"exit_steps": 9}), ("é", {"exit_steps": 1}), ("x", {"exit_steps": 4})))
        idle()
        assert "left out to fit the model's context" in page.text_content("#status")
        assert page.locator(".turn.left-out").count() == 2
        assert page.text_content("#scale-high") == "4"
        assert page.evaluate("[...document.querySelectorAll('.tok')].every(s => s.textContent !== '')")

        # only the new tokens are painted while the key and its range hold
        page.evaluate("document.querySelector('.tok').style.backgroundColor = 'rgb(1, 2, 3)'")
        send("five")
        streaming()
        reply_to(held[-1], _stream(("y", {"exit_steps": 3})))
        idle()
        first_colour = "document.querySelector('.tok').style.backgroundColor"
        assert page.evaluate(first_colour) == "rgb(1, 2, 3)"
        send("six")  # past the range: every token is painted again
        streaming()
        reply_to(held[-1], _stream(("z", {"exit_steps": 7})))
        idle()
        assert page.evaluate(first_colour) != "rgb(1, 2, 3)"

        # a message that does not fit even alone: every shorter retry refused, and the conversation
        # keeps every exchange (it was cut for good before any retry was accepted)
        conversation = [m["content"] for m in sent[-1]["messages"][:-1]] + ["six", "z"]
        answered = len(held)
        send("too long")
        while page.evaluate("document.body.dataset.state") != "idle" or len(held) > answered:
            if len(held) > answered:
                reply_to(held[answered], overflow, 400)
                answered += 1
            page.wait_for_timeout(COMPOSING_WAIT_MS // 3)
        assert [m["content"] for m in sent[-1]["messages"]] == ["too long"]  # retried down to the message alone
        assert "context" in page.locator(".turn.error").last.text_content()
        send("after")
        streaming()
        assert [m["content"] for m in sent[-1]["messages"]] == [*conversation, "after"]
        reply_to(held[-1], _stream(("fine", None)))
        idle()

        # New conversation while a reply streams: that reply is dropped, the next request starts afresh
        send("seven")
        streaming()
        page.click("#reset")
        idle()
        assert page.locator(".turn").count() == 0
        send("eight")
        streaming()
        assert [m["content"] for m in sent[-1]["messages"]] == ["eight"]
        reply_to(held[-1], _stream(("ok", None)))
        idle()
        assert page.locator(".turn").count() == 2

        failing = browser.new_page()
        failing.route("**/page/config", lambda route: route.fulfill(
            status=503, body=json.dumps({"error": {"message": "the server is shutting down"}}),
            headers={"content-type": "application/json"}))
        failing.goto(server.url + "/")
        failing.wait_for_function("document.getElementById('status').textContent !== ''")
        assert failing.text_content("#status") == "cannot load the model's options: the server is shutting down"


PREFIX = "/llm"  # the path a reverse proxy serves the page under, stripped before it reaches the server
GOOD_KEY = "sekret-key"


def test_the_page_works_under_a_path_asks_for_a_key_and_refuses_what_it_cannot_send(chat_server, tmp_path):
    """Found by a review driving the page (12-07): under a proxy's path the page asked the server's root
    for its files and stayed "loading…"; a stored key holding a character no header carries locked the page
    out (fetch threw before any 401); a typed key was kept only on Enter or blur, and needed a reload;
    the default budget of 64 was refused by a server whose cap is lower; a number control the browser
    cannot read ("0.5e") was sent as nothing, the model's default; a stream with CRLF line ends (as
    proxies write) ended every reply "before the server finished"."""
    server, _ = chat_server
    with _launched(tmp_path) as browser:
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(BROWSER_TIMEOUT_MS)
        seen: list[str] = []

        def proxy(route):  # a reverse proxy: /llm/... to the server's /..., the API key checked here
            request = route.request
            path = request.url.split(PREFIX, 1)[1]
            seen.append(path)
            keyed = path.startswith(("/page/config", "/v1/"))
            if keyed and request.headers.get("authorization") != f"Bearer {GOOD_KEY}":
                route.fulfill(status=401, body=json.dumps({"error": {"message": "a valid API key is needed"}}),
                              headers={"content-type": "application/json"})
            elif path.startswith("/page/config"):
                config = httpx.get(server.url + path, timeout=CALL_TIMEOUT_S).json()
                route.fulfill(status=200, body=json.dumps({**config, "max_tokens_cap": 16}),
                              headers={"content-type": "application/json"})
            elif path.startswith("/v1/chat/completions"):
                sent.append(json.loads(request.post_data))
                body = _stream(("fine", {"exit_steps": 2}), (" thanks", {"exit_steps": 3})).replace("\n", "\r\n")
                route.fulfill(status=200, body=body, headers={"content-type": "text/event-stream"})
            else:
                route.continue_(url=server.url + path)

        sent: list[dict] = []
        page.route(f"**{PREFIX}/**", proxy)
        base = server.url + PREFIX + "/"
        page.goto(base)
        page.wait_for_function("!document.getElementById('key-box').hidden")
        assert "needs its API key" in page.text_content("#status")
        assert "/page/chat.js" in seen and "/page/chat.css" in seen  # under the proxy's path, not the root
        page.fill("#api-key", GOOD_KEY)
        page.press("#api-key", "Enter")  # used at once: no reload
        page.wait_for_selector("body[data-state=idle]")
        assert page.evaluate("localStorage.getItem('latentloop-api-key')") == GOOD_KEY
        assert page.input_value("#max_tokens") == "16"  # within the server's cap of 16, not 64

        page.locator("#temperature").fill("")
        page.locator("#temperature").press_sequentially("0.5e")  # a browser reads it as no value
        page.fill("#message", "hello")
        page.press("#message", "Enter")
        page.wait_for_timeout(COMPOSING_WAIT_MS)
        assert not sent and page.input_value("#message") == "hello"
        assert "temperature is not a number" in page.text_content("#status")
        page.locator("#temperature").fill("0")
        page.press("#message", "Enter")
        page.wait_for_function("document.querySelector('.turn.assistant .content[data-final]') !== null")
        assert page.get_attribute(".turn.assistant .content", "data-final") == "fine thanks"  # CRLF events read
        assert sent[0]["max_tokens"] == 16 and sent[0]["temperature"] == 0

        # a stored key holding a zero-width space: the key box again, not a page locked out
        page.evaluate(f"localStorage.setItem('latentloop-api-key', {json.dumps(GOOD_KEY + chr(0x200B))})")
        page.reload()
        page.wait_for_function("!document.getElementById('key-box').hidden")
        assert "no header can carry" in page.text_content("#status")
        # a key typed and the page reloaded before Enter: the key typed is the one kept
        page.fill("#api-key", GOOD_KEY)
        page.reload()
        page.wait_for_selector("body[data-state=idle]")
        assert page.evaluate("localStorage.getItem('latentloop-api-key')") == GOOD_KEY
        context.close()
