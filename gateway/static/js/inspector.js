// The inspector: one token's attribution (its terms summing to the logit) or a concept's catalog entry.

import { getJson, streamPost, ApiError } from "./api.js";

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  e.append(...children.filter((c) => c !== null && c !== undefined));
  return e;
}

const fmt = (x) => (x >= 0 ? "+" : "−") + Math.abs(x).toFixed(4);
const NAME_PREFIX = /^(known|discovered)\s*:\s*/i;

export class Inspector {
  /** onSteer(concept) adds a concept to the steering chips. */
  constructor(body, { onSteer, steerable }) {
    this.body = body;
    this.onSteer = onSteer;
    this.steerable = steerable;
    this.pinned = null;
  }

  /** Token attribution: top concepts, other concepts (when the server reports them), residual, sum. */
  showToken(ta, run) {
    const rows = ta.top.map((c) => el("tr", {},
      el("td", {}, this._conceptButton(c)),
      el("td", { class: "head" }, c.head),
      el("td", { class: "num score", "data-term": "concept" }, fmt(c.score))));
    let sum = ta.top.reduce((acc, c) => acc + c.score, 0) + ta.residual;
    const other = ta.other;
    if (other) {
      sum += (other.known || 0) + (other.discovered || 0);
      rows.push(el("tr", { class: "other" }, el("td", {}, "other known concepts"), el("td", { class: "head" }, "known"),
        el("td", { class: "num score", "data-term": "other" }, fmt(other.known || 0))));
      rows.push(el("tr", { class: "other" }, el("td", {}, "other discovered concepts"), el("td", { class: "head" }, "discovered"),
        el("td", { class: "num score", "data-term": "other" }, fmt(other.discovered || 0))));
    } else {
      rows.push(el("tr", { class: "other" }, el("td", { colSpan: 3 },
        "other concepts: not reported by this server (counted as 0)")));
    }
    rows.push(el("tr", { class: "residual" }, el("td", {}, "residual (not explained by concepts)"), el("td", {}, ""),
      el("td", { class: "num score", "data-term": "residual" }, fmt(ta.residual))));
    const diff = sum - ta.target_logit;
    // every served term is rounded to 1e-6
    const adds = Math.abs(diff) <= 1e-6 * (ta.top.length + 4);
    const verdict = adds ? "✓ the terms add up to the logit"
      : `differs from the logit by ${fmt(diff)}${other ? "" : ": the concepts outside the top list are missing"}`;
    const table = el("table", { class: "attr" },
      el("caption", {}, `Why ${JSON.stringify(ta.text)} (position ${ta.position}${run ? ", " + run.opts.title : ""})`),
      el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "term"), el("th", { scope: "col" }, "head"),
        el("th", { scope: "col", class: "num" }, "contribution to the logit"))),
      el("tbody", {}, ...rows),
      el("tfoot", {},
        el("tr", {}, el("th", { scope: "row" }, "sum of the terms"), el("td", {}, ""),
          el("td", { class: "num", "data-sum": sum.toFixed(6) }, fmt(sum))),
        el("tr", {}, el("th", { scope: "row" }, "target logit"), el("td", {}, ""),
          el("td", { class: "num", "data-logit": ta.target_logit.toFixed(6) }, fmt(ta.target_logit)))));
    const parts = [table, el("p", { class: adds ? "ok" : "hint", "data-adds-up": String(adds) }, verdict)];
    if (run && run.requestId && !run.causal && run.state === "done") {
      parts.push(el("button", { type: "button", class: "inputs-button", onclick: () => this.showInputs(ta, run) },
        "Which inputs caused it?"));
    }
    this.body.replaceChildren(...parts);
    this.body.dataset.view = "token";
  }

  /** Input attribution (POST /v1/attributions/inputs): a heat map over the prompt and the tokens
   * committed before this one, by their integrated-gradients share of its logit. */
  async showInputs(ta, run) {
    const status = el("p", { class: "hint", "data-progress": "0" }, "attributing to the inputs…");
    const heat = el("p", { class: "heat", "aria-label": "input attribution heat map" });
    const legend = el("p", { class: "hint" }, "blue raised the token's logit, red lowered it; hover for the score");
    this.body.append(el("h4", {}, `Which inputs caused ${JSON.stringify(ta.text)}`), status, heat);
    const body = { request_id: run.requestId, positions: [ta.position], n_steps: 16, stream: true };
    try {
      await streamPost("/v1/attributions/inputs", body, (ev) => {
        if (ev.object === "cde.input_attribution.progress") {
          status.textContent = `${ev.done} of ${ev.total} tokens attributed`;
          status.dataset.progress = String(ev.done);
        } else if (ev.object === "cde.input_attribution.target") {
          this._heatMap(heat, ev);
          status.textContent = `committed at step ${ev.commit_order}; ${ev.inputs.length} inputs it saw`;
          this.body.append(legend);
        }
      });
      status.dataset.done = "true";
    } catch (e) {
      status.className = "error-inline";
      status.textContent = e.message;
    }
  }

  _heatMap(heat, target) {
    const most = Math.max(1e-12, ...target.inputs.map((s) => Math.abs(s.normalized)));
    heat.replaceChildren(...target.inputs.map((s) => {
      const span = el("span", { class: "in" + (s.normalized < 0 ? " neg" : ""), "data-position": String(s.position),
        "data-score": String(s.score), title: `position ${s.position}: ${fmt(s.score)} (${(100 * s.normalized).toFixed(1)} %)` },
        s.text);
      span.style.setProperty("--w", (Math.abs(s.normalized) / most).toFixed(3));   // CSSOM: allowed under the CSP
      return span;
    }), el("span", { class: "in target", title: "the explained token" }, target.text));
  }

  _conceptButton(c) {
    return el("button", { type: "button", class: "concept-link", onclick: () => this.showConcept(c) }, c.label || c.name);
  }

  /** A concept's catalog entry: GET /v1/concepts/{id}, else found through the search by its name. */
  async showConcept(c) {
    const id = c.concept_id ?? c.id;
    this.body.replaceChildren(el("p", { class: "hint" }, `loading concept ${id}…`));
    let entry = null;
    try {
      entry = await getJson(`/v1/concepts/${encodeURIComponent(id)}`);
    } catch (e) {
      if (!(e instanceof ApiError) || e.status !== 404) return this._error(e);
      entry = await this._search(c, id).catch(() => null);
    }
    entry = entry || { id, name: (c.label || "").replace(NAME_PREFIX, ""), head: c.head };
    const dl = el("dl", { class: "entry" });
    const add = (k, v) => { if (v !== undefined && v !== null && v !== "") dl.append(el("dt", {}, k), el("dd", {}, String(v))); };
    add("id", entry.id);
    add("head", entry.head);
    add("description", entry.description);
    add("group", entry.group_name);
    add("steerable", entry.steerable === undefined ? undefined : entry.steerable ? "yes" : "no");
    const parts = [el("h3", { class: "entry-name" }, entry.name || c.label), dl];
    if (entry.top_tokens && entry.top_tokens.length) {
      parts.push(el("h4", {}, "Tokens it promotes most"),
        el("ol", { class: "top-tokens" }, ...entry.top_tokens.slice(0, 10).map((t) =>
          el("li", {}, el("code", {}, JSON.stringify(t.text)), ` ${t.score.toFixed(3)}`))));
    }
    const canSteer = this.steerable() && entry.steerable !== false && entry.head !== "discovered";
    const steer = el("button", { type: "button", class: "primary", disabled: !canSteer,
      onclick: () => this.onSteer({ id: entry.id, name: entry.name || c.label }) }, "Steer toward it");
    parts.push(steer);
    if (!canSteer) parts.push(el("p", { class: "hint" }, "Only known concepts of a concept model can be steered."));
    this.body.replaceChildren(...parts);
    this.body.dataset.view = "concept";
  }

  async _search(c, id) {
    const name = (c.name || c.label || "").replace(NAME_PREFIX, "");
    if (!name) return null;
    const res = await getJson(`/v1/concepts?q=${encodeURIComponent(name)}&limit=50`);
    return (res.data || []).find((x) => x.id === id) || null;
  }

  _error(e) {
    this.body.replaceChildren(el("p", { class: "error-inline" }, e.message));
  }
}
