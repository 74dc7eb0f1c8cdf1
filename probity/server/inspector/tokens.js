// Token chips coloured by probability, their top-k tooltip, the surprisal chart and the totals.

const SVG = "http://www.w3.org/2000/svg";
const LOG2 = Math.LN2;

// Colour bins, most likely first. Probability bins are even in p, surprisal bins even-ish in
// bits: the two views stress different things (certainty vs. rare tokens).
export const SCALES = {
  probability: {
    label: "probability",
    edges: [0.9, 0.6, 0.3, 0.1, 0.01],
    names: ["p ≥ 0.9", "0.6 – 0.9", "0.3 – 0.6", "0.1 – 0.3", "0.01 – 0.1", "p < 0.01"],
    bin: (lp, edges) => firstOr(edges, (e) => Math.exp(lp) >= e),
  },
  surprisal: {
    label: "surprisal (bits)",
    edges: [1, 2, 4, 6, 9],
    names: ["< 1 bit", "1 – 2 bits", "2 – 4 bits", "4 – 6 bits", "6 – 9 bits", "≥ 9 bits"],
    bin: (lp, edges) => firstOr(edges, (e) => bits(lp) < e),
  },
};

function firstOr(edges, test) {
  const i = edges.findIndex(test);
  return i < 0 ? edges.length : i;
}

export const bits = (lp) => (lp === 0 ? 0 : -lp / LOG2);

// One position of a logprobs object as the page holds it.
//   token: its label; lp: its logprob (null: nothing conditions it); top: [[label, lp]] sorted,
//   kind: "text" | "partial" (ends mid-character, its text is carried by the next) | "special"
//   (an EOS entry, not part of the text); prompt: true for echoed prompt positions.
export function entries(logprobs, text, { prompt = false } = {}) {
  const { tokens, token_logprobs: lps, top_logprobs: tops } = logprobs;
  // The one entry whose label is not part of `text` is a generated EOS (the last one).
  const special = tokens.length > 0 && tokens.join("") !== text && tokens.slice(0, -1).join("") === text;
  return tokens.map((token, i) => ({
    token,
    lp: lps[i],
    top: tops[i] ? Object.entries(tops[i]).sort((a, b) => b[1] - a[1]) : null,
    kind: special && i === tokens.length - 1 ? "special" : token === "" ? "partial" : "text",
    prompt,
  }));
}

const CONTROL = { "\n": "↵", "\t": "⇥", "\r": "␍", " ": "␣" };

// What a chip shows: whitespace-only tokens as glyphs, control characters as their pictures.
function face(e) {
  if (e.kind === "partial") return "⋯";
  if (e.kind === "special") return e.token;
  const pictured = e.token
    .replace(/[\x00-\x1f\x7f]/g, (c) => CONTROL[c] || String.fromCharCode(c === "\x7f" ? 0x2421 : 0x2400 + c.charCodeAt(0)))
    .replace(/[\x80-\x9f]/g, (c) => `\\x${c.charCodeAt(0).toString(16)}`);
  return /^\s+$/.test(e.token) ? pictured.replace(/ /g, "␣") : pictured;
}

// A label exactly, quoted, with invisible characters escaped.
export function quoted(s) {
  const esc = { "\n": "\\n", "\t": "\\t", "\r": "\\r", '"': '\\"' };
  return `"${s.replace(/[\x00-\x1f\x7f-\x9f"]/g, (c) => esc[c] || `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`)}"`;
}

function el(tag, cls, text) {
  const n = document.createElement(tag);
  if (cls) n.className = cls;
  if (text !== undefined) n.textContent = text;
  return n;
}

function svg(tag, attrs) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
  return n;
}

export const fmt = {
  full: (x) => String(x), // shortest text that reads back as the same double
  short: (x, d = 4) => (Math.abs(x) >= 1e-3 || x === 0 ? x.toFixed(d) : x.toExponential(2)),
};

export function totals(list) {
  const scored = list.filter((e) => e.lp !== null && e.lp !== undefined);
  const sum = scored.reduce((a, e) => a + e.lp, 0);
  const mean = scored.length ? sum / scored.length : NaN;
  return { tokens: list.length, scored: scored.length, sum, mean, bits: -sum / LOG2, perplexity: Math.exp(-mean) };
}

// The floating top-k table, one for the page; shown on hover and on keyboard focus.
export class Tooltip {
  constructor(node) {
    this.node = node;
    this.owner = null;
  }

