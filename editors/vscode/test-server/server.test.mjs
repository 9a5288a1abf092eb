/**
 * `lingls --stdio` seen from VS Code's side: the same JSON-RPC library and protocol types vscode-languageclient 11
 * uses, the client capabilities it sends, inline completion requests as VS Code makes them, and a request
 * cancelled through a CancellationToken (VS Code cancels the previous request on every keystroke).
 *
 * Run: `node --test test-server/` (or `npm run test:server`) from editors/vscode.
 * Environment: LINGLS_CMD (default `lingls`; a JSON array for a command with arguments, e.g.
 * `["python3", "-m", "lingls.cli"]`); LINGLS_TEST_ENGINE set means the server runs the scripted engine
 * of tests/editors, whose exact text is then checked too; LINGLS_FIRST_ANSWER_MS bounds the first answer (the
 * model loads then).
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
const rpc = require('vscode-jsonrpc/node');
const proto = require('vscode-languageserver-protocol');
const { languageClientCapabilities } = require('./client-capabilities.cjs');

const COMMAND = (process.env.LINGLS_CMD || 'lingls').startsWith('[')
  ? JSON.parse(process.env.LINGLS_CMD)
  : [process.env.LINGLS_CMD || 'lingls'];
const SCRIPTED = Boolean(process.env.LINGLS_TEST_ENGINE);
const FIRST_ANSWER_MS = Number(process.env.LINGLS_FIRST_ANSWER_MS || 180000);

const URI = 'file:///tmp/lingls-node-test/shapes.py';
const TEXT = 'import math\n\n\ndef area(radius):\n    \n\n\ndef label(name):\n    return "🐍 " + name\n';
const SETTINGS = { maxTokens: 24, languages: ['*'] };

let server;
let connection;
let stderr = '';
let version = 1;
let initializeResult;

function position(line, character) {
  return { line, character };
}

function inlineParams(pos, triggerKind) {
  return { textDocument: { uri: URI }, position: pos, context: { triggerKind } };
}

function items(result) {
  if (result === null) {
    return [];
  }
  return Array.isArray(result) ? result : result.items;
}

/** Check what VS Code's converter relies on: text, an optional single-line range around the position, an
 * optional command the server declared. */
function checkAnswer(result, pos) {
  assert.ok(result === null || Array.isArray(result) || Array.isArray(result?.items), `bad answer ${JSON.stringify(result)}`);
  for (const item of items(result)) {
    const text = typeof item.insertText === 'string' ? item.insertText : item.insertText?.value;
    assert.equal(typeof text, 'string', `insertText: ${JSON.stringify(item)}`);
    assert.ok(!/<\|[a-z_]+\|>/.test(text), `special token leaked: ${JSON.stringify(text)}`);
    if (item.range) {
      const { start, end } = item.range;
      assert.equal(start.line, pos.line, 'range starts on the cursor line');
      assert.equal(end.line, pos.line, 'range is single-line');
      assert.ok(start.character <= pos.character && pos.character <= end.character, `range ${JSON.stringify(item.range)} holds the cursor`);
    }
    if (item.command) {
      assert.equal(typeof item.command.title, 'string');
      const declared = initializeResult.capabilities.executeCommandProvider?.commands ?? [];
      assert.ok(declared.includes(item.command.command), `command ${item.command.command} is declared`);
    }
  }
  return items(result);
}

function change(text) {
  version += 1;
  connection.sendNotification(proto.DidChangeTextDocumentNotification.type, {
    textDocument: { uri: URI, version },
    contentChanges: [{ text }],
  });
}

before(async () => {
  server = spawn(COMMAND[0], [...COMMAND.slice(1), '--stdio'], { stdio: ['pipe', 'pipe', 'pipe'] });
  server.stderr.on('data', (d) => (stderr += d));
  connection = rpc.createMessageConnection(
    new rpc.StreamMessageReader(server.stdout),
    new rpc.StreamMessageWriter(server.stdin),
  );
  // What VS Code answers when the server asks.
  connection.onRequest('workspace/configuration', (params) => params.items.map(() => SETTINGS));
  connection.onRequest('client/registerCapability', () => null);
  connection.onRequest('client/unregisterCapability', () => null);
  connection.onRequest('window/workDoneProgress/create', () => null);
  connection.onRequest('window/showMessageRequest', () => null);
  connection.onNotification(() => {});
  connection.listen();
  initializeResult = await connection.sendRequest(proto.InitializeRequest.type, {
    processId: process.pid,
    clientInfo: { name: 'Visual Studio Code', version: '1.99.0' },
    locale: 'en',
    rootUri: 'file:///tmp/lingls-node-test',
    workspaceFolders: [{ uri: 'file:///tmp/lingls-node-test', name: 'lingls-node-test' }],
    capabilities: languageClientCapabilities(),
    initializationOptions: SETTINGS,
  });
  await connection.sendNotification(proto.InitializedNotification.type, {});
  await connection.sendNotification(proto.DidOpenTextDocumentNotification.type, {
    textDocument: { uri: URI, languageId: 'python', version, text: TEXT },
  });
});

