/**
 * The server's model loading, as it reports it through LSP work-done progress (`$/progress` on the tokens it
 * creates, `lingls/loading/N`): what each message means for the status bar. Pure, so it is unit-tested without
 * VS Code; the client's built-in progress display still shows the same messages in the window.
 */

export const LOADING_TOKEN_PREFIX = 'lingls/loading/';

export type LoadingStep = { state: 'loading' } | { state: 'loaded' } | { state: 'failed'; why: string };

/** The status a progress message on `token` asks for, or undefined when it is not about loading the model. */
export function loadingStep(
  token: string | number,
  value: { kind: 'begin' | 'report' | 'end'; message?: string },
): LoadingStep | undefined {
  if (typeof token !== 'string' || !token.startsWith(LOADING_TOKEN_PREFIX)) {
    return undefined;
  }
  if (value.kind !== 'end') {
    return { state: 'loading' };
  }
  const message = value.message ?? '';
  return message.startsWith('failed')
    ? { state: 'failed', why: `the model ${message}; see "lingls: Show the server log"` }
    : { state: 'loaded' };
}