  show(chip, e, index, id) {
    const n = this.node;
    n.replaceChildren();
    const head = el("div", "tip-head");
    head.append(el("code", "tip-token", e.kind === "partial" ? '""' : quoted(e.token)), el("span", "tip-pos", ` position ${index}${id === undefined ? "" : ` · id ${id}`}`));
    n.append(head);
    if (e.kind === "special") n.append(el("p", "tip-note", "End of sequence: generated, scored, not part of the text."));
    if (e.kind === "partial") n.append(el("p", "tip-note", "Ends mid-character: its bytes are shown by the next token."));
    if (e.lp === null || e.lp === undefined) {
      n.append(el("p", "tip-note", "No value: nothing comes before the first token to condition it."));
    } else {
      const dl = el("dl", "tip-values");
      for (const [k, v] of [["logprob", fmt.full(e.lp)], ["probability", fmt.full(Math.exp(e.lp))], ["surprisal", `${fmt.full(bits(e.lp))} bits`]]) {
        dl.append(el("dt", null, k), el("dd", `v-${k}`, v));
      }
      n.append(dl);
    }
    if (e.top) n.append(this.table(e));
    n.hidden = false;
    this.owner = chip;
    this.place(chip);
  }

  table(e) {
    const t = el("table", "topk");
    t.append(el("caption", null, `top ${e.top.length} at this position`));
    const hr = el("tr");
    for (const h of ["#", "token", "logprob", "probability"]) hr.append(el("th", null, h));
    const thead = t.appendChild(el("thead"));
    thead.append(hr);
    const body = t.appendChild(el("tbody"));
    // the chosen token is the entry with its label; failing that (a collapsed label), its value
    let chosen = e.top.findIndex(([label]) => label === e.token);
    if (chosen < 0) chosen = e.top.findIndex(([, lp]) => lp === e.lp);
    e.top.forEach(([label, lp], i) => {
      const tr = el("tr", i === chosen ? "chosen" : null);
      const cell = el("td", "label", quoted(label));
      if (i === chosen) cell.append(" ", el("span", "mark", "chosen"));
      tr.append(el("td", null, String(i + 1)), cell, el("td", "lp", fmt.full(lp)), el("td", "p", fmt.full(Math.exp(lp))));
      body.append(tr);
    });
    return t;
  }

  place(chip) {
    const n = this.node;
    if (matchMedia("(max-width: 600px)").matches) {
      n.style.left = n.style.top = ""; // a bottom sheet on narrow screens (CSS)
      return;
    }
    const r = chip.getBoundingClientRect();
    const w = n.offsetWidth;
    const h = n.offsetHeight;
    const left = Math.max(8, Math.min(r.left, innerWidth - w - 8));
    const below = r.bottom + 6;
    const top = below + h > innerHeight - 8 && r.top - h - 6 > 8 ? r.top - h - 6 : below;
    n.style.left = `${left}px`;
    n.style.top = `${top}px`;
  }

  hide(chip) {
    if (chip && chip !== this.owner) return;
    this.node.hidden = true;
    this.owner = null;
  }
}

// A strip of chips plus chart and totals for a list of entries; entries may be appended
// while a stream arrives. Keyboard: the strip is one tab stop, arrows/Home/End move.
export class TokenView {
  constructor(root, { tooltip, scale, summary }) {
    this.root = root;
    this.tooltip = tooltip;
    this.scale = scale; // () => current SCALES key
    this.summary = summary; // (entries) => [[label, value, exact]] for the totals line
    this.list = [];
    this.ids = null;
    this.current = 0;
    root.replaceChildren();
    this.totalsNode = root.appendChild(el("dl", "totals"));
    this.strip = root.appendChild(el("div", "strip"));
    this.strip.setAttribute("role", "listbox");
    this.strip.setAttribute("aria-label", "tokens; arrow keys move, the table of alternatives follows the focus");
    this.strip.setAttribute("aria-orientation", "horizontal");
    this.chart = root.appendChild(el("figure", "chart"));
    this.strip.addEventListener("keydown", (ev) => this.key(ev));
    this.frame = 0;
  }

  append(list, { ids } = {}) {
    if (ids) this.ids = ids;
    for (const e of list) this.add(e);
    this.refresh();
  }

  add(e) {
    const i = this.list.length;
    this.list.push(e);
    const chip = el("span", `chip ${e.kind}${e.prompt ? " prompt" : ""}`, face(e));
    chip.dataset.i = i;
    chip.setAttribute("role", "option");
    chip.tabIndex = i === 0 ? 0 : -1;
    chip.setAttribute("aria-describedby", this.tooltip.node.id);
    chip.setAttribute("aria-label", this.describe(e));
    const show = () => this.tooltip.show(chip, e, i, this.ids ? this.ids[i] : undefined);
    chip.addEventListener("mouseenter", show);
    chip.addEventListener("focus", () => {
      this.current = i;
      show();
      this.mark(i);
    });
    chip.addEventListener("mouseleave", () => document.activeElement !== chip && this.tooltip.hide(chip));
    chip.addEventListener("blur", () => this.tooltip.hide(chip));
    this.paint(chip, e);
    this.strip.append(chip);
    if (e.kind === "text" && e.token.includes("\n")) this.strip.append(el("span", "break"));
  }

