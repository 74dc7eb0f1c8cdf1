// The page: score a text, generate with streaming, compare continuations. Every number shown
// comes from probity's API (/v1/completions with echo + logprobs, /tokenize).

import { ApiError, apiKey, call, setApiKey, stream } from "./api.js";
import { SCALES, TokenView, Tooltip, entries, fmt, quoted, totals } from "./tokens.js";

const $ = (id) => document.getElementById(id);
const tooltip = new Tooltip($("tip"));
const views = new Map(); // panel -> TokenViews shown in it
let model = null;

const scale = () => document.querySelector('input[name="scale"]:checked').value;
const topK = () => Number($("top-k").value);

function view(panel, root, summary) {
  const v = new TokenView(root, { tooltip, scale, summary });
  views.get(panel).push(v);
  return v;
}

function reset(panel) {
  views.set(panel, []);
  tooltip.hide();
}

// ------------------------------------------------------------------ errors

function showError(panel, err) {
  const box = $(`${panel}-error`);
  box.replaceChildren();
  if (!err) {
    box.hidden = true;
    return;
  }
  const e = err instanceof ApiError ? err : new ApiError(0, "page_error", null, String(err));
  const head = document.createElement("p");
  const code = document.createElement("strong");
  code.className = "code";
  code.textContent = e.code;
  head.append(code, e.status ? ` · HTTP ${e.status}` : "");
  if (e.param) {
    const p = document.createElement("code");
    p.className = "param";
    p.textContent = e.param;
    head.append(" · param ", p);
  }
  const msg = document.createElement("p");
  msg.className = "message";
  msg.textContent = e.message;
  box.append(head, msg);
  box.hidden = false;
  if (e.code === "invalid_api_key") $("api-key").focus();
}

async function guarded(panel, fn) {
  showError(panel, null);
  const busy = document.querySelectorAll(`#panel-${panel} button[type=submit]`);
  busy.forEach((b) => (b.disabled = true));
  try {
    if (!model) await loadModel();
    await fn();
  } catch (e) {
    if (e.name !== "AbortError") showError(panel, e);
  } finally {
    busy.forEach((b) => (b.disabled = false));
  }
}

// ------------------------------------------------------------------ model and key

async function loadModel() {
  const status = $("model");
  try {
    const m = (await call("GET", "/v1/models")).data[0];
    model = m.id;
    status.textContent = `model ${m.id} · context ${m.max_model_len} tokens`;
  } catch (e) {
    model = null;
    status.textContent = e.code === "invalid_api_key" ? "this server needs an API key: enter it above" : `${e.code}: ${e.message}`;
    throw e;
  }
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  setApiKey($("api-key").value.trim());
  loadModel().catch(() => {});
});

// ------------------------------------------------------------------ legend, scale, tabs

function drawLegend() {
  const s = SCALES[scale()];
  const ul = $("legend");
  ul.replaceChildren();
  const item = (cls, text) => {
    const li = document.createElement("li");
    const sw = document.createElement("span");
    sw.className = `swatch ${cls}`;
    li.append(sw, text);
    ul.append(li);
  };
  s.names.forEach((name, i) => item(`b${i}`, name));
  item("none", "no value");
  item("special", "end of sequence");
}

for (const r of document.querySelectorAll('input[name="scale"]')) {
  r.addEventListener("change", () => {
    drawLegend();
    for (const list of views.values()) list.forEach((v) => v.recolor());
  });
}

const tabs = [...document.querySelectorAll('[role="tab"]')];
function selectTab(tab) {
  for (const t of tabs) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
  tooltip.hide();
  tab.focus();
  for (const list of views.values()) list.forEach((v) => v.drawChart());
}
tabs.forEach((t, i) => {
  t.addEventListener("click", () => selectTab(t));
  t.addEventListener("keydown", (ev) => {
    const to = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[ev.key];
    if (to === undefined) return;
    ev.preventDefault();
    selectTab(tabs[(to + tabs.length) % tabs.length]);
  });
});

addEventListener("resize", () => {
  for (const list of views.values()) list.forEach((v) => v.drawChart());
});

