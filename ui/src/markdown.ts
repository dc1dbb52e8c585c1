// Model output is untrusted. It is rendered as Markdown (marked) with raw HTML shown as text,
// then the HTML passes through DOMPurify all the same (a link's `javascript:` URL, attributes
// marked would emit). Links open in a new tab without an opener or referrer; images load only
// from data: URLs (any other becomes a link, so an answer cannot make the browser fetch).
// Code blocks are highlighted (highlight.js core, a few languages) and get a copy button.

import DOMPurify from "dompurify";
import hljs from "highlight.js/lib/core";
import bash from "highlight.js/lib/languages/bash";
import c from "highlight.js/lib/languages/c";
import cpp from "highlight.js/lib/languages/cpp";
import css from "highlight.js/lib/languages/css";
import diff from "highlight.js/lib/languages/diff";
import go from "highlight.js/lib/languages/go";
import java from "highlight.js/lib/languages/java";
import javascript from "highlight.js/lib/languages/javascript";
import json from "highlight.js/lib/languages/json";
import markdown from "highlight.js/lib/languages/markdown";
import python from "highlight.js/lib/languages/python";
import rust from "highlight.js/lib/languages/rust";
import sql from "highlight.js/lib/languages/sql";
import typescript from "highlight.js/lib/languages/typescript";
import xml from "highlight.js/lib/languages/xml";
import yaml from "highlight.js/lib/languages/yaml";
import { Marked, type Tokens } from "marked";

const LANGUAGES = {
  bash, c, cpp, css, diff, go, java, javascript, json, markdown, python, rust, sql,
  typescript, xml, yaml,
};
for (const [name, lang] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, lang);

function escapeHtml(text: string): string {
  return text.replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);
}

const marked = new Marked({
  gfm: true,
  renderer: {
    html({ text }: Tokens.HTML | Tokens.Tag): string {
      return escapeHtml(text);
    },
    code({ text, lang }: Tokens.Code): string {
      const name = (lang ?? "").trim().split(/\s+/)[0].toLowerCase();
      const known = name !== "" && hljs.getLanguage(name) !== undefined;
      const body = known
        ? hljs.highlight(text, { language: name, ignoreIllegals: true }).value
        : escapeHtml(text);
      const label = name ? ` data-lang="${escapeHtml(name)}"` : "";
      return `<pre${label}><code class="hljs${known ? ` language-${name}` : ""}">${body}</code></pre>`;
    },
  },
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node instanceof HTMLAnchorElement && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

const PURIFY = {
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "iframe"],
  FORBID_ATTR: ["style"],
  RETURN_DOM_FRAGMENT: true as const,
};

function inertImages(root: DocumentFragment): void {
  for (const img of Array.from(root.querySelectorAll("img"))) {
    const src = img.getAttribute("src") ?? "";
    if (/^data:image\//i.test(src)) continue;
    const link = document.createElement("a");
    link.textContent = img.getAttribute("alt") || src || "image";
    if (src) {
      link.setAttribute("href", src);
      link.setAttribute("target", "_blank");
      link.setAttribute("rel", "noopener noreferrer");
    }
    img.replaceWith(link);
  }
  // A sanitised href that is not http(s), mailto or a fragment (DOMPurify keeps e.g. `ftp:`)
  // is dropped too: the link stays as text.
  for (const a of Array.from(root.querySelectorAll("a[href]"))) {
    if (!/^(https?:|mailto:|#)/i.test(a.getAttribute("href") ?? "")) a.removeAttribute("href");
  }
}

function addCopyButtons(root: DocumentFragment): void {
  for (const pre of Array.from(root.querySelectorAll("pre"))) {
    const bar = document.createElement("div");
    bar.className = "code-bar";
    const lang = document.createElement("span");
    lang.textContent = pre.dataset.lang ?? "";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy-code";
    copy.textContent = "Copy";
    bar.append(lang, copy);
    const wrap = document.createElement("div");
    wrap.className = "code-block";
    pre.replaceWith(wrap);
    wrap.append(bar, pre);
  }
}

/** Replaces `el`'s children with `text` rendered as sanitised Markdown. */
export function renderMarkdown(el: HTMLElement, text: string): void {
  const html = marked.parse(text, { async: false });
  const fragment = DOMPurify.sanitize(html, PURIFY);
  inertImages(fragment);
  addCopyButtons(fragment);
  el.replaceChildren(fragment);
}

/** Copies text to the clipboard; falls back to a hidden textarea where the Clipboard API is
 * missing (plain http on a non-loopback address is not a secure context). */
export async function copyText(text: string): Promise<void> {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}
