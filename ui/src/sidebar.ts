// The conversation list: select, rename (inline), delete (a second click confirms), export.

import { h } from "./dom";
import { download } from "./exporters";
import type { Conversation } from "./types";

export interface SidebarActions {
  select(id: string): void;
  rename(id: string, title: string): void;
  remove(id: string): void;
}

export class Sidebar {
  private conversations: Conversation[] = [];
  private current: string | null = null;

  constructor(private list: HTMLElement, private actions: SidebarActions) {
    list.addEventListener("click", (e) => this.onClick(e));
  }

  show(conversations: Conversation[], current: string | null): void {
    this.conversations = conversations;
    this.current = current;
    this.list.replaceChildren(...conversations.map((c) => this.item(c)));
  }

  private item(c: Conversation): HTMLElement {
    const active = c.id === this.current;
    const li = h("li", { class: active ? "conv active" : "conv", "data-id": c.id },
      h("button", { type: "button", class: "conv-title", "data-act": "select", title: c.title },
        c.title));
    if (active) {
      const act = (name: string, text: string, label: string) =>
        h("button", { type: "button", class: "link", "data-act": name, "aria-label": label }, text);
      li.append(h("div", { class: "conv-actions" },
        act("rename", "Rename", "Rename conversation"),
        act("json", "JSON", "Export as JSON"),
        act("md", "Markdown", "Export as Markdown"),
        act("delete", "Delete", "Delete conversation")));
    }
    return li;
  }

  private onClick(e: Event): void {
    const button = (e.target as HTMLElement).closest<HTMLButtonElement>("[data-act]");
    const li = button?.closest<HTMLElement>("li");
    const conv = this.conversations.find((c) => c.id === li?.dataset.id);
    if (!button || !li || !conv) return;
    switch (button.dataset.act) {
      case "select": this.actions.select(conv.id); break;
      case "rename": this.startRename(li, conv); break;
      case "json": download(conv, "json"); break;
      case "md": download(conv, "md"); break;
      case "delete":
        if (button.dataset.armed) this.actions.remove(conv.id);
        else {
          button.dataset.armed = "1";
          button.textContent = "Delete?";
          setTimeout(() => {
            delete button.dataset.armed;
            button.textContent = "Delete";
          }, 3000);
        }
        break;
    }
  }

  private startRename(li: HTMLElement, conv: Conversation): void {
    const input = h("input", { type: "text", class: "rename", "aria-label": "New title" });
    input.value = conv.title;
    li.querySelector(".conv-title")!.replaceWith(input);
    let finished = false;
    const finish = (save: boolean) => {
      if (finished) return;
      finished = true;
      if (save && input.value.trim()) this.actions.rename(conv.id, input.value.trim());
      else this.show(this.conversations, this.current);
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") finish(true);
      else if (e.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
    input.focus();
    input.select();
  }
}
