// probity's API as the page uses it: JSON calls, the completions SSE stream, named errors.

const KEY_STORE = "probity.apiKey";

export class ApiError extends Error {
  // The server's named error (status, code, param), or a transport failure (code "network_error").
  constructor(status, code, param, message) {
    super(message);
    this.status = status;
    this.code = code;
    this.param = param;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
}

function headers() {
  const h = { "content-type": "application/json" };
  const key = apiKey();
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

async function send(method, path, body, signal) {
  try {
    return await fetch(path, { method, headers: headers(), body: body === undefined ? undefined : JSON.stringify(body), signal });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, "network_error", null, `could not reach the server: ${e.message}`);
  }
}

async function failure(resp) {
  const text = await resp.text();
  try {
    const e = JSON.parse(text).error;
    return new ApiError(resp.status, e.code || e.type, e.param ?? null, e.message);
  } catch {
    return new ApiError(resp.status, `http_${resp.status}`, null, text.slice(0, 300) || resp.statusText);
  }
}

export async function call(method, path, body) {
  const resp = await send(method, path, body);
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

// POST a streaming request; onChunk gets each parsed `data:` object. Resolves when [DONE]
// arrives; a stream that ends without it (the server ended it after a failure) is an error.
export async function stream(path, body, onChunk, signal) {
  const resp = await send("POST", path, body, signal);
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
  throw new ApiError(resp.status, "stream_ended", null, "the stream ended before it finished; the server log names the reason");
}
