// One generation's column: the committed text, the active block as cells that fill in the order
// the model chose, running statistics and the concepts per chunk. Fed with the API's SSE objects.

import { ChunkPanel } from "./chunks.js";

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** How a token's text shows inside a cell: the whole text, with spaces, newlines and tabs made visible. */
function visible(text) {
  if (text === undefined || text === null) return "?";
  if (text === "") return "∅";
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

export class RunView {
  /**
   * opts: {title, causal, blockSize, maxTokens, pace (ms per step, 0 = live),
   *        onToken(attribution, run), onConcept(concept)}
   */
  constructor(parent, opts) {
    const tpl = document.getElementById("run-template").content.firstElementChild.cloneNode(true);
    parent.append(tpl);
    this.el = tpl;
    this.opts = opts;
    this.causal = opts.causal;
    this.width = opts.causal ? 16 : opts.blockSize;
    this.el.querySelector(".run-title").textContent = opts.title;
    this.el.setAttribute("aria-label", opts.title);
    this.el.dataset.state = "waiting";
    this.statsEl = this.el.querySelector(".run-stats");
    this.committedEl = this.el.querySelector(".committed");
    this.blockTitle = this.el.querySelector(".block-title");
    this.cellsEl = this.el.querySelector(".cells");
    this.logEl = this.el.querySelector(".forward-log");
    this.el.querySelector(".legend").append(...this._legend());
    this.chunks = new ChunkPanel(this.el.querySelector(".chunks"), opts.onConcept);
    this.cells = [];
    for (let i = 0; i < this.width; i++) {
      const c = document.createElement("span");
      c.className = "cell";
      c.setAttribute("role", "listitem");
      this.cellsEl.append(c);
      this.cells.push(c);
    }
    this.info = new Map();         // absolute position -> {text, step, kind}
    this.state = "waiting";
    this.winStart = null;          // first position of the active block (or causal chunk window)
    this.promptLen = null;
    this.genEnd = null;
    this.steps = 0;
    this.tokens = 0;
    this.proposed = 0;
    this.accepted = 0;
    this.forwards = 0;
    this.usage = null;
    this.finish = null;
    this.seed = null;
    this.attributions = new Map(); // position -> token attribution
    this.queue = [];
    this.pumping = null;
    this._stats();
    this._draw();
  }

  _legend() {
    const items = this.causal
      ? [["accepted", "accepted draft"], ["bonus", "bonus"], ["correction", "after a rejected draft"], ["cold", "plain"]]
      : [["masked", "masked"], ["filled", "filled"], ["prompt", "prompt"]];
    return items.map(([cls, text]) => {
      const s = document.createElement("span");
      s.className = "key-item";
      const sw = document.createElement("span");
      sw.className = "cell swatch " + cls;
      sw.setAttribute("aria-hidden", "true");
      s.append(sw, document.createTextNode(text));
      return s;
    });
  }

  /** Queue one SSE object; drawing runs at the chosen pace, behind the stream if need be. */
  push(ev) {
    this.queue.push(ev);
    this._kick();
  }

  // One drawing loop at a time; `pumping` is cleared only after the loop's promise settles
  // (a loop that ran synchronously must not leave a stale promise behind).
  _kick() {
    if (this.pumping) return;
    this.pumping = (async () => {
      while (this.queue.length) {
        const ev = this.queue.shift();
        this._apply(ev);
        if (ev.object === "cde.step" && this.opts.pace > 0) await sleep(this.opts.pace);
      }
    })().catch((e) => console.error("drawing failed", e)).then(() => {
      this.pumping = null;
      if (this.queue.length) this._kick();
    });
  }

  /** Stop drawing: drop the events not drawn yet (slow motion may be far behind the stream). */
  discard() { this.queue.length = 0; }

  /** Resolves once every queued event is drawn. */
  async drained() {
    while (this.pumping) await this.pumping;
  }

  /** waiting | running | done | stopped (the user pressed Stop) | error; the status line says which. */
  setState(state) {
    this.el.dataset.state = state;
    this.state = state;
    // stopped or failed: masks left in the block will never fill
    if (state === "stopped" || state === "error") this.cellsEl.classList.add("ended");
    this._stats();
  }

  _apply(ev) {
    const cde = ev.cde || {};
    if (ev.object === "cde.step") return this._step(cde);
    if (cde.request_id !== undefined && cde.prompt_tokens !== undefined) {
      this.promptLen = cde.prompt_tokens;
      this.genEnd = this.promptLen + this.opts.maxTokens;
      this.seed = cde.seed;
      this.requestId = cde.request_id;
      if (this.winStart === null) this.winStart = this.causal ? this.promptLen
        : Math.floor(this.promptLen / this.width) * this.width;
      this._draw();
    }
    if (cde.block_index !== undefined && cde.tokens !== undefined) this._block(ev, cde);
    if (ev.usage) this.usage = { ...ev.usage, ...cde };
    for (const ch of ev.choices || []) if (ch.finish_reason) this.finish = ch.finish_reason;
    // finished: masks left in the last block will never fill (the request stopped early)
    this.cellsEl.classList.toggle("ended", this.finish !== null);
    this._stats();
  }

  _step(s) {
    const texts = s.texts || s.tokens.map((t) => "#" + t);
    this.steps += 1;
    if (!this.causal) {
      const start = s.block_index * this.width;
      if (start !== this.winStart) { this.winStart = start; this._clearLog(); }
      s.positions.forEach((p, i) => this.info.set(p, { text: texts[i], step: s.step, kind: "filled", fresh: true }));
      this.tokens += s.positions.length;
    } else {
      this._causalStep(s, texts);
    }
    this._draw();
    this._stats();
  }

  // A causal forward: tokens = accepted drafts, then the bonus (all accepted) or the correction
  // that replaced the first rejected draft; a cold forward has no drafts to verify.
  _causalStep(s, texts) {
    const proposed = s.drafts_proposed || 0;
    const accepted = s.drafts_accepted || 0;
    this.forwards = s.step;
    this.proposed += proposed;
    this.accepted += accepted;
    s.positions.forEach((p, i) => {
      let kind = "cold";
      if (proposed > 0) kind = i < accepted ? "accepted" : (accepted === proposed ? "bonus" : "correction");
      this.info.set(p, { text: texts[i], step: s.step, kind, fresh: true });
    });
    this.tokens += s.positions.length;
    const li = document.createElement("li");
    const parts = s.positions.map((p, i) => {
      const span = document.createElement("span");
      span.className = "tok-mark " + this.info.get(p).kind;
      span.textContent = visible(texts[i]);
      return span;
    });
    li.append(`forward ${s.step}: `, ...parts);
    if (s.rejected_text !== undefined || s.rejected_token !== undefined) {
      const rej = document.createElement("span");
      rej.className = "tok-mark rejected";
      rej.title = "rejected draft";
      rej.textContent = visible(s.rejected_text !== undefined ? s.rejected_text : "#" + s.rejected_token);
      // the rejected draft stood where the correction now is
      li.insertBefore(rej, parts[accepted] || null);
    }
    if (proposed === 0) li.append(" (cold)");
    else li.append(` (${accepted}/${proposed} accepted)`);
    this.logEl.prepend(li);
    while (this.logEl.children.length > 8) this.logEl.lastChild.remove();
  }

  _clearLog() { this.logEl.replaceChildren(); }

  _block(ev, b) {
    const tas = b.token_attributions || [];
    for (const ta of tas) this.attributions.set(ta.position, ta);
    const piece = (ev.choices && ev.choices[0] && ((ev.choices[0].delta || {}).content ?? ev.choices[0].text)) || "";
    const span = document.createElement("span");
    span.className = "blk";
    span.dataset.block = b.block_index;
    if (tas.length) {
      for (const ta of [...tas].sort((x, y) => x.position - y.position)) {
        const t = document.createElement("button");
        t.type = "button";
        t.className = "tok";
        t.textContent = ta.text;
        t.dataset.position = ta.position;
        t.setAttribute("aria-label", `token ${JSON.stringify(ta.text)} at position ${ta.position}: show attribution`);
        const show = () => this.opts.onToken(ta, this);
        t.addEventListener("click", show);
        t.addEventListener("mouseenter", show);
        t.addEventListener("focus", show);
        span.append(t);
      }
    } else {
      span.textContent = piece;
    }
    this.committedEl.append(span);
    this.committedEl.scrollTop = this.committedEl.scrollHeight;
    // The finished block's cells show as settled until the next block starts.
    const end = b.start + b.tokens.length;
    if (!this.causal) {
      for (let p = b.start; p < end; p++) {
        const cell = this.info.get(p);
        if (cell) cell.kind = "settled";
      }
      this.settledBlock = b.block_index;
    } else {
      this.winStart = end;   // causal: the next chunk's window
    }
    // chunk bars: tokens before a closed chunk's end belong to it
    let rest = [...tas].sort((x, y) => x.position - y.position);
    for (const ca of [...(b.chunk_attributions || [])].sort((x, y) => x.start - y.start)) {
      this.chunks.addTokens(rest.filter((t) => t.position < ca.end));
      rest = rest.filter((t) => t.position >= ca.end);
      this.chunks.closeChunk(ca);
    }
    this.chunks.addTokens(rest);
    this.blocks = (this.blocks || 0) + 1;
    this._draw();
  }

  _draw() {
    const start = this.winStart;
    let filled = 0;
    for (let i = 0; i < this.width; i++) {
      const cell = this.cells[i];
      const p = start === null ? null : start + i;
      const info = p === null ? undefined : this.info.get(p);
      let cls = "cell";
      let label;
      if (p !== null && this.promptLen !== null && p < this.promptLen) {
        cls += " prompt";
        cell.textContent = "";
        label = `position ${p}: prompt`;
      } else if (p !== null && this.genEnd !== null && p >= this.genEnd) {
        cls += " unused";
        cell.textContent = "";
        label = `position ${p}: past max_tokens`;
      } else if (info) {
        cls += " filled " + info.kind;
        if (info.fresh) { cls += " just"; info.fresh = false; }
        cell.textContent = visible(info.text);
        label = `position ${p}: ${JSON.stringify(info.text)}, step ${info.step}`;
        filled += 1;
      } else {
        cls += " masked";
        cell.textContent = "";
        label = p === null ? "masked" : `position ${p}: masked`;
      }
      cell.className = cls;
      cell.title = label;
      cell.setAttribute("aria-label", label);
      if (info) cell.dataset.step = info.step; else delete cell.dataset.step;
    }
    this.cellsEl.dataset.filled = filled;
    if (this.causal) this.blockTitle.textContent = start === null ? "Active chunk" : `Active chunk from position ${start}`;
    else this.blockTitle.textContent = start === null ? "Active block"
      : `Block ${Math.floor(start / this.width)}: ${filled} of ${this._genCells(start)} filled`;
  }

  _genCells(start) {
    const lo = Math.max(start, this.promptLen ?? start);
    const hi = Math.min(start + this.width, this.genEnd ?? start + this.width);
    return Math.max(0, hi - lo);
  }

  _stats() {
    const parts = [];
    if (this.causal) {
      parts.push(`forward ${this.forwards}`, `${this.tokens} tokens`);
      if (this.forwards) parts.push(`${(this.tokens / this.forwards).toFixed(2)} tokens/forward`);
      if (this.proposed) parts.push(`acceptance ${(100 * this.accepted / this.proposed).toFixed(0)} %`);
    } else {
      const blocks = this.blocks || 0;
      parts.push(`step ${this.steps}`, `${this.tokens} tokens`, `${blocks} block${blocks === 1 ? "" : "s"} committed`);
    }
    if (this.usage) {
      const u = this.usage;
      if (u.tokens_per_forward !== undefined) parts.push(`final: ${u.completion_tokens} tokens in ${u.forwards} forwards`);
      if (u.isd_acceptance !== undefined) parts.push(`acceptance ${(100 * u.isd_acceptance).toFixed(0)} %`);
    }
    if (this.seed !== null) parts.push(`seed ${this.seed}`);
    if (this.finish) parts.push(`finished: ${this.finish}`);
    else if (this.state === "stopped") parts.push("stopped");
    else if (this.state === "error") parts.push("failed");
    this.statsEl.textContent = parts.join(" · ");
  }

  /** The committed text as it reads (for tests and copy). */
  text() { return this.committedEl.textContent; }
}
