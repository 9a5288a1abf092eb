/**
 * The status bar item: tells the user whether a suggestion is being generated, which local models make slow
 * enough to matter, and whether the server is up at all. Clicking it toggles suggestions.
 */
import * as vscode from 'vscode';

export type State = 'loading' | 'ready' | 'generating' | 'disabled' | 'error';

const LOOK: Record<State, { icon: string; tip: string }> = {
  loading: { icon: '$(loading~spin)', tip: 'lingls: starting the language server and loading the model' },
  ready: { icon: '$(sparkle)', tip: 'lingls: ready (click to turn suggestions off)' },
  generating: { icon: '$(sync~spin)', tip: 'lingls: generating a suggestion' },
  disabled: { icon: '$(circle-slash)', tip: 'lingls: suggestions are off (click to turn them on)' },
  error: { icon: '$(error)', tip: 'lingls: error' },
};

export class StatusItem implements vscode.Disposable {
  private readonly item: vscode.StatusBarItem;
  private base: State = 'loading';
  private inFlight = 0;
  private errorText = '';

  constructor(toggleCommand: string) {
    this.item = vscode.window.createStatusBarItem('lingls.status', vscode.StatusBarAlignment.Right, 100);
    this.item.command = toggleCommand;
    this.item.name = 'lingls';
    this.render();
    this.item.show();
  }

  /** The state that holds while no request is in flight. */
  set(state: Exclude<State, 'generating'>, errorText = ''): void {
    this.base = state;
    this.errorText = errorText;
    this.render();
  }

  /** Count a request in flight until the returned function is called (once). */
  begin(): () => void {
    this.inFlight++;
    this.render();
    let done = false;
    return () => {
      if (!done) {
        done = true;
        this.inFlight--;
        this.render();
      }
    };
  }

  private render(): void {
    const state: State = this.base === 'ready' && this.inFlight > 0 ? 'generating' : this.base;
    const look = LOOK[state];
    this.item.text = `${look.icon} lingls`;
    this.item.tooltip = state === 'error' && this.errorText ? `${look.tip}: ${this.errorText}` : look.tip;
    this.item.backgroundColor =
      state === 'error' ? new vscode.ThemeColor('statusBarItem.errorBackground') : undefined;
  }

  dispose(): void {
    this.item.dispose();
  }
}
