// The chat page of `latentloop serve`: builds the decoding controls from the loaded model's declared
// options (GET /page/config), sends the conversation to the server's own streaming API
// (/v1/chat/completions, or /v1/completions for a model without a chat format) and shades each token
// of the reply by the numbers the model reported for it (the stream's `latentloop.tokens` extension).
"use strict";

const page = {
  config: null,
  messages: [],      // the conversation so far (chat models), oldest first: what the next request sends
  messageTurns: [],  // the transcript's turn of each message (dimmed once left out to fit the context)
  lastBody: null,    // the body of the last request sent
  busy: false,
  controller: null,  // the running request's AbortController: Stop and New conversation abort it
  conversation: 0,   // counted up by New conversation: a reply that ends after it is not kept
  tokens: [],        // [span, info] of every token shown, its info parsed once
  stats: new Map(),  // per reported key: {values, integer, low, high} over `tokens`
  drawn: null,       // what the tokens were last shaded by: {key, low, high, count}
};
const $ = (id) => document.getElementById(id);
const IME_KEY_CODE = 229;  // the keyCode of a key an input method takes (Safari's composing Enter lacks isComposing)

const KEY_STORE = "latentloop-api-key";
// What a key may hold: the server compares printable ASCII only, and a header with any other character
// (a pasted zero-width space or curly quote) makes fetch throw before anything is sent.
const KEY_CHARS = /^[\x20-\x7e]+$/;

// The stored key; null where the browser keeps no site data (reading storage then throws).
function storedKey() {
  try { return localStorage.getItem(KEY_STORE); } catch (e) { return null; }
}

function storeKey(key) {
  try { if (key) localStorage.setItem(KEY_STORE, key); else localStorage.removeItem(KEY_STORE); } catch (e) { /* kept for this page only */ }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value || storedKey() || "";
  if (key && KEY_CHARS.test(key)) h["Authorization"] = "Bearer " + key;
  return h;
}

function askForKey(why) {
  $("key-box").hidden = false;
  setStatus(why);
}

function setStatus(text) { $("status").textContent = text; }

function setBusy(busy) {
  page.busy = busy;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.state = busy ? "streaming" : "idle";
}

// -- the controls, from the model's declared options ------------------------------------------------
function optionControl(option) {
  const label = document.createElement("label");
  label.title = option.help || "";
  label.append(option.name + " ");
  let input;
  const fallback = option.default === null ? "model's" : String(option.default);
  if (option.choices) {
    input = document.createElement("select");
    input.append(new Option(`default (${fallback})`, ""));
    for (const choice of option.choices) input.append(new Option(choice, choice));
  } else if (option.type === "bool") {
    input = document.createElement("select");
    for (const [text, value] of [[`default (${fallback})`, ""], ["true", "true"], ["false", "false"]]) {
      input.append(new Option(text, value));
    }
  } else {
    input = document.createElement("input");
    input.type = option.keywords ? "text" : "number";
    if (option.type === "int") input.step = "1"; else input.step = "any";
    if (option.minimum !== null && !option.keywords) input.min = option.minimum;
    if (option.maximum !== null && !option.keywords) input.max = option.maximum;
    input.placeholder = option.default === null ? "default" : `default ${fallback}`;
  }
  input.name = option.name;
  input.id = "option-" + option.name;
  input.dataset.type = option.type;
  if (option.keywords) input.dataset.keywords = option.keywords.join(",");
  label.append(input);
  return label;
}

function optionValue(input) {
  const raw = input.value.trim();
  if (raw === "") return undefined;  // not sent: the model's default
  const keywords = (input.dataset.keywords || "").split(",").filter(Boolean);
  if (keywords.includes(raw)) return raw;
  switch (input.dataset.type) {
    case "int": return Number.isInteger(Number(raw)) ? Number(raw) : raw;  // the server names a bad value
    case "float": return Number.isNaN(Number(raw)) ? raw : Number(raw);
    case "bool": return raw === "true";
    default: return raw;
  }
}

// The first control whose text the browser cannot read as a number (e.g. "0.5e"): its value reads as
// empty, and the request would go without it, on the model's default, as if nothing were typed.
function unreadableControl() {
  for (const input of $("controls").querySelectorAll("input")) {
    if (input.validity && input.validity.badInput) return input.name;
  }
  return null;
}

