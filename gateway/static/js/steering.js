// Steering panel: type-ahead concept search (a combobox over GET /v1/concepts?q=) and the chosen
// concepts as chips, each with a strength slider.

import { getJson } from "./api.js";

export class SteeringPanel {
  constructor({ input, listbox, chips, onChange, onError }) {
    this.input = input;
    this.listbox = listbox;
    this.chipsEl = chips;
    this.onChange = onChange;
    this.onError = onError;
    this.chosen = new Map();   // concept id -> {id, name, strength}
    this.options = [];
    this.active = -1;
    this.timer = null;
    this.seq = 0;
    input.addEventListener("input", () => this._queueSearch());
    input.addEventListener("keydown", (e) => this._key(e));
    input.addEventListener("blur", () => setTimeout(() => this._close(), 150));
  }

  _queueSearch() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this._search(), 120);
  }

  async _search() {
    const q = this.input.value.trim();
    if (!q) return this._close();
    const seq = ++this.seq;
    try {
      const res = await getJson(`/v1/concepts?q=${encodeURIComponent(q)}&limit=8`);
      if (seq !== this.seq) return;   // a newer keystroke won
      this._open(res.data || []);
    } catch (e) {
      this._close();
      this.onError(e);
    }
  }

  _open(items) {
    this.options = items;
    this.active = items.length ? 0 : -1;
    this.listbox.replaceChildren(...items.map((c, i) => {
      const li = document.createElement("li");
      li.id = `concept-opt-${i}`;
      li.setAttribute("role", "option");
      const name = document.createElement("span");
      name.className = "opt-name";
      name.textContent = c.name;
      const meta = document.createElement("span");
      meta.className = "opt-meta";
      meta.textContent = `${c.head}${c.group_name ? " · " + c.group_name : ""}${c.steerable === false ? " · not steerable" : ""}`;
      li.append(name, meta);
      li.addEventListener("mousedown", (e) => { e.preventDefault(); this._pick(i); });
      return li;
    }));
    if (!items.length) {
      const li = document.createElement("li");
      li.className = "empty";
      li.textContent = "no concept matches";
      this.listbox.append(li);
    }
    this.listbox.hidden = false;
    this.input.setAttribute("aria-expanded", "true");
    this._highlight();
  }

  _close() {
    this.listbox.hidden = true;
    this.input.setAttribute("aria-expanded", "false");
    this.input.removeAttribute("aria-activedescendant");
    this.active = -1;
  }

  _highlight() {
    [...this.listbox.querySelectorAll("[role=option]")].forEach((li, i) => li.setAttribute("aria-selected", String(i === this.active)));
    if (this.active >= 0) this.input.setAttribute("aria-activedescendant", `concept-opt-${this.active}`);
  }

  _key(e) {
    const open = !this.listbox.hidden && this.options.length;
    if (e.key === "ArrowDown" && open) { this.active = (this.active + 1) % this.options.length; this._highlight(); e.preventDefault(); }
    else if (e.key === "ArrowUp" && open) { this.active = (this.active - 1 + this.options.length) % this.options.length; this._highlight(); e.preventDefault(); }
    else if (e.key === "Enter") { if (open && this.active >= 0) { this._pick(this.active); } e.preventDefault(); }
    else if (e.key === "Escape") this._close();
  }

  _pick(i) {
    const c = this.options[i];
    if (!c) return;
    if (c.steerable === false) { this.onError(new Error(`concept ${JSON.stringify(c.name)} is not steerable`)); return; }
    this.add({ id: c.id, name: c.name });
    this.input.value = "";
    this._close();
  }

  /** Add (or keep) a concept chip; used by the search and by the inspector's "steer toward it". */
  add(c, strength = 1.0) {
    if (!this.chosen.has(c.id)) this.chosen.set(c.id, { id: c.id, name: c.name, strength });
    this._renderChips();
    this.onChange();
    const slider = this.chipsEl.querySelector(`[data-concept="${c.id}"] input[type=range]`);
    if (slider) slider.focus();
  }

  remove(id) {
    this.chosen.delete(id);
    this._renderChips();
    this.onChange();
    this.input.focus();
  }

  _renderChips() {
    this.chipsEl.replaceChildren(...[...this.chosen.values()].map((c) => {
      const li = document.createElement("li");
      li.className = "chip";
      li.dataset.concept = c.id;
      const name = document.createElement("span");
      name.className = "chip-name";
      name.textContent = c.name;
      const slider = document.createElement("input");
      slider.type = "range";
      slider.min = "0.1";
      slider.max = "10";
      slider.step = "0.1";
      slider.value = String(c.strength);
      slider.setAttribute("aria-label", `strength of ${c.name}`);
      slider.setAttribute("aria-describedby", "strength-help");
      slider.title = "strength: scales the injected magnitude (1 = default, 0.5 = half, 2 = double)";
      const out = document.createElement("output");
      out.textContent = c.strength.toFixed(1);
      slider.addEventListener("input", () => {
        c.strength = Number(slider.value);
        out.textContent = c.strength.toFixed(1);
        this.onChange();
      });
      const rm = document.createElement("button");
      rm.type = "button";
      rm.className = "chip-remove";
      rm.textContent = "×";
      rm.setAttribute("aria-label", `remove ${c.name}`);
      rm.addEventListener("click", () => this.remove(c.id));
      li.append(name, slider, out, rm);
      return li;
    }));
  }

  /** The request's `steering` object, or null with no concept chosen. */
  steering(mode, target) {
    if (!this.chosen.size) return null;
    const s = { concepts: [...this.chosen.values()].map((c) => ({ id: c.id, strength: c.strength })), mode };
    if (target !== undefined && Number.isFinite(target)) s.target = target;
    return s;
  }

  describe() {
    return [...this.chosen.values()].map((c) => `${c.name} ×${c.strength.toFixed(1)}`).join(", ");
  }
}
