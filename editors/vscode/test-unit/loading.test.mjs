/**
 * loadingStep (src/loading.ts): the server's loading progress (`$/progress` on `lingls/loading/N`) as the status
 * bar's state. Bundled on the fly with the extension's own esbuild; it needs nothing from VS Code.
 */
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { buildSync } from 'esbuild';

const root = join(fileURLToPath(import.meta.url), '..', '..');
const bundle = join(mkdtempSync(join(tmpdir(), 'lingls-loading-')), 'loading.mjs');
buildSync({ entryPoints: [join(root, 'src', 'loading.ts')], bundle: true, platform: 'node', format: 'esm',
  outfile: bundle, logLevel: 'warning' });
const { loadingStep } = await import(bundle);

test('the loading token keeps the status at loading from begin to end, then ready or failed', () => {
  const token = 'lingls/loading/1';
  assert.deepEqual(loadingStep(token, { kind: 'begin', message: 'loading the embedded model' }), { state: 'loading' });
  assert.deepEqual(loadingStep(token, { kind: 'report', message: '50%' }), { state: 'loading' });
  assert.deepEqual(loadingStep(token, { kind: 'end', message: 'ling-nano ready' }), { state: 'loaded' });
  const failed = loadingStep(token, { kind: 'end', message: 'failed: see the log' });
  assert.equal(failed.state, 'failed');
  assert.match(failed.why, /failed/);
});

test('progress on other tokens is not about loading', () => {
  assert.equal(loadingStep('indexing/1', { kind: 'begin' }), undefined);
  assert.equal(loadingStep(7, { kind: 'end' }), undefined);
});
