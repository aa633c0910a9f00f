// The live view's wiring: model info, the prompt and decode options, steering, one or two runs
// streaming at once (steered beside default, same seed), errors shown as the API sent them.

import { apiKey, setApiKey, getJson, streamPost, curlCommand, ApiError } from "./api.js";
import { RunView } from "./run.js";
import { SteeringPanel } from "./steering.js";
import { Inspector } from "./inspector.js";

const $ = (id) => document.getElementById(id);
const state = { model: null, causal: false, blockSize: 64, controller: null };

function showError(e) {
  const box = $("error");
  if (!e) { box.hidden = true; box.replaceChildren(); return; }
  const err = e instanceof ApiError ? e.error : {};
  const head = document.createElement("strong");
  head.textContent = e instanceof ApiError
    ? `API error ${e.status}${err.code ? " (" + err.code + ")" : ""}${err.param ? ", parameter " + err.param : ""}`
    : "Error";
  const msg = document.createElement("span");
  msg.className = "error-message";
  msg.textContent = e.message;
  box.replaceChildren(head, document.createTextNode(": "), msg);
  box.hidden = false;
}

async function loadModel() {
  try {
    const res = await getJson("/v1/models");
    const m = res.data[0];
    state.model = m;
    const info = m.cde || {};
    state.causal = info.family === "causal";
    state.blockSize = info.diffusion_block_size || 64;
    document.body.classList.toggle("causal", state.causal);
    const parts = [m.id, state.causal ? "causal (introspective strided decoding)" : `block diffusion, ${state.blockSize}-token blocks`];
    if (!state.causal) parts.push(`${info.n_known_concepts} known + ${info.n_discovered_concepts} discovered concepts`);
    parts.push(`context ${info.max_context}`);
    $("model-info").textContent = parts.join(" · ");
    showError(null);
  } catch (e) {
    $("model-info").textContent = "model unavailable";
    showError(e);
  }
  updateCurl();
}

const num = (id) => {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
};

/** The request body for one run; `steering` null for the default run. */
function requestBody(seed, steering) {
  const kind = document.querySelector("input[name=kind]:checked").value;
  const body = { model: state.model ? state.model.id : undefined, stream: true, stream_mode: "steps",
    stream_options: { include_usage: true }, max_tokens: num("opt-max-tokens") };
  if (seed !== undefined) body.seed = seed;
  const temperature = num("opt-temperature");
  if (temperature !== undefined) body.temperature = temperature;
  if (state.causal) {
    const stride = num("opt-stride");
    if (stride !== undefined) body.decode = { stride };
  } else {
    const decode = {};
    const tps = num("opt-tokens-per-step");
    const thr = num("opt-threshold");
    if (tps !== undefined) decode.tokens_per_step = tps;
    if (thr !== undefined) decode.threshold = thr;
    if (Object.keys(decode).length) body.decode = decode;
    body.attribution = "all";
    if (steering) body.steering = steering;
  }
  const text = $("prompt").value;
  if (kind === "chat") body.messages = [{ role: "user", content: text }];
  else body.prompt = text;
  return { path: kind === "chat" ? "/v1/chat/completions" : "/v1/completions", body };
}

function mode() { return document.querySelector("input[name=mode]:checked").value; }

function updateCurl() {
  const steering = state.causal ? null : steeringPanel.steering(mode(), num("opt-steer-target"));
  const { path, body } = requestBody(num("opt-seed"), steering);
  $("curl").textContent = curlCommand(path, body);
}

const inspector = new Inspector($("inspector-body"), {
  onSteer: (c) => steeringPanel.add(c),
  steerable: () => !state.causal,
});

const steeringPanel = new SteeringPanel({
  input: $("concept-search"), listbox: $("concept-options"), chips: $("chips"),
  onChange: updateCurl, onError: showError,
});

async function run(ev) {
  ev.preventDefault();
  if (state.controller) state.controller.abort();
  showError(null);
  const controller = new AbortController();
  state.controller = controller;
  $("run").disabled = true;
  $("stop").disabled = false;
  // One seed for both runs, so the only difference between the columns is the steering.
  const seed = num("opt-seed") ?? Math.floor(Math.random() * 2 ** 31);
  const steering = state.causal ? null : steeringPanel.steering(mode(), num("opt-steer-target"));
  const runs = [];
  if (steering) runs.push({ title: `Steered: ${mode()} ${steeringPanel.describe()}`, steering });
  if (!steering || $("compare").checked) runs.push({ title: steering ? "Default (no steering)" : "Output", steering: null });
  const container = $("runs");
  container.replaceChildren();
  container.classList.toggle("two", runs.length === 2);
  const pace = Number($("opt-pace").value);
  const views = runs.map((r) => new RunView(container, {
    title: r.title, causal: state.causal, blockSize: state.blockSize, maxTokens: num("opt-max-tokens") ?? 128, pace,
    onToken: (ta, view) => inspector.showToken(ta, view), onConcept: (c) => inspector.showConcept(c),
  }));
  // narrow window: the output is below the request, bring it into view
  if (matchMedia("(max-width: 900px)").matches) container.scrollIntoView({ block: "start" });
  window.cdeRuns = views;   // for the browser console (and nothing else reads it)
  updateCurl();
  const results = await Promise.allSettled(runs.map(async (r, i) => {
    const view = views[i];
    const { path, body } = requestBody(seed, r.steering);
    view.setState("running");
    try {
      await streamPost(path, body, (obj) => view.push(obj), controller.signal);
      await view.drained();
      view.setState("done");
    } catch (e) {
      if (e.name === "AbortError") view.discard();   // Stop: what was not drawn yet never will be
      await view.drained();
      view.setState(e.name === "AbortError" ? "stopped" : "error");
      throw e;
    }
  }));
  const failed = results.find((r) => r.status === "rejected" && r.reason.name !== "AbortError");
  if (failed) {
    controller.abort();   // one column failed: stop the other rather than leave it half a comparison
    showError(failed.reason);
  }
  if (state.controller === controller) state.controller = null;
  $("run").disabled = false;
  $("stop").disabled = true;
}

function init() {
  const key = $("api-key");
  key.value = apiKey();
  key.addEventListener("change", () => { setApiKey(key.value.trim()); updateCurl(); loadModel(); });
  $("prompt-form").addEventListener("submit", run);
  $("prompt-form").addEventListener("input", updateCurl);
  document.querySelectorAll("input[name=mode]").forEach((r) => r.addEventListener("change", updateCurl));
  for (const t of ["input", "change"]) $("opt-steer-target").addEventListener(t, updateCurl);
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("copy-curl").addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText($("curl").textContent);
      $("copy-status").textContent = "copied";
    } catch {
      const range = document.createRange();
      range.selectNodeContents($("curl"));
      getSelection().removeAllRanges();
      getSelection().addRange(range);
      $("copy-status").textContent = "selected: press Ctrl+C";
    }
  });
  // Ctrl/Cmd+Enter in the prompt generates.
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("prompt-form").requestSubmit();
  });
  loadModel();
}

init();