function requestBody(text, earlier) {
  const body = { model: page.config.model, stream: true };
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max_tokens").value.trim();
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  for (const input of $("options").querySelectorAll("input, select")) {
    const value = optionValue(input);
    if (value !== undefined) body[input.name] = value;
  }
  if (page.config.chat) body.messages = [...earlier, { role: "user", content: text }];
  else body.prompt = text;
  return body;
}

// -- the transcript -----------------------------------------------------------------------------------
function addTurn(role, text) {
  const turn = document.createElement("div");
  turn.className = "turn " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "you" : role === "error" ? "error" : page.config.arch;
  const content = document.createElement("span");
  content.className = "content";
  content.textContent = text || "";
  turn.append(who, content);
  $("transcript").append(turn);
  turn.scrollIntoView({ block: "end" });
  return content;
}

function appendPieces(content, text, tokens) {
  // the tokens' pieces join to the chunk's text; where they do not (or none came), the text is plain
  const pieces = tokens && tokens.map((t) => t.text).join("") === text ? tokens : null;
  if (!pieces) {
    if (text) content.append(document.createTextNode(text));
    return;
  }
  for (const token of pieces) {
    // a token with no text of its own (the first bytes of a character split over byte tokens) is not
    // drawn: as an empty span its figures could be neither seen nor hovered, yet they set the scale
    if (!token.text) continue;
    const info = token.info || {};
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = token.text;
    span.dataset.info = JSON.stringify(info);
    span.title = Object.entries(info).map(([k, v]) => `${k} ${v}`).join(" · ");
    content.append(span);
    page.tokens.push([span, info]);
    for (const [key, value] of Object.entries(info)) {
      if (typeof value !== "number") continue;
      if (!page.stats.has(key)) page.stats.set(key, { values: new Set(), integer: true, low: value, high: value });
      const s = page.stats.get(key);
      s.values.add(value);
      s.integer = s.integer && Number.isInteger(value);
      s.low = Math.min(s.low, value);
      s.high = Math.max(s.high, value);
    }
  }
}

// -- shading ------------------------------------------------------------------------------------------
// The key to shade by unless one is chosen: a count of work (integer values) that varies the most.
// Ties go to the key seen last: a row's own figures (rgpt's exit_steps, mor's depth) follow the
// figures its whole batch shares in what the server reports.
function autoKey() {
  let best = null;
  for (const [key, s] of page.stats) {
    const score = [s.integer ? 1 : 0, s.values.size];
    if (!best || score[0] > best.score[0] || (score[0] === best.score[0] && score[1] >= best.score[1])) {
      best = { key, score };
    }
  }
  return best ? best.key : "";
}

// the stylesheet's accent colour as "r, g, b" (a custom property inside an inline colour would stay unresolved)
function accent() { return getComputedStyle(document.documentElement).getPropertyValue("--accent").trim(); }

function paint(span, value, low, high, colour) {
  if (typeof value !== "number") {
    span.style.backgroundColor = "";
    span.classList.remove("dark");
    return;
  }
  // one value throughout: a light shade (nothing to tell apart); else lightest at the least, darkest at the most
  const alpha = high > low ? 0.16 + 0.64 * (value - low) / (high - low) : 0.25;
  span.style.backgroundColor = `rgba(${colour}, ${alpha.toFixed(3)})`;
  span.classList.toggle("dark", alpha > 0.5);
}

// Shade the tokens by the chosen key. Only the tokens added since the last call are painted unless
// the key or its range changed: repainting every token at every chunk made a reply of a few thousand
// tokens take minutes to draw.
function shade() {
  const select = $("shade-key");
  const keys = [...page.stats.keys()];
  const chosen = select.dataset.chosen && page.stats.has(select.dataset.chosen) ? select.dataset.chosen : autoKey();
  const current = [...select.options].map((o) => o.value).join(",");
  if (current !== keys.join(",") || !keys.length) {
    const none = page.tokens.length && !page.busy ? `(${page.config.arch} reported nothing per token)` : "(nothing reported yet)";
    select.replaceChildren(...(keys.length ? keys.map((k) => new Option(k, k)) : [new Option(none, "")]));
  }
  select.value = chosen;
  const s = page.stats.get(chosen);
  const low = s ? s.low : 0;
  const high = s ? s.high : 0;
  $("scale-low").textContent = s ? String(+low.toFixed(2)) : "";
  $("scale-high").textContent = s ? String(+high.toFixed(2)) : "";
  const d = page.drawn;
  const from = d && d.key === chosen && d.low === low && d.high === high ? d.count : 0;
  const colour = accent();
  for (let i = from; i < page.tokens.length; i++) {
    const [span, info] = page.tokens[i];
    paint(span, info[chosen], low, high, colour);
  }
  page.drawn = { key: chosen, low, high, count: page.tokens.length };
}

