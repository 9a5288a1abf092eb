/**
 * lingls for VS Code: starts `lingls --stdio` through vscode-languageclient 11, whose built-in inline completion
 * feature turns the server's `textDocument/inlineCompletion` answers into ghost text. This file only wires the
 * client, the settings and the status bar together; the language server does the work.
 */
import * as vscode from 'vscode';
import {
  CancellationToken,
  HandleWorkDoneProgressSignature,
  LanguageClient,
  LanguageClientOptions,
  ProgressToken,
  ServerOptions,
  State as ClientState,
  TransportKind,
  WorkDoneProgressBegin,
  WorkDoneProgressEnd,
  WorkDoneProgressReport,
} from 'vscode-languageclient/node';
import { findExecutable } from './executable';
import { loadingStep } from './loading';
import { ExtensionSettings, isEnabledFor, readSettings, serverSettings, toggleAll } from './settings';
import { StatusItem } from './status';

let client: LanguageClient | undefined;
let settings: ExtensionSettings;
let status: StatusItem;
let output: vscode.LogOutputChannel;
/** Set while the extension itself stops the client, so that the stop is not reported as a crash. */
let stopping = false;

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  output = vscode.window.createOutputChannel('lingls', { log: true });
  status = new StatusItem('lingls.toggle');
  settings = readSettings();
  context.subscriptions.push(
    output,
    status,
    vscode.commands.registerCommand('lingls.toggle', toggleAll),
    vscode.commands.registerCommand('lingls.restart', restart),
    vscode.commands.registerCommand('lingls.showOutput', () => output.show()),
    vscode.workspace.onDidChangeConfiguration(onConfigurationChanged),
  );
  await start();
}

export async function deactivate(): Promise<void> {
  await stop();
}

function idleState(): 'ready' | 'disabled' {
  return settings.enable['*'] === false ? 'disabled' : 'ready';
}

async function start(): Promise<void> {
  const command = findExecutable(settings.path, vscode.workspace.workspaceFolders?.[0]?.uri.fsPath);
  if (command === undefined) {
    reportStartFailure(
      `"${settings.path}" was not found`,
      `lingls: the language server "${settings.path}" was not found. Install lingls (see the extension's README) ` +
        'or set "lingls.path" to the full path of its lingls command, e.g. a virtualenv\'s bin/lingls.',
    );
    return;
  }
  // TransportKind.stdio makes the client add `--stdio` to the arguments.
  const serverOptions: ServerOptions = { command, transport: TransportKind.stdio };
  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }],
    initializationOptions: serverSettings(settings),
    outputChannel: output,
    middleware: { provideInlineCompletionItems, handleWorkDoneProgress },
  };
  const c = new LanguageClient('lingls', 'lingls', serverOptions, clientOptions);
  c.onDidChangeState((e) => {
    if (e.newState === ClientState.Starting) {
      status.set('loading');
    } else if (e.newState === ClientState.Running) {
      status.set(idleState());
    } else if (!stopping) {
      status.set('error', 'the language server stopped; run "lingls: Restart the language server"');
    }
  });
  client = c;
  status.set('loading');
  try {
    await c.start();
  } catch (err) {
    const why = err instanceof Error ? err.message : String(err);
    reportStartFailure(
      `could not start "${command} --stdio": ${why}`,
      `lingls: could not start "${command} --stdio" (${why}). See "lingls: Show the server log", or set "lingls.path".`,
    );
  }
}

/** Show why the server is not running in the status bar, and in a notification that opens the setting. The
 * notification is not awaited: it stays until the user closes it, and activation or a restart must not wait. */
function reportStartFailure(statusText: string, message: string): void {
  status.set('error', statusText);
  output.error(message);
  void vscode.window.showErrorMessage(message, 'Open Settings').then((choice) => {
    if (choice) {
      void vscode.commands.executeCommand('workbench.action.openSettings', 'lingls.path');
    }
  });
}

async function stop(): Promise<void> {
  const c = client;
  client = undefined;
  if (c) {
    stopping = true;
    try {
      await c.stop();
    } catch (err) {
      output.warn(`stopping the server: ${err}`);
    } finally {
      stopping = false;
    }
  }
}

async function restart(): Promise<void> {
  await stop();
  await start();
}

async function onConfigurationChanged(e: vscode.ConfigurationChangeEvent): Promise<void> {
  if (!e.affectsConfiguration('lingls')) {
    return;
  }
  const before = settings;
  settings = readSettings();
  if (settings.path !== before.path) {
    await restart();
    return;
  }
  if (client?.state === ClientState.Running) {
    status.set(idleState());
    await client.sendNotification('workspace/didChangeConfiguration', { settings: serverSettings(settings) });
  }
}

/** Middleware around the server's work-done progress: while it loads the model (its `lingls/loading/N` tokens)
 * the status bar says loading, not ready; every message still goes on to the client's own progress display. */
function handleWorkDoneProgress(
  token: ProgressToken,
  params: WorkDoneProgressBegin | WorkDoneProgressReport | WorkDoneProgressEnd,
  next: HandleWorkDoneProgressSignature,
): void {
  const step = loadingStep(token, params);
  if (step?.state === 'loading') {
    status.set('loading');
  } else if (step?.state === 'loaded') {
    status.set(idleState());
  } else if (step?.state === 'failed') {
    status.set('error', step.why);
  }
  next(token, params);
}

/** Middleware around every inline completion request: skip disabled languages, show "generating" while the
 * request is in flight, and surface server errors in the status bar (cancellations are normal: VS Code cancels
 * the previous request on every keystroke). */
async function provideInlineCompletionItems(
  document: vscode.TextDocument,
  position: vscode.Position,
  context: vscode.InlineCompletionContext,
  token: CancellationToken,
  next: (
    document: vscode.TextDocument,
    position: vscode.Position,
    context: vscode.InlineCompletionContext,
    token: CancellationToken,
  ) => vscode.ProviderResult<vscode.InlineCompletionItem[] | vscode.InlineCompletionList>,
): Promise<vscode.InlineCompletionItem[] | vscode.InlineCompletionList | undefined | null> {
  if (!isEnabledFor(settings, document.languageId)) {
    return undefined;
  }
  const done = status.begin();
  try {
    const result = await next(document, position, context, token);
    status.set(idleState());
    return result;
  } catch (err) {
    if (!token.isCancellationRequested) {
      status.set('error', err instanceof Error ? err.message : String(err));
      output.error(`inline completion failed: ${err}`);
    }
    return undefined;
  } finally {
    done();
  }
}
