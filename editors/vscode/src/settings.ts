/**
 * The extension's settings (`lingls.*`) and the server settings derived from them.
 *
 * VS Code keeps per-language switches as an object (`{"*": true, "markdown": false}`), the convention of other
 * completion extensions; the client skips requests for disabled languages so that no keystroke in them costs a
 * round trip.
 */
import * as vscode from 'vscode';

export interface ExtensionSettings {
  path: string;
  endpoint: string;
  model: string;
  maxTokens: number;
  debounceMs: number;
  minLineProbability: number;
  enable: Record<string, boolean>;
}

export function readSettings(): ExtensionSettings {
  const cfg = vscode.workspace.getConfiguration('lingls');
  return {
    path: cfg.get<string>('path', 'lingls').trim() || 'lingls',
    endpoint: cfg.get<string>('endpoint', '').trim(),
    model: cfg.get<string>('model', '').trim(),
    maxTokens: cfg.get<number>('maxTokens', 64),
    debounceMs: cfg.get<number>('debounceMs', 50),
    minLineProbability: cfg.get<number>('minLineProbability', 0.02),
    enable: { ...cfg.get<Record<string, boolean>>('enable', { '*': true }) },
  };
}

/** What the server reads from initializationOptions and workspace/didChangeConfiguration. The server knows a
 * list of enabled language ids ("*": all); exceptions to "*" are enforced by the client, which never asks for
 * completions in a disabled language. Empty strings mean "the server's default" and are left out. */
export function serverSettings(s: ExtensionSettings): Record<string, unknown> {
  const languages =
    s.enable['*'] === false
      ? Object.keys(s.enable)
          .filter((id) => id !== '*' && s.enable[id])
          .sort()
      : ['*'];
  const out: Record<string, unknown> = {
    maxTokens: s.maxTokens,
    debounceMs: s.debounceMs,
    minLineProbability: s.minLineProbability,
    languages,
  };
  if (s.endpoint) {
    out.endpoint = s.endpoint;
  }
  if (s.model) {
    out.model = s.model;
  }
  return out;
}

export function isEnabledFor(s: ExtensionSettings, languageId: string): boolean {
  return s.enable[languageId] ?? s.enable['*'] ?? true;
}

/** Flip the `*` switch (every language not listed by name), in the user's global settings. */
export async function toggleAll(): Promise<boolean> {
  const cfg = vscode.workspace.getConfiguration('lingls');
  const enable = { ...cfg.get<Record<string, boolean>>('enable', { '*': true }) };
  enable['*'] = !(enable['*'] ?? true);
  await cfg.update('enable', enable, vscode.ConfigurationTarget.Global);
  return enable['*'];
}