// ------------------------------------------------------------------ score

function scoreSummary(list) {
  const t = totals(list);
  return [
    ["tokens", String(t.tokens)],
    ["scored", String(t.scored)],
    ["sum logprob", fmt.short(t.sum), fmt.full(t.sum)],
    ["mean logprob", fmt.short(t.mean), fmt.full(t.mean)],
    ["perplexity", fmt.short(t.perplexity, 3), fmt.full(t.perplexity)],
    ["surprisal", `${fmt.short(t.bits, 2)} bits`, fmt.full(t.bits)],
  ];
}

$("score-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  guarded("score", async () => {
    const text = $("score-text").value;
    const [scored, tokenized] = await Promise.allSettled([
      call("POST", "/v1/completions", { model, prompt: text, max_tokens: 0, echo: true, logprobs: topK() }),
      call("POST", "/tokenize", { model, prompt: text }),
    ]);
    if (scored.status === "rejected") throw scored.reason;
    const choice = scored.value.choices[0];
    const list = entries(choice.logprobs, choice.text);
    // token ids from /tokenize, shown only when it saw the very same tokens
    const ids = tokenized.status === "fulfilled" && tokenized.value.count === list.length ? tokenized.value.tokens : undefined;
    reset("score");
    view("score", $("score-result"), scoreSummary).append(list, { ids });
  });
});

// ------------------------------------------------------------------ generate

let running = null;

function numberField(id) {
  const v = $(id).value;
  return v === "" ? undefined : Number(v);
}

$("generate-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  guarded("generate", async () => {
    const body = { model, prompt: $("gen-prompt").value, max_tokens: numberField("gen-max"), temperature: numberField("gen-temp"),
      seed: numberField("gen-seed"), stream: true, echo: true, logprobs: topK(), stream_options: { include_usage: true } };
    reset("generate");
    const status = $("gen-status");
    const v = view("generate", $("generate-result"), (list) => {
      const gen = list.filter((e) => !e.prompt);
      const t = totals(gen);
      return [
        ["prompt tokens", String(list.length - gen.length)],
        ["generated", String(gen.length)],
        ["sum logprob", fmt.short(t.sum), fmt.full(t.sum)],
        ["mean logprob", gen.length ? fmt.short(t.mean) : "–", fmt.full(t.mean)],
        ["perplexity", gen.length ? fmt.short(t.perplexity, 3) : "–", fmt.full(t.perplexity)],
      ];
    });
    running = new AbortController();
    $("gen-stop").disabled = false;
    status.textContent = "generating…";
    let first = true;
    try {
      await stream("/v1/completions", body, (chunk) => {
        const c = chunk.choices[0];
        if (!c) return; // the usage chunk
        if (c.logprobs && c.logprobs.tokens.length) v.append(entries(c.logprobs, c.text, { prompt: first }));
        if (first) v.strip.append(Object.assign(document.createElement("span"), { className: "divider", textContent: "completion ▸" }));
        first = false;
        if (c.finish_reason) status.textContent = `finished: ${c.finish_reason === "stop" ? "stop (end of sequence or a stop string)" : "length (max tokens reached)"}`;
      }, running.signal);
    } catch (e) {
      status.textContent = e.name === "AbortError" ? "stopped" : "failed";
      throw e;
    } finally {
      running = null;
      $("gen-stop").disabled = true;
    }
  });
});

$("gen-stop").addEventListener("click", () => running && running.abort());

// ------------------------------------------------------------------ compare

const RANKS = {
  sum: (r) => r.sum,
  per_char: (r) => r.sum / r.chars,
  per_token: (r) => r.sum / r.tokens.length,
};
let compared = [];

