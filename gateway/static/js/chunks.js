// Concepts per chunk as bars: the running chunk sums its tokens' attributions as blocks land,
// a closed chunk shows the attribution service's own chunk scores.

const SHOWN = 6;

/** One chunk's bars; rows are kept per concept so widths animate instead of being redrawn. */
class ChunkBars {
  constructor(parent, title, onConcept) {
    this.el = document.createElement("section");
    this.el.className = "chunk";
    this.head = document.createElement("h4");
    this.head.textContent = title;
    this.list = document.createElement("ul");
    this.list.className = "bars";
    this.el.append(this.head, this.list);
    parent.prepend(this.el);
    this.rows = new Map();
    this.onConcept = onConcept;
  }

  setTitle(text) { this.head.textContent = text; }

  /** scores: [{concept_id, label, head, score}], any order; shows the largest |score| first. */
  show(scores) {
    const top = [...scores].sort((a, b) => Math.abs(b.score) - Math.abs(a.score)).slice(0, SHOWN);
    const max = Math.max(1e-12, ...top.map((s) => Math.abs(s.score)));
    const keep = new Set(top.map((s) => s.concept_id));
    for (const [id, row] of this.rows) if (!keep.has(id)) { row.li.remove(); this.rows.delete(id); }
    top.forEach((s) => {
      let row = this.rows.get(s.concept_id);
      if (!row) row = this._row(s);
      row.value.textContent = s.score.toFixed(3);
      row.bar.style.width = (100 * Math.abs(s.score) / max).toFixed(1) + "%";
      row.bar.classList.toggle("neg", s.score < 0);
      this.list.append(row.li);   // re-appending orders the rows
    });
  }

  _row(s) {
    const li = document.createElement("li");
    const name = document.createElement("button");
    name.type = "button";
    name.className = "concept-link";
    name.textContent = s.label;
    name.title = `${s.label} (${s.head} head, id ${s.concept_id})`;
    name.addEventListener("click", () => this.onConcept(s));
    const track = document.createElement("span");
    track.className = "track";
    const bar = document.createElement("span");
    bar.className = "bar";
    track.append(bar);
    const value = document.createElement("span");
    value.className = "value";
    li.append(name, track, value);
    const row = { li, bar, value };
    this.rows.set(s.concept_id, row);
    return row;
  }
}

export class ChunkPanel {
  constructor(parent, onConcept) {
    this.parent = parent;
    this.onConcept = onConcept;
    this.reset();
  }

  reset() {
    this.parent.replaceChildren();
    this.running = null;
    this.sums = new Map();   // concept id -> {concept_id, label, head, score}
    this.tokens = 0;
  }

  /** Token attributions of a committed block: they feed the running chunk's bars. */
  addTokens(tokenAttributions) {
    if (!tokenAttributions.length) return;
    for (const ta of tokenAttributions) {
      for (const c of ta.top) {
        const s = this.sums.get(c.concept_id) || { ...c, score: 0 };
        s.score += c.score;
        this.sums.set(c.concept_id, s);
      }
    }
    this.tokens += tokenAttributions.length;
    if (!this.running) this.running = new ChunkBars(this.parent, "", this.onConcept);
    this.running.el.classList.add("running");
    this.running.setTitle(`Running chunk: ${this.tokens} tokens (sum of their top concepts)`);
    this.running.show([...this.sums.values()]);
  }

  /** A chunk the attribution service closed: its scores replace the running sums. */
  closeChunk(ca) {
    const bars = this.running || new ChunkBars(this.parent, "", this.onConcept);
    bars.el.classList.remove("running");
    bars.setTitle(`Chunk, positions ${ca.start}–${ca.end - 1} (residual ${ca.residual_pct.toFixed(1)} %)`);
    bars.show(ca.top);
    this.running = null;
    this.sums = new Map();
    this.tokens = 0;
  }
}
