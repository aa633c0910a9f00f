// The REST API as the page uses it: JSON GETs, POSTs answered with SSE, API errors kept verbatim.

const KEY_STORE = "cde.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

/** An error as the API sent it: HTTP status plus the OpenAI-style {error: {message, type, param, code}}. */
export class ApiError extends Error {
  constructor(status, error) {
    super(error && error.message ? error.message : `HTTP ${status}`);
    this.status = status;
    this.error = error || {};
  }
}

async function errorOf(resp) {
  let body = null;
  try { body = await resp.json(); } catch { /* not JSON: keep the status */ }
  return new ApiError(resp.status, body && body.error ? body.error : { message: `HTTP ${resp.status} ${resp.statusText}` });
}

export async function getJson(path, signal) {
  const resp = await fetch(path, { headers: headers(false), signal });
  if (!resp.ok) throw await errorOf(resp);
  return resp.json();
}

/**
 * POST `body` to `path` and call onEvent(obj) for every SSE `data:` JSON until [DONE].
 * An error before the stream starts (400, 404, 429...) or inside it (in-band `{error}`) throws ApiError.
 */
export async function streamPost(path, body, onEvent, signal) {
  const resp = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!resp.ok) throw await errorOf(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new ApiError(resp.status, obj.error);
        await onEvent(obj);
      }
    }
  }
}

/** The request as a shell command; the key itself never appears (it stays in this tab). */
export function curlCommand(path, body) {
  const json = JSON.stringify(body, null, 1).replace(/\n\s*/g, " ");
  const quoted = "'" + json.replace(/'/g, "'\\''") + "'";
  const lines = [`curl -N --fail-with-body ${location.origin}${path}`, "-H 'Content-Type: application/json'"];
  if (apiKey()) lines.push('-H "Authorization: Bearer $CDE_API_KEY"');
  lines.push("-d " + quoted);
  return lines.join(" \\\n  ");
}