$("compare-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  guarded("compare", async () => {
    const context = $("cmp-context").value;
    const delim = $("cmp-delim").value;
    const options = $("cmp-options").value.split("\n").map((l) => l.replace(/\r$/, "")).filter((l) => l !== "");
    if (!options.length) throw new ApiError(0, "no_continuations", "continuations", "write at least one continuation, one per line");
    // lm-eval's split: the continuation is what follows the context's own tokens
    const ctx = await call("POST", "/tokenize", { model, prompt: context });
    const prompts = options.map((o) => context + delim + o);
    let resp;
    try {
      resp = await call("POST", "/v1/completions", { model, prompt: prompts, max_tokens: 0, echo: true, logprobs: topK() });
    } catch (e) {
      const m = /^prompt\[(\d+)\]/.exec(e.param || "");
      if (m) e.message = `continuation ${Number(m[1]) + 1} (${quoted(options[m[1]])}): ${e.message}`;
      throw e;
    }
    compared = resp.choices.map((c, i) => {
      const all = entries(c.logprobs, c.text);
      const tokens = all.slice(ctx.count);
      const cont = delim + options[i];
      return {
        text: options[i], tokens,
        sum: tokens.reduce((a, e) => a + e.lp, 0),
        chars: [...cont].length,
        greedy: tokens.every((e) => e.top && e.lp === e.top[0][1]),
        merged: all.slice(0, ctx.count).map((e) => e.token).join("") !== context,
      };
    });
    drawRanking();
  });
});

$("cmp-rank").addEventListener("change", () => compared.length && drawRanking());

function drawRanking() {
  const key = RANKS[$("cmp-rank").value];
  const ol = $("compare-result");
  reset("compare");
  ol.replaceChildren();
  const ranked = [...compared].sort((a, b) => key(b) - key(a));
  ranked.forEach((r, i) => {
    const li = document.createElement("li");
    li.className = i === 0 ? "best" : "";
    const details = li.appendChild(document.createElement("details"));
    const summary = details.appendChild(document.createElement("summary"));
    const name = document.createElement("span");
    name.className = "cont";
    name.textContent = quoted(r.text);
    summary.append(name);
    if (i === 0) summary.append(Object.assign(document.createElement("span"), { className: "badge", textContent: "best" }));
    if (r.greedy) summary.append(Object.assign(document.createElement("span"), { className: "badge greedy", textContent: "greedy" }));
    const nums = document.createElement("span");
    nums.className = "nums";
    const cell = (label, x) => Object.assign(document.createElement("span"), { textContent: `${label} ${fmt.short(x)}`, title: fmt.full(x) });
    nums.append(cell("total", r.sum), cell("per token", r.sum / r.tokens.length), cell("per char", r.sum / r.chars),
      Object.assign(document.createElement("span"), { textContent: `${r.tokens.length} tokens` }));
    summary.append(nums);
    if (r.merged) details.append(Object.assign(document.createElement("p"), { className: "note", textContent: "The context's last token merges into this continuation; split by token count, as lm-eval does." }));
    const root = details.appendChild(document.createElement("div"));
    root.className = "result";
    view("compare", root, scoreSummary).append(r.tokens);
    details.addEventListener("toggle", () => details.open && views.get("compare").forEach((v) => v.drawChart()));
    ol.append(li);
  });
}

// ------------------------------------------------------------------ batch jobs

async function drawBatches() {
  const body = $("batches-body");
  try {
    const list = (await call("GET", "/v1/batches?limit=50")).data;
    showError("batches", null);
    body.replaceChildren(...list.map((b) => {
      const tr = document.createElement("tr");
      const c = b.request_counts;
      const bar = Object.assign(document.createElement("progress"), { max: Math.max(c.total, 1), value: c.completed + c.failed });
      bar.setAttribute("aria-label", `${b.id} progress`);
      const cells = [b.id, b.status, bar, c.completed, c.failed, c.total];
      for (const x of cells) {
        const td = tr.appendChild(document.createElement("td"));
        if (x instanceof Node) td.append(x);
        else td.textContent = String(x);
      }
      tr.dataset.batch = b.id;
      return tr;
    }));
  } catch (e) {
    showError("batches", e);
  }
}

setInterval(() => {
  if (!$("panel-batches").hidden) drawBatches();
}, 2000);
$("tab-batches").addEventListener("click", drawBatches);

// ------------------------------------------------------------------ start

for (const p of ["score", "generate", "compare"]) views.set(p, []);
$("api-key").value = apiKey();
drawLegend();
loadModel().catch(() => {});
