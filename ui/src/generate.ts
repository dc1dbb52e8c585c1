// One answer: the request body from a conversation and the settings, then the stream folded
// into an assistant message (content, reasoning, tool calls, usage, timings) as it arrives.

import { ApiError, type Chunk, streamChat } from "./api";
import type { ChatMessage, Conversation, Settings } from "./types";

/** The messages sent for `conv`: the system prompt, then every turn that has something to say
 * (a failed answer with no text is left out; a stopped one is sent as far as it got). */
export function requestMessages(conv: Conversation): Record<string, unknown>[] {
  const out: Record<string, unknown>[] = [];
  if (conv.system.trim()) out.push({ role: "system", content: conv.system });
  for (const m of conv.messages) {
    if (m.role === "assistant" && !m.content && !m.tool_calls?.length) continue;
    const msg: Record<string, unknown> = { role: m.role, content: m.content };
    if (m.tool_calls?.length) msg.tool_calls = m.tool_calls;
    if (m.tool_call_id) msg.tool_call_id = m.tool_call_id;
    if (m.name) msg.name = m.name;
    out.push(msg);
  }
  return out;
}

function number(text: string, integer: boolean): number | undefined {
  if (text.trim() === "") return undefined;
  const n = integer ? parseInt(text, 10) : parseFloat(text);
  return Number.isFinite(n) ? n : undefined;
}

/** Only what the user set is sent: an empty field leaves the server's default. */
export function requestBody(conv: Conversation, s: Settings): Record<string, unknown> {
  const body: Record<string, unknown> = { model: conv.model, messages: requestMessages(conv) };
  const temperature = number(s.temperature, false);
  const topP = number(s.topP, false);
  const maxTokens = number(s.maxTokens, true);
  if (temperature !== undefined) body.temperature = temperature;
  if (topP !== undefined) body.top_p = topP;
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  if (s.thinking) body.chat_template_kwargs = { enable_thinking: s.thinking === "on" };
  if (s.reasoningEffort) body.reasoning_effort = s.reasoningEffort;
  return body;
}

function apply(msg: ChatMessage, chunk: Chunk): boolean {
  let produced = false;
  for (const choice of chunk.choices ?? []) {
    const d = choice.delta ?? {};
    const reasoning = d.reasoning_content ?? d.reasoning;
    if (reasoning) {
      msg.reasoning = (msg.reasoning ?? "") + reasoning;
      produced = true;
    }
    if (d.content) {
      msg.content += d.content;
      produced = true;
    }
    for (const t of d.tool_calls ?? []) {
      msg.tool_calls ??= [];
      const call = (msg.tool_calls[t.index] ??= {
        id: "", type: "function", function: { name: "", arguments: "" },
      });
      if (t.id) call.id = t.id;
      if (t.function?.name) call.function.name += t.function.name;
      if (t.function?.arguments) call.function.arguments += t.function.arguments;
      produced = true;
    }
    if (choice.finish_reason) msg.stats = { ...msg.stats, finishReason: choice.finish_reason };
  }
  if (chunk.usage) {
    msg.stats = {
      ...msg.stats,
      promptTokens: chunk.usage.prompt_tokens,
      completionTokens: chunk.usage.completion_tokens,
      cachedTokens: chunk.usage.prompt_tokens_details?.cached_tokens,
    };
  }
  return produced;
}

/** Streams the answer to `conv` into `msg` (already the conversation's last message), calling
 * `onUpdate` after each chunk. Never throws: an error or a stop is recorded on the message.
 * tokens/s counts the tokens after the first over the time after the first (decode speed). */
export async function generate(
  conv: Conversation,
  msg: ChatMessage,
  settings: Settings,
  signal: AbortSignal,
  onUpdate: () => void,
): Promise<void> {
  const start = performance.now();
  let first: number | undefined;
  let chunks = 0;
  try {
    for await (const chunk of streamChat(requestBody(conv, settings), settings.apiKey, signal)) {
      if (apply(msg, chunk)) {
        first ??= performance.now();
        chunks += 1;
      }
      onUpdate();
    }
  } catch (err) {
    if (signal.aborted) msg.stopped = true;
    else if (err instanceof ApiError) msg.error = err.describe();
    else msg.error = `network error: ${err instanceof Error ? err.message : String(err)}`;
  }
  const end = performance.now();
  const tokens = msg.stats?.completionTokens ?? chunks;
  msg.stats = {
    ...msg.stats,
    model: conv.model,
    elapsedMs: end - start,
    ttftMs: first !== undefined ? first - start : undefined,
    tokensPerS: first !== undefined && tokens > 1 && end > first
      ? ((tokens - 1) * 1000) / (end - first) : undefined,
  };
  onUpdate();
}
