// The gateway's OpenAI API as the UI uses it: the model list and a streamed chat completion.
// Errors arrive as OpenAI's envelope {"error": {message, type, param, code}}, before the stream
// (an HTTP status) or inside it (one data event); both become an ApiError.

import { sseData } from "./sse";

export class ApiError extends Error {
  constructor(
    message: string,
    readonly status?: number,
    readonly type?: string,
    readonly code?: string | null,
    readonly param?: string | null,
  ) {
    super(message);
  }

  /** One plain line: "400 invalid_request_error (param temperature): message". */
  describe(): string {
    const head = [this.status, this.type].filter((x) => x !== undefined && x !== "").join(" ");
    const param = this.param ? ` (param ${this.param})` : "";
    return `${head}${param}${head || param ? ": " : ""}${this.message}`;
  }
}

interface Envelope {
  error?: { message?: string; type?: string; code?: string | null; param?: string | null };
}

function fromEnvelope(body: Envelope, status?: number): ApiError | null {
  const e = body.error;
  if (!e || typeof e !== "object") return null;
  return new ApiError(String(e.message ?? "unknown error"), status, e.type, e.code, e.param);
}

function headers(apiKey: string): Record<string, string> {
  const h: Record<string, string> = { "Content-Type": "application/json" };
  if (apiKey) h["Authorization"] = `Bearer ${apiKey}`;
  return h;
}

async function errorOf(res: Response): Promise<ApiError> {
  const text = await res.text();
  try {
    const err = fromEnvelope(JSON.parse(text) as Envelope, res.status);
    if (err) return err;
  } catch {
    // not JSON: fall through to the raw text
  }
  return new ApiError(text.trim() || res.statusText || "request failed", res.status);
}

export async function listModels(apiKey: string): Promise<string[]> {
  const res = await fetch("v1/models", { headers: headers(apiKey) });
  if (!res.ok) throw await errorOf(res);
  const body = (await res.json()) as { data?: { id: string }[] };
  return (body.data ?? []).map((m) => m.id);
}

export interface ChunkDelta {
  content?: string | null;
  reasoning_content?: string | null;
  reasoning?: string | null;
  tool_calls?: {
    index: number;
    id?: string;
    type?: string;
    function?: { name?: string; arguments?: string };
  }[];
}

export interface Chunk {
  model?: string;
  choices?: { index: number; delta?: ChunkDelta; finish_reason?: string | null }[];
  usage?: {
    prompt_tokens?: number;
    completion_tokens?: number;
    prompt_tokens_details?: { cached_tokens?: number } | null;
  } | null;
}

/** POSTs a streamed chat completion and yields its chunks; aborting `signal` closes the
 * connection, which makes the gateway cancel the generation. */
export async function* streamChat(
  body: Record<string, unknown>,
  apiKey: string,
  signal: AbortSignal,
): AsyncGenerator<Chunk> {
  const res = await fetch("v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!res.ok) throw await errorOf(res);
  if (!res.body) throw new ApiError("the response has no body", res.status);
  for await (const data of sseData(res.body)) {
    if (data === "[DONE]") return;
    const parsed = JSON.parse(data) as Chunk & Envelope;
    const err = fromEnvelope(parsed);
    if (err) throw err;
    yield parsed;
  }
}
