// The chat page: wires the model picker, the composer, the message list, the conversation list
// and the settings panel to one App. Generation state: `abort` is set while an answer streams.

import { ApiError, listModels } from "./api";
import { byId, h } from "./dom";
import { generate } from "./generate";
import { MessageList } from "./messages";
import { applyTheme, bindSettings, effectiveTheme, showSetting } from "./settings-panel";
import { Sidebar } from "./sidebar";
import {
  deleteConversation, loadConversations, loadSettings, saveConversation, saveSettings,
} from "./store";
import type { ChatMessage, Conversation } from "./types";

const TITLE_CHARS = 48;

class App {
  private settings = loadSettings();
  private conversations: Conversation[] = [];
  private current: Conversation | null = null;
  private abort: AbortController | null = null;
  private readonly app = byId("app");
  private readonly input = byId<HTMLTextAreaElement>("input");
  private readonly model = byId<HTMLSelectElement>("model");
  private readonly notice = byId("notice");
  private readonly messages = new MessageList(byId("messages"), {
    regenerate: () => void this.regenerate(),
    editAndResend: (i, text) => void this.editAndResend(i, text),
  });
  private readonly sidebar = new Sidebar(byId("conversations"), {
    select: (id) => this.select(id),
    rename: (id, title) => void this.rename(id, title),
    remove: (id) => void this.remove(id),
  });

  async start(): Promise<void> {
    applyTheme(this.settings.theme);
    bindSettings(this.settings, (field) => {
      if (field === "theme") applyTheme(this.settings.theme);
      if (field === "apiKey") void this.loadModels();
    });
    this.bindControls();
    this.conversations = await loadConversations();
    this.select(this.conversations[0]?.id ?? null);
    await this.loadModels();
    this.input.focus();
  }

  private bindControls(): void {
    byId("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      void this.send();
    });
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        void this.send();
      }
    });
    this.input.addEventListener("input", () => this.fitInput());
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && this.abort) this.stop();
    });
    byId("stop").addEventListener("click", () => this.stop());
    byId("new-chat").addEventListener("click", () => this.select(null));
    this.model.addEventListener("change", () => {
      this.settings.model = this.model.value;
      saveSettings(this.settings);
    });
    byId("refresh-models").addEventListener("click", () => void this.loadModels());
    byId("theme").addEventListener("click", () => {
      this.settings.theme = effectiveTheme(this.settings.theme) === "dark" ? "light" : "dark";
      saveSettings(this.settings);
      applyTheme(this.settings.theme);
      showSetting("theme", this.settings.theme);
    });
    const panel = byId("settings");
    byId("open-settings").addEventListener("click", () => (panel.hidden = !panel.hidden));
    byId("close-settings").addEventListener("click", () => (panel.hidden = true));
    byId("open-sidebar").addEventListener("click", () => this.app.classList.add("sidebar-open"));
    const closeSidebar = () => this.app.classList.remove("sidebar-open");
    byId("close-sidebar").addEventListener("click", closeSidebar);
    byId("scrim").addEventListener("click", closeSidebar);
  }

  private fitInput(): void {
    this.input.style.height = "auto";
    this.input.style.height = `${Math.min(this.input.scrollHeight, 240)}px`;
  }

  private say(text: string): void {
    this.notice.textContent = text;
    this.notice.hidden = !text;
  }

  async loadModels(): Promise<void> {
    try {
      const ids = await listModels(this.settings.apiKey);
      this.model.replaceChildren(...ids.map((id) => h("option", { value: id }, id)));
      const wanted = this.current?.model || this.settings.model;
      if (ids.includes(wanted)) this.model.value = wanted;
      this.say(ids.length ? "" : "No model is being served yet.");
    } catch (err) {
      const text = err instanceof ApiError ? err.describe() : String(err);
      this.say(`Could not list models: ${text}`);
    }
  }

  private showList(): void {
    this.sidebar.show(this.conversations, this.current?.id ?? null);
  }

  select(id: string | null): void {
    if (this.abort) return;  // one answer at a time; stop it first
    this.current = this.conversations.find((c) => c.id === id) ?? null;
    if (this.current?.model && Array.from(this.model.options).some((o) => o.value === this.current?.model)) {
      this.model.value = this.current.model;
    }
    this.messages.show(this.current);
    this.showList();
    this.app.classList.remove("sidebar-open");
  }

  private async rename(id: string, title: string): Promise<void> {
    const conv = this.conversations.find((c) => c.id === id);
    if (!conv) return;
    conv.title = title;
    await saveConversation(conv);
    this.showList();
  }

  private async remove(id: string): Promise<void> {
    if (this.abort && this.current?.id === id) this.stop();
    await deleteConversation(id);
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.current?.id === id) this.select(null);
    else this.showList();
  }

  private async send(): Promise<void> {
    const text = this.input.value;
    if (this.abort || !text.trim()) return;
    if (!this.model.value) {
      this.say("Pick a model first (none is listed: is the gateway serving one?).");
      return;
    }
    this.input.value = "";
    this.fitInput();
    let conv = this.current;
    if (!conv) {
      const now = Date.now();
      conv = { id: crypto.randomUUID(), title: text.trim().slice(0, TITLE_CHARS), created: now,
        updated: now, model: this.model.value, system: "", messages: [] };
      this.conversations.unshift(conv);
      this.current = conv;
    }
    conv.messages.push({ role: "user", content: text });
    await this.answer(conv);
  }

  private async regenerate(): Promise<void> {
    const conv = this.current;
    if (!conv || this.abort) return;
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role !== "user") {
      conv.messages.pop();
    }
    if (conv.messages.length) await this.answer(conv);
  }

  private async editAndResend(index: number, text: string): Promise<void> {
    const conv = this.current;
    if (!conv || this.abort || !text.trim()) return;
    conv.messages = conv.messages.slice(0, index);
    conv.messages.push({ role: "user", content: text });
    await this.answer(conv);
  }

  /** Streams a new assistant message onto `conv`; saves before and after. */
  private async answer(conv: Conversation): Promise<void> {
    conv.model = this.model.value || conv.model;
    conv.system = this.settings.system;
    const msg: ChatMessage = { role: "assistant", content: "" };
    conv.messages.push(msg);
    const index = conv.messages.length - 1;
    conv.updated = Date.now();
    this.conversations.sort((a, b) => b.updated - a.updated);
    this.abort = new AbortController();
    this.setGenerating(true);
    this.messages.show(conv, index);
    this.showList();
    await saveConversation(conv);
    await generate(conv, msg, this.settings, this.abort.signal, () => this.messages.update(index));
    this.abort = null;
    this.setGenerating(false);
    conv.updated = Date.now();
    if (this.conversations.includes(conv)) await saveConversation(conv);  // not if deleted
    if (this.current === conv) this.messages.show(conv);
  }

  private stop(): void {
    this.abort?.abort();
  }

  private setGenerating(on: boolean): void {
    byId("send").hidden = on;
    byId("stop").hidden = !on;
    this.app.classList.toggle("generating", on);
  }
}

void new App().start().catch((err: unknown) => {
  const notice = document.getElementById("notice");
  if (notice) {
    notice.textContent = `The chat UI failed to start: ${String(err)}`;
    notice.hidden = false;
  }
});
