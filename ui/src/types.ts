// The shapes the UI keeps: a conversation is a list of OpenAI chat messages plus what the UI
// learned while streaming each answer (reasoning, timings, errors).

export type Role = "system" | "user" | "assistant" | "tool";

export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/** Measured by the browser for one answer; token counts come from the usage chunk. */
export interface Stats {
  model?: string;
  ttftMs?: number;
  elapsedMs?: number;
  tokensPerS?: number;
  promptTokens?: number;
  completionTokens?: number;
  cachedTokens?: number;
  finishReason?: string;
}

export interface ChatMessage {
  role: Role;
  content: string;
  reasoning?: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
  name?: string;
  stats?: Stats;
  error?: string;
  stopped?: boolean;
}

export interface Conversation {
  id: string;
  title: string;
  created: number;
  updated: number;
  model: string;
  system: string;
  messages: ChatMessage[];
}

/** Sampling and connection settings, remembered in localStorage. Empty = the server default. */
export interface Settings {
  model: string;
  system: string;
  temperature: string;
  topP: string;
  maxTokens: string;
  thinking: "" | "on" | "off";
  reasoningEffort: "" | "low" | "medium" | "high";
  apiKey: string;
  theme: "auto" | "light" | "dark";
}
