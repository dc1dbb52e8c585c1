// A conversation as a file: JSON (the record itself, OpenAI-shaped messages) or Markdown.

import type { Conversation } from "./types";

export function toJson(conv: Conversation): string {
  return JSON.stringify(conv, null, 2) + "\n";
}

export function toMarkdown(conv: Conversation): string {
  const out = [`# ${conv.title}`, "", `Model: ${conv.model || "(none)"}`, ""];
  if (conv.system) out.push("## System", "", conv.system, "");
  for (const m of conv.messages) {
    out.push(`## ${m.role[0].toUpperCase()}${m.role.slice(1)}`, "");
    if (m.reasoning) out.push(...m.reasoning.split("\n").map((l) => `> ${l}`), "");
    if (m.content) out.push(m.content, "");
    for (const call of m.tool_calls ?? []) {
      out.push(`Tool call \`${call.function.name}\`:`, "", "```json", call.function.arguments, "```", "");
    }
    if (m.error) out.push(`**Error:** ${m.error}`, "");
  }
  return out.join("\n");
}

function fileName(conv: Conversation, ext: string): string {
  const base = conv.title.replace(/[^\p{L}\p{N}_-]+/gu, "-").replace(/^-+|-+$/g, "").slice(0, 60);
  return `${base || "conversation"}.${ext}`;
}

export function download(conv: Conversation, kind: "json" | "md"): void {
  const text = kind === "json" ? toJson(conv) : toMarkdown(conv);
  const type = kind === "json" ? "application/json" : "text/markdown";
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement("a");
  a.href = url;
  a.download = fileName(conv, kind);
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}
