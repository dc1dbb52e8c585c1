// The message list: each message an <article> whose parts (reasoning, body, tool calls, error,
// numbers, actions) are updated in place while it streams, so a reasoning block the user opened
// stays open. Clicks are handled once, on the list (no inline handlers: the CSP forbids them).

import { h } from "./dom";
import { copyText, renderMarkdown } from "./markdown";
import type { ChatMessage, Conversation, Stats } from "./types";

export interface MessageActions {
  regenerate(): void;
  editAndResend(index: number, text: string): void;
}

function statsLine(s: Stats | undefined, stopped: boolean | undefined): string {
  if (!s) return "";
  const parts: string[] = [];
  if (s.ttftMs !== undefined) parts.push(`TTFT ${Math.round(s.ttftMs)} ms`);
  if (s.tokensPerS !== undefined) parts.push(`${s.tokensPerS.toFixed(1)} tok/s`);
  if (s.promptTokens !== undefined) parts.push(`${s.promptTokens} prompt`);
  if (s.completionTokens !== undefined) parts.push(`${s.completionTokens} completion tokens`);
  if (s.cachedTokens) parts.push(`${s.cachedTokens} cached`);
  if (stopped) parts.push("stopped");
  else if (s.finishReason) parts.push(`finish: ${s.finishReason}`);
  return parts.join(" · ");
}

function part<K extends keyof HTMLElementTagNameMap>(
  article: HTMLElement, tag: K, cls: string, before: string | null = null,
): HTMLElementTagNameMap[K] {
  let el = article.querySelector<HTMLElementTagNameMap[K]>(`:scope > .${cls}`);
  if (!el) {
    el = h(tag, { class: cls });
    const anchor = before ? article.querySelector(`:scope > .${before}`) : null;
    article.insertBefore(el, anchor);
  }
  return el;
}

export class MessageList {
  private conv: Conversation | null = null;
  private streaming = -1;
  private pending = new Set<number>();

  constructor(private root: HTMLElement, private actions: MessageActions) {
    root.addEventListener("click", (e) => void this.onClick(e));
  }

  /** Rebuilds the whole list; `streaming` is the index of the answer being generated (-1: none). */
  show(conv: Conversation | null, streaming = -1): void {
    this.conv = conv;
    this.streaming = streaming;
    this.pending.clear();
    const open = new Set(Array.from(this.root.querySelectorAll("article:has(> details.reasoning[open])"))
      .map((a) => (a as HTMLElement).dataset.index));
    const items = (conv?.messages ?? []).map((m, i) => this.article(m, i));
    if (!items.length) {
      items.push(h("div", { class: "empty" }, h("p", {}, "Ask anything."),
        h("p", { class: "hint" }, "Enter sends · Shift+Enter new line · Esc stops")));
    }
    this.root.replaceChildren(...items);
    for (const index of open) {
      this.root.querySelector(`article[data-index="${index}"] > details.reasoning`)
        ?.setAttribute("open", "");
    }
    this.root.scrollTop = this.root.scrollHeight;
  }

  /** Re-renders message `index` at the next frame (many chunks arrive per frame). */
  update(index: number, done = false): void {
    if (done) this.streaming = -1;
    if (this.pending.has(index)) return;
    this.pending.add(index);
    requestAnimationFrame(() => {
      if (!this.pending.delete(index)) return;
      const article = this.root.querySelector<HTMLElement>(`article[data-index="${index}"]`);
      const msg = this.conv?.messages[index];
      if (!article || !msg) return;
      const near = this.root.scrollHeight - this.root.scrollTop - this.root.clientHeight < 120;
      this.fill(article, msg, index);
      if (near) this.root.scrollTop = this.root.scrollHeight;
    });
  }

  private article(msg: ChatMessage, index: number): HTMLElement {
    const label = msg.role === "tool" ? `Tool result${msg.name ? ` · ${msg.name}` : ""}`
      : msg.role === "assistant" && msg.stats?.model ? `Assistant · ${msg.stats.model}`
        : msg.role[0].toUpperCase() + msg.role.slice(1);
    const article = h("article", { class: `msg ${msg.role}`, "data-index": String(index) },
      h("div", { class: "msg-role" }, label));
    this.fill(article, msg, index);
    return article;
  }

