// Builds the chat UI into the Python package (services/gateway/ui_static/), where the gateway
// serves it from; the output is committed so that `pip install` needs no Node.
//
//   npm ci && npm run build      (or: make -C ui)
//
// build.json records a hash of the sources (this file, package*.json, tsconfig.json, src/,
// public/) and of every output file; tests/ui/test_build.py recomputes both, and rebuilds and
// compares when node and ui/node_modules are present.

import { createHash } from "node:crypto";
import { copyFileSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { dirname, join, relative, sep } from "node:path";
import { fileURLToPath } from "node:url";
import * as esbuild from "esbuild";

const here = dirname(fileURLToPath(import.meta.url));
const out = process.argv[2] ?? join(here, "..", "services", "gateway", "ui_static");
const SOURCES = ["build.mjs", "package.json", "package-lock.json", "tsconfig.json", "src", "public"];

function files(path) {
  return statSync(path).isDirectory()
    ? readdirSync(path).sort().flatMap((name) => files(join(path, name)))
    : [path];
}

/** sha256 over "<path>\n<size>\n<bytes>" of each file, paths relative and sorted. */
function treeHash(root, paths) {
  const hash = createHash("sha256");
  const all = paths.flatMap((p) => files(join(root, p)))
    .map((f) => relative(root, f).split(sep).join("/")).sort();
  for (const name of all) {
    const bytes = readFileSync(join(root, name));
    hash.update(`${name}\n${bytes.length}\n`);
    hash.update(bytes);
  }
  return hash.digest("hex");
}

rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
await esbuild.build({
  entryPoints: [join(here, "src", "app.ts"), join(here, "src", "app.css")],
  outdir: out,
  entryNames: "[name]",
  bundle: true,
  minify: true,
  format: "esm",
  target: ["es2022", "chrome111", "firefox113", "safari16.4"],
  legalComments: "eof",
  charset: "utf8",
  logLevel: "warning",
});
for (const name of readdirSync(join(here, "public"))) {
  copyFileSync(join(here, "public", name), join(out, name));
}
const outputs = {};
for (const name of readdirSync(out).sort()) {
  outputs[name] = createHash("sha256").update(readFileSync(join(out, name))).digest("hex");
}
const record = { sources_sha256: treeHash(here, SOURCES), outputs };
writeFileSync(join(out, "build.json"), JSON.stringify(record, null, 2) + "\n");
console.log(`built ${Object.keys(outputs).join(", ")} into ${out}`);
