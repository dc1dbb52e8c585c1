// The settings form <-> Settings: every change is saved at once (localStorage) and reported.

import { byId } from "./dom";
import { saveSettings } from "./store";
import type { Settings } from "./types";

type Field = Exclude<keyof Settings, "model">;

const FIELDS: Record<Field, string> = {
  system: "set-system",
  temperature: "set-temperature",
  topP: "set-top-p",
  maxTokens: "set-max-tokens",
  thinking: "set-thinking",
  reasoningEffort: "set-effort",
  apiKey: "set-api-key",
  theme: "set-theme",
};

export function applyTheme(theme: Settings["theme"]): void {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
}

/** The theme the page shows now (auto follows the system's preference). */
export function effectiveTheme(theme: Settings["theme"]): "light" | "dark" {
  if (theme !== "auto") return theme;
  return matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
}

export function bindSettings(settings: Settings, onChange: (field: Field) => void): void {
  for (const [field, id] of Object.entries(FIELDS) as [Field, string][]) {
    const el = byId<HTMLInputElement | HTMLSelectElement | HTMLTextAreaElement>(id);
    el.value = settings[field];
    el.addEventListener("change", () => {
      (settings as unknown as Record<Field, string>)[field] = el.value;
      saveSettings(settings);
      onChange(field);
    });
  }
}

/** Puts a value set elsewhere (the theme button) into its form field. */
export function showSetting(field: Field, value: string): void {
  byId<HTMLInputElement | HTMLSelectElement>(FIELDS[field]).value = value;
}