after(async () => {
  try {
    await connection.sendRequest(proto.ShutdownRequest.type);
    await connection.sendNotification(proto.ExitNotification.type);
  } finally {
    connection.dispose();
    server.kill();
  }
  if (process.exitCode) {
    console.error(`server stderr:\n${stderr}`);
  }
});

test('initialize advertises inline completion, the accept command and UTF-16', () => {
  const caps = initializeResult.capabilities;
  assert.ok(caps.inlineCompletionProvider, 'inlineCompletionProvider');
  assert.ok(caps.executeCommandProvider.commands.includes('lingls.accept'));
  assert.ok(caps.positionEncoding === undefined || caps.positionEncoding === 'utf-16', 'VS Code only speaks UTF-16');
});

test('an automatic request in a function body answers well-formed items', { timeout: FIRST_ANSWER_MS }, async () => {
  const pos = position(4, 4);
  const result = await connection.sendRequest(proto.InlineCompletionRequest.type, inlineParams(pos, 2));
  const got = checkAnswer(result, pos);
  if (SCRIPTED) {
    assert.ok(got.length >= 1, 'the scripted engine always has a suggestion');
    assert.ok(got[0].insertText.startsWith('total = combine(alpha, beta)'), JSON.stringify(got[0]));
  }
});

test('an invoked request answers, with extra candidates where the model has them', { timeout: 60000 }, async () => {
  const pos = position(4, 4);
  const got = checkAnswer(await connection.sendRequest(proto.InlineCompletionRequest.type, inlineParams(pos, 1)), pos);
  if (SCRIPTED) {
    const texts = new Set(got.map((i) => i.insertText));
    assert.ok(texts.size >= 2, `several distinct candidates: ${JSON.stringify([...texts])}`);
  }
});

test('the accept command of an item runs', { timeout: 60000 }, async () => {
  const pos = position(4, 4);
  const got = checkAnswer(await connection.sendRequest(proto.InlineCompletionRequest.type, inlineParams(pos, 2)), pos);
  const command = got.find((i) => i.command)?.command;
  if (command) {
    await connection.sendRequest(proto.ExecuteCommandRequest.type, {
      command: command.command,
      arguments: command.arguments,
    });
  } else {
    assert.ok(!SCRIPTED, 'the scripted engine answers with an item carrying the accept command');
  }
});

test('positions after an emoji are UTF-16 code units', { timeout: 60000 }, async () => {
  // `    return "🐍 " + name`: the snake is two UTF-16 units; ask at the end of the line.
  const line = '    return "🐍 " + name';
  const pos = position(8, line.length);
  checkAnswer(await connection.sendRequest(proto.InlineCompletionRequest.type, inlineParams(pos, 2)), pos);
});

test('a request cancelled through its CancellationToken answers -32800', { timeout: 60000 }, async () => {
  // A long server-side debounce keeps the request waiting, so the cancel always arrives first; a fresh line
  // makes sure no earlier generation can answer it at once.
  await connection.sendNotification(proto.DidChangeConfigurationNotification.type, {
    settings: { ...SETTINGS, debounceMs: 5000 },
  });
  change(TEXT + '\nradius = math.\n');
  const pos = position(10, 'radius = math.'.length);
  const source = new rpc.CancellationTokenSource();
  const pending = connection.sendRequest(proto.InlineCompletionRequest.type, inlineParams(pos, 2), source.token);
  setTimeout(() => source.cancel(), 100);
  await assert.rejects(pending, (err) => {
    assert.ok(err instanceof rpc.ResponseError, String(err));
    assert.equal(err.code, proto.LSPErrorCodes.RequestCancelled);
    return true;
  });
  await connection.sendNotification(proto.DidChangeConfigurationNotification.type, { settings: SETTINGS });
});
