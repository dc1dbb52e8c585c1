// Conversations live in the browser's IndexedDB (database "flotilla-ui", one record per
// conversation); settings in localStorage. Nothing is sent anywhere but the gateway's API.

import type { Conversation, Settings } from "./types";

const DB_NAME = "flotilla-ui";
const STORE = "conversations";
const SETTINGS_KEY = "flotilla-ui-settings";

let dbPromise: Promise<IDBDatabase> | null = null;

function db(): Promise<IDBDatabase> {
  dbPromise ??= new Promise((resolve, reject) => {
    const open = indexedDB.open(DB_NAME, 1);
    open.onupgradeneeded = () => open.result.createObjectStore(STORE, { keyPath: "id" });
    open.onsuccess = () => resolve(open.result);
    open.onerror = () => reject(open.error);
  });
  return dbPromise;
}

async function run<T>(mode: IDBTransactionMode, op: (s: IDBObjectStore) => IDBRequest<T>): Promise<T> {
  const store = (await db()).transaction(STORE, mode).objectStore(STORE);
  return new Promise((resolve, reject) => {
    const req = op(store);
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

/** Every conversation, the most recently updated first. */
export async function loadConversations(): Promise<Conversation[]> {
  const all = await run<Conversation[]>("readonly", (s) => s.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

export async function saveConversation(conv: Conversation): Promise<void> {
  // A structured clone of plain data: drop anything the view may have attached.
  await run("readwrite", (s) => s.put(JSON.parse(JSON.stringify(conv)) as Conversation));
}

export async function deleteConversation(id: string): Promise<void> {
  await run("readwrite", (s) => s.delete(id));
}

export const DEFAULT_SETTINGS: Settings = {
  model: "", system: "", temperature: "", topP: "", maxTokens: "", thinking: "",
  reasoningEffort: "", apiKey: "", theme: "auto",
};

export function loadSettings(): Settings {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) ?? "{}") as Partial<Settings>;
    return { ...DEFAULT_SETTINGS, ...saved };
  } catch {
    return { ...DEFAULT_SETTINGS };
  }
}

export function saveSettings(settings: Settings): void {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}
