/**
 * findExecutable (src/executable.ts): how `lingls.path` becomes the program the client starts. The TypeScript
 * module is bundled on the fly with the extension's own esbuild; it needs nothing from VS Code.
 */
import assert from 'node:assert/strict';
import { chmodSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { buildSync } from 'esbuild';

const root = join(fileURLToPath(import.meta.url), '..', '..');
const scratch = mkdtempSync(join(tmpdir(), 'lingls-executable-'));
const bundle = join(scratch, 'executable.mjs');
buildSync({
  entryPoints: [join(root, 'src', 'executable.ts')],
  bundle: true,
  platform: 'node',
  format: 'esm',
  outfile: bundle,
  logLevel: 'warning',
});
const { findExecutable } = await import(bundle);

function makeFile(path, mode) {
  mkdirSync(join(path, '..'), { recursive: true });
  writeFileSync(path, '#!/bin/sh\n');
  chmodSync(path, mode);
  return path;
}
const project = join(scratch, 'project');
const venvLingls = makeFile(join(project, '.venv', 'bin', 'lingls'), 0o755);
const onPath = makeFile(join(scratch, 'bin', 'lingls'), 0o755);
const notExecutable = makeFile(join(scratch, 'plain', 'lingls'), 0o644);
mkdirSync(join(scratch, 'dir', 'lingls'), { recursive: true });

test('a bare name is looked up on PATH, skipping entries that are not executable files', () => {
  const path = ['missing', 'plain', 'dir', 'bin'].map((d) => join(scratch, d)).join(':');
  assert.equal(findExecutable('lingls', project, path), onPath);
  assert.equal(findExecutable('lingls', project, join(scratch, 'plain')), undefined);
  assert.equal(findExecutable('lingls', project, ''), undefined);
});

test('an absolute path must name an executable file', () => {
  assert.equal(findExecutable(venvLingls, undefined, ''), venvLingls);
  assert.equal(findExecutable(notExecutable, undefined, ''), undefined);
  assert.equal(findExecutable(join(scratch, 'dir', 'lingls'), undefined, ''), undefined);
  assert.equal(findExecutable(join(scratch, 'nowhere', 'lingls'), undefined, ''), undefined);
});

test('a relative path is taken from the first workspace folder', () => {
  assert.equal(findExecutable('.venv/bin/lingls', project, ''), venvLingls);
  assert.equal(findExecutable('./.venv/bin/lingls', project, ''), venvLingls);
  assert.equal(findExecutable('.venv/bin/lingls', scratch, ''), undefined);
});

test('~/ is the home directory', () => {
  const home = process.env.HOME;
  process.env.HOME = project; // os.homedir() reads HOME
  try {
    assert.equal(findExecutable('~/.venv/bin/lingls', undefined, ''), venvLingls);
  } finally {
    process.env.HOME = home;
  }
});

test.after(() => rmSync(scratch, { recursive: true, force: true }));
