/**
 * The ClientCapabilities that vscode-languageclient 11 sends in `initialize`, computed by the library itself.
 *
 * The library needs the `vscode` module, which exists only inside VS Code. Building capabilities reads nothing
 * from it except the version check, so a stand-in whose every property is another stand-in is enough to load
 * the client and call its computeClientCapabilities().
 */
'use strict';
const Module = require('module');

function standIn() {
  const target = function () {};
  return new Proxy(target, {
    get(t, prop) {
      if (prop === 'then') {
        return undefined; // not a promise
      }
      if (prop === Symbol.toPrimitive) {
        return () => 0;
      }
      if (!(prop in t)) {
        t[prop] = standIn();
      }
      return t[prop];
    },
    apply: () => standIn(),
    construct: () => standIn(),
  });
}

function languageClientCapabilities() {
  const vscode = standIn();
  vscode.version = '1.99.0'; // satisfies the client's `engines.vscode` check
  const load = Module._load;
  Module._load = function (request, ...rest) {
    return request === 'vscode' ? vscode : load.call(this, request, ...rest);
  };
  try {
    const { LanguageClient } = require('vscode-languageclient/node');
    const client = new LanguageClient('lingls', 'lingls', { command: 'lingls' }, {});
    // A plain object: drop any stand-in that a feature might have put in (functions vanish in JSON).
    return JSON.parse(JSON.stringify(client.computeClientCapabilities()));
  } finally {
    Module._load = load;
  }
}

module.exports = { languageClientCapabilities };