  describe(e) {
    const where = e.prompt ? "prompt token" : e.kind === "special" ? "end-of-sequence token" : "token";
    if (e.lp === null || e.lp === undefined) return `${where} ${quoted(e.token)}, no value`;
    return `${where} ${quoted(e.token)}, probability ${Math.exp(e.lp).toPrecision(3)}, ${bits(e.lp).toFixed(2)} bits`;
  }

  paint(chip, e) {
    chip.classList.remove(...[0, 1, 2, 3, 4, 5].map((b) => `b${b}`), "none");
    if (e.lp === null || e.lp === undefined) chip.classList.add("none");
    else {
      const s = SCALES[this.scale()];
      chip.classList.add(`b${s.bin(e.lp, s.edges)}`);
    }
  }

  recolor() {
    for (const chip of this.strip.querySelectorAll(".chip")) this.paint(chip, this.list[+chip.dataset.i]);
    this.drawChart();
  }

  key(ev) {
    const chips = this.strip.querySelectorAll(".chip");
    const moves = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1, Home: -Infinity, End: Infinity };
    if (ev.key === "Escape") return this.tooltip.hide();
    if (!(ev.key in moves)) return;
    ev.preventDefault();
    const next = Math.max(0, Math.min(chips.length - 1, this.current + moves[ev.key]));
    this.focus(next);
  }

  focus(i) {
    const chips = this.strip.querySelectorAll(".chip");
    chips[this.current]?.setAttribute("tabindex", "-1");
    chips[i].tabIndex = 0;
    chips[i].focus();
  }

  refresh() {
    // streamed tokens arrive faster than a chart needs to be redrawn
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.drawTotals();
      this.drawChart();
    });
  }

  drawTotals() {
    this.totalsNode.replaceChildren();
    for (const [label, value, exact] of this.summary(this.list)) {
      const dd = el("dd", null, value);
      if (exact !== undefined) dd.title = exact;
      this.totalsNode.append(el("dt", null, label), dd);
    }
  }

  drawChart() {
    const list = this.list;
    const W = Math.max(this.chart.clientWidth || 600, 280);
    const H = 150;
    const pad = { l: 44, r: 10, t: 12, b: 22 };
    const ys = list.map((e) => (e.lp === null || e.lp === undefined ? null : bits(e.lp)));
    const top = Math.max(1, ...ys.filter((y) => y !== null));
    const x = (i) => pad.l + (list.length > 1 ? (i * (W - pad.l - pad.r)) / (list.length - 1) : 0);
    const y = (b) => pad.t + (1 - b / top) * (H - pad.t - pad.b);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img" });
    const shown = ys.filter((v) => v !== null);
    const mean = shown.reduce((a, b) => a + b, 0) / (shown.length || 1);
    root.setAttribute("aria-label", `surprisal per token in bits: ${shown.length} values, mean ${mean.toFixed(2)}, highest ${top.toFixed(2)}`);
    for (const t of [0, top / 2, top]) {
      root.append(svg("line", { x1: pad.l, x2: W - pad.r, y1: y(t), y2: y(t), class: "grid" }));
      const label = svg("text", { x: pad.l - 6, y: y(t) + 4, class: "tick", "text-anchor": "end" });
      label.textContent = t.toFixed(t < 10 ? 1 : 0);
      root.append(label);
    }
    const axis = svg("text", { x: pad.l, y: H - 6, class: "tick" });
    axis.textContent = "surprisal in bits per token →";
    root.append(axis);
    let d = "";
    ys.forEach((v, i) => {
      if (v === null) return;
      d += `${d && ys[i - 1] !== null ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
    });
    root.append(svg("path", { d, class: "line" }));
    this.marker = svg("line", { y1: pad.t, y2: H - pad.b, class: "marker", visibility: "hidden" });
    root.append(this.marker);
    const s = SCALES[this.scale()];
    ys.forEach((v, i) => {
      if (v === null) return;
      const dot = svg("circle", { cx: x(i), cy: y(v), r: list.length > 200 ? 1.5 : 3, class: `dot b${s.bin(list[i].lp, s.edges)}` });
      const title = svg("title", {});
      title.textContent = `${quoted(list[i].token)}: ${v.toFixed(3)} bits`;
      dot.append(title);
      dot.addEventListener("click", () => this.focus(i));
      root.append(dot);
    });
    this.xOf = x;
    this.chart.replaceChildren(root);
    this.mark(this.current);
  }

  mark(i) {
    if (!this.marker || !this.xOf || i >= this.list.length) return;
    this.marker.setAttribute("x1", this.xOf(i));
    this.marker.setAttribute("x2", this.xOf(i));
    this.marker.setAttribute("visibility", document.activeElement?.closest?.(".strip") === this.strip ? "visible" : "hidden");
  }
}