  private fill(article: HTMLElement, msg: ChatMessage, index: number): void {
    const streaming = index === this.streaming;
    article.classList.toggle("streaming", streaming);
    if (msg.reasoning) {
      const details = part(article, "details", "reasoning", "msg-body");
      if (!details.firstChild) details.append(h("summary", {}), h("div", { class: "md" }));
      details.querySelector("summary")!.textContent =
        streaming && !msg.content ? "Thinking…" : "Reasoning";
      renderMarkdown(details.querySelector<HTMLElement>(".md")!, msg.reasoning);
    }
    const body = part(article, "div", "msg-body");
    if (msg.role === "assistant") {
      body.classList.add("md");
      renderMarkdown(body, msg.content);
    } else if (msg.role === "tool") {
      body.replaceChildren(h("pre", {}, msg.content));
    } else {
      body.textContent = msg.content;
    }
    if (msg.tool_calls?.length) {
      part(article, "div", "tool-calls").replaceChildren(...msg.tool_calls.map((c) =>
        h("details", { class: "tool-call", open: true },
          h("summary", {}, `Tool call: ${c.function.name}`),
          h("pre", {}, c.function.arguments))));
    }
    if (msg.error) part(article, "div", "msg-error").textContent = msg.error;
    const line = statsLine(msg.stats, msg.stopped);
    if (line && !streaming) part(article, "div", "msg-meta").textContent = line;
    if (!streaming && this.streaming < 0) this.addActions(article, msg, index);
  }

  private addActions(article: HTMLElement, msg: ChatMessage, index: number): void {
    const buttons: HTMLElement[] = [];
    const button = (action: string, text: string) =>
      h("button", { type: "button", class: "link", "data-action": action }, text);
    if (msg.content) buttons.push(button("copy", "Copy"));
    if (msg.role === "user") buttons.push(button("edit", "Edit"));
    const last = this.conv !== null && index === this.conv.messages.length - 1;
    if (msg.role === "assistant" && last) buttons.push(button("regenerate", "Regenerate"));
    part(article, "div", "msg-actions").replaceChildren(...buttons);
  }

  private async onClick(e: Event): Promise<void> {
    const target = e.target as HTMLElement;
    const copyCode = target.closest<HTMLButtonElement>(".copy-code");
    if (copyCode) {
      const code = copyCode.closest(".code-block")?.querySelector("code")?.textContent ?? "";
      await this.flash(copyCode, copyText(code));
      return;
    }
    const button = target.closest<HTMLButtonElement>("[data-action]");
    const article = button?.closest<HTMLElement>("article");
    if (!button || !article || !this.conv) return;
    const index = Number(article.dataset.index);
    const msg = this.conv.messages[index];
    if (button.dataset.action === "copy") await this.flash(button, copyText(msg.content));
    else if (button.dataset.action === "regenerate") this.actions.regenerate();
    else if (button.dataset.action === "edit") this.startEdit(article, msg, index);
  }

  private async flash(button: HTMLElement, done: Promise<void>): Promise<void> {
    const label = button.textContent;
    try {
      await done;
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => (button.textContent = label), 1200);
  }

  private startEdit(article: HTMLElement, msg: ChatMessage, index: number): void {
    const area = h("textarea", { class: "edit-area", rows: "3" });
    area.value = msg.content;
    const send = h("button", { type: "button", class: "primary" }, "Send");
    const cancel = h("button", { type: "button" }, "Cancel");
    const form = h("div", { class: "msg-edit" }, area, h("div", { class: "row" }, send, cancel));
    const body = article.querySelector(".msg-body")!;
    body.replaceWith(form);
    article.querySelector(".msg-actions")?.replaceChildren();
    send.addEventListener("click", () => this.actions.editAndResend(index, area.value));
    cancel.addEventListener("click", () => this.show(this.conv, this.streaming));
    area.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.actions.editAndResend(index, area.value);
      } else if (e.key === "Escape") {
        this.show(this.conv, this.streaming);
      }
    });
    area.focus();
  }
}