// -- sending and streaming ----------------------------------------------------------------------------
// Whether a text is empty as the server's Python str.strip() reads it: JavaScript's \s (and trim())
// lacks \x1c-\x1f and \x85, which Python strips.
function isBlank(text) {
  return text.replace(/[\s\x1c-\x1f\x85]/g, "") === "";
}

// A 400 that says the conversation no longer fits the model's context (its text, its tokens, or
// its tokens with the reply's budget): the page then leaves out its oldest exchange, as `latentloop chat` does.
function overflowsContext(status, error) {
  const e = error && error.error;
  return status === 400 && !!e && ["messages", "prompt", "max_tokens"].includes(e.param) &&
    /context/.test(e.message || "");
}

// Leave the `count` oldest exchanges (a user turn and its reply each) out of the conversation, once a
// request without them was accepted; their turns stay on the page, dimmed.
function leaveOutOldestExchanges(count) {
  page.messages.splice(0, 2 * count);
  for (const turn of page.messageTurns.splice(0, 2 * count)) turn.classList.add("left-out");
}

const EVENT_END = /\r\n\r\n|\n\n|\r\r/;

async function send(text) {
  if (page.busy || isBlank(text)) return;
  const conversation = page.conversation;
  const controller = new AbortController();
  page.controller = controller;
  const userTurn = addTurn("user", text).parentElement;
  const content = addTurn("assistant", "");
  setBusy(true);
  setStatus("streaming…");
  let reply = "";
  let finish = null;
  let completed = false;  // the stream's [DONE] arrived: the server finished the reply
  let leftOut = 0;  // exchanges this request's retries went without
  let droppedForContext = 0;  // of those, left out of the conversation: a shorter request was accepted
  let failure = null;
  try {
    const url = page.config.chat ? "v1/chat/completions" : "v1/completions";  // relative: a proxy's path too
    let response;
    let earlier = page.messages;  // what this request sends before the new message
    for (;;) {
      const body = requestBody(text, earlier);
      page.lastBody = body;
      $("request").textContent = JSON.stringify(body, null, 2);
      response = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body),
                                    signal: controller.signal });
      if (response.ok) break;
      // a Stop while the refusal's body is read is a stop, not that refusal
      const error = await response.json().catch((e) => { if (controller.signal.aborted) throw e; return {}; });
      if (page.config.chat && earlier.length >= 2 && overflowsContext(response.status, error)) {
        earlier = earlier.slice(2);  // a copy: the conversation loses nothing unless a shorter request is accepted
        leftOut += 1;
        continue;
      }
      if (response.status === 401) askForKey("this server needs its API key: enter it on the right");
      throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
    }
    if (leftOut && conversation === page.conversation) {
      leaveOutOldestExchanges(leftOut);
      droppedForContext = leftOut;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      // events end at a blank line, whatever the line ends (the format allows \r\n and \r, as proxies write)
      while ((cut = EVENT_END.exec(buffer)) !== null) {
        const event = buffer.slice(0, cut.index);
        buffer = buffer.slice(cut.index + cut[0].length);
        for (const line of event.split(/\r\n|\r|\n/)) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(line.startsWith("data: ") ? 6 : 5);
          if (data === "[DONE]") { completed = true; continue; }
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const choice = chunk.choices && chunk.choices[0];
          if (!choice) continue;
          const piece = page.config.chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
          reply += piece;
          appendPieces(content, piece, chunk.latentloop && chunk.latentloop.tokens);
          if (choice.finish_reason) finish = choice.finish_reason;
          shade();
        }
      }
    }
    if (!completed) throw new Error("the stream ended before the server finished the reply (the connection was cut)");
  } catch (error) {
    failure = error;
  } finally {
    if (page.controller === controller) {
      page.controller = null;
      setBusy(false);
    }
  }
  if (conversation !== page.conversation) return;  // New conversation was pressed: this one is gone
  const stopped = failure && failure.name === "AbortError";
  const note = droppedForContext ?
    `; the ${droppedForContext} oldest exchange(s) were left out to fit the model's context` : "";
  if (failure && !stopped) {
    if (reply) {  // what arrived stays on the page, marked, but is not part of the conversation
      content.parentElement.classList.add("incomplete");
      content.dataset.partial = reply;
    } else {
      content.parentElement.remove();
    }
    addTurn("error", String(failure.message || failure) + (reply ? " (the partial reply is not kept)" : ""));
    setStatus("failed" + note);
    shade();
    return;
  }
  // an empty reply is not kept (as `latentloop chat` does): the server refuses an empty assistant
  // turn, so every later message of the conversation would get a 400. A stopped reply is kept as far
  // as it went (the next request shows the model what it wrote).
  const kept = !isBlank(reply);
  if (page.config.chat && kept) {
    page.messages.push({ role: "user", content: text }, { role: "assistant", content: reply });
    page.messageTurns.push(userTurn, content.parentElement);
  }
  content.dataset.final = reply;
  const how = stopped ? "stopped" : `done (${finish || "ended"})`;
  setStatus(how + (page.config.chat && !kept ? ": the reply was empty and is not kept" : "") + note);
  shade();
}

// The default reply budget, within what the server allows and half the context (the rest is the
// conversation's): 64 was refused by a server whose --max-tokens-cap is lower, at every message.
const MAX_TOKENS_DEFAULT = 64;

let started = false;  // the controls' and composer's handlers are in place (a second init() after a key)

async function init() {
  document.body.dataset.state = "loading";
  const key = $("api-key").value || storedKey() || "";
  if (key && !KEY_CHARS.test(key)) {
    askForKey("the API key holds a character no header can carry (only printable ASCII): enter it again");
    return;
  }
  const response = await fetch("page/config", { headers: headers() });
  if (response.status === 401) {
    askForKey(key ? "the server refused this API key: enter it again on the right"
                  : "this server needs its API key: enter it on the right");
    return;
  }
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
  }
  page.config = await response.json();
  const c = page.config;
  $("model").textContent = `${c.model} · ${c.arch} · context ${c.context} tokens` +
    (c.chat ? "" : " · no chat format: the page continues your text");
  $("key-box").hidden = !storedKey() && !$("api-key").value;  // a key in use stays changeable
  if (started) {  // a key entered again: the controls keep what the user set, a streaming reply streams on
    if (page.controller) setBusy(true); else { setBusy(false); setStatus(""); }  // "loading" set above: put back
    return;
  }
  started = true;
  $("max_tokens").max = c.max_tokens_cap;
  $("max_tokens").value = Math.max(1, Math.min(MAX_TOKENS_DEFAULT, c.max_tokens_cap, Math.floor(c.context / 2)));
  $("options").replaceChildren(...c.options.map(optionControl));
  setBusy(false);
  setStatus("");
  $("shade-key").addEventListener("change", (e) => { e.target.dataset.chosen = e.target.value; shade(); });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("message").value;
    if (page.busy || isBlank(text)) return;  // kept in the box: nothing was sent
    const unreadable = unreadableControl();
    if (unreadable) {  // kept in the box too: the request would go without that setting
      setStatus(`${unreadable} is not a number: correct it or clear it (the model's default), then send`);
      return;
    }
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (e) => {
    // an input method's Enter confirms the text being composed (CJK input): it does not send it
    const composing = e.isComposing || e.keyCode === IME_KEY_CODE;
    if (e.key === "Enter" && !e.shiftKey && !composing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (page.controller) page.controller.abort(); });
  $("reset").addEventListener("click", () => {
    page.conversation += 1;  // the running reply, if any, ends unkept
    if (page.controller) page.controller.abort();
    page.controller = null;
    Object.assign(page, { messages: [], messageTurns: [], tokens: [], stats: new Map(), drawn: null });
    $("transcript").replaceChildren();
    setBusy(false);
    shade();
    setStatus("");
  });
}

// Before the model's options load (or when they cannot), Send must not submit the form natively: the
// page would reload and lose the typed message.
$("composer").addEventListener("submit", (e) => e.preventDefault());
// A key is kept as it is typed (a reload before Enter kept nothing), and used as soon as it is entered
// (Enter or the button), without a reload.
$("api-key").addEventListener("input", () => storeKey($("api-key").value.trim()));
$("key-box").addEventListener("submit", (e) => {
  e.preventDefault();
  storeKey($("api-key").value.trim());
  $("api-key").value = $("api-key").value.trim();
  start();
});

function start() {
  init().catch((error) => {
    setStatus("cannot load the model's options: " + String(error.message || error));
  });
}

start();
