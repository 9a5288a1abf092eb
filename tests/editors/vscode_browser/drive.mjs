/**
 * Drives VS Code (code-server) in a headless Chromium as a person would, for tests/editors/test_vscode_browser.py:
 * in a workspace of two folders, open a Python file from the Explorer, type, look at the ghost text, accept a word
 * with Ctrl+Right and the rest with Tab, save; do the same in a file of the second folder; then point `lingls.path`
 * at a missing file and back in the Settings editor.
 *
 * Everything it sees comes from the DOM and goes to stdout as one JSON object; the Python test makes the
 * assertions. A step that times out ends the run with the report so far plus `error`, and a screenshot.
 *
 * Usage: node drive.mjs '{"url", "chromium", "workspace", "files": [in folder 1, in folder 2], "missingPath", "shots"}'
 */
import { join } from 'node:path';
import puppeteer from 'puppeteer-core';

const cfg = JSON.parse(process.argv[2]);
const report = { ms: {}, status: {} };
const started = Date.now();
const STATUS = '.statusbar-item[id^="lingls."]';

/** In-page readers of the editor's DOM. Spaces are drawn as U+00A0. */
const PAGE_HELPERS = () => {
  const text = (el) => el.textContent.replace(/\u00a0/g, ' ');
  const byTop = (a, b) => parseFloat(a.style.top) - parseFloat(b.style.top);
  const editor = () => document.querySelector('.editor-instance .monaco-editor');
  window.lingls = {
    /** The document's lines as drawn, without ghost text (which VS Code draws inside the line). */
    lines() {
      return [...editor().querySelectorAll('.view-lines .view-line')].sort(byTop).map((line) =>
        [...line.querySelectorAll('span > span')]
          .filter((s) => !s.classList.contains('ghost-text-decoration'))
          .map(text)
          .join(''),
      );
    },
    /** The ghost text: its part inside the cursor's line plus the lines VS Code draws below it. */
    ghost() {
      const inline = [...editor().querySelectorAll('.view-lines .ghost-text-decoration')].map(text).join('');
      const below = [...editor().querySelectorAll('.view-zones .suggest-preview-text .view-line')]
        .sort(byTop)
        .map(text);
      return inline || below.length ? [inline, ...below].join('\n') : null;
    },
    /** The ghost text once it has stayed the same for 200 ms: VS Code draws its lines in more than one pass. */
    settledGhost() {
      const now = lingls.ghost();
      const last = window.linglsLastGhost;
      if (!last || last.value !== now) {
        window.linglsLastGhost = { value: now, since: Date.now() };
        return null;
      }
      return now !== null && Date.now() - last.since >= 200 ? now : null;
    },
    status() {
      const item = document.querySelector('.statusbar-item[id^="lingls."]');
      if (!item) {
        return null;
      }
      const icon = item.querySelector('.codicon');
      return {
        id: item.id,
        text: text(item).trim(),
        icon: icon ? [...icon.classList].filter((c) => c.startsWith('codicon-')).join(' ') : '',
        label: item.querySelector('[aria-label]')?.getAttribute('aria-label') ?? '',
      };
    },
    /** Every distinct state the status item goes through from now on. */
    watchStatus() {
      window.linglsStates = [lingls.status()?.icon];
      new MutationObserver(() => {
        const icon = lingls.status()?.icon;
        if (icon && icon !== window.linglsStates.at(-1)) {
          window.linglsStates.push(icon);
        }
      }).observe(document.querySelector('.statusbar'), { subtree: true, childList: true, attributes: true });
    },
    notifications() {
      return [...document.querySelectorAll('.notification-toast')].map((t) => ({
        message: text(t.querySelector('.notification-list-item-message') ?? t),
        buttons: [...t.querySelectorAll('.monaco-button')].map(text),
      }));
    },
  };
};

async function waitFor(page, what, fn, arg, timeout = 30000) {
  const t0 = Date.now();
  try {
    const handle = await page.waitForFunction(fn, { timeout, polling: 50 }, arg);
    const value = await handle.jsonValue();
    report.ms[what] = Date.now() - t0;
    return value;
  } catch (err) {
    throw new Error(`timed out after ${timeout} ms waiting for ${what}: ${err.message.split('\n')[0]}`);
  }
}

async function waitForGhost(page, what) {
  await page.evaluate(() => {
    window.linglsLastGhost = undefined;
  });
  return waitFor(page, what, () => lingls.settledGhost());
}

async function chord(page, modifier, key) {
  await page.keyboard.down(modifier);
  await page.keyboard.press(key);
  await page.keyboard.up(modifier);
}

async function scenario(page) {
  await page.goto(`${cfg.url}/?workspace=${encodeURIComponent(cfg.workspace)}`, { waitUntil: 'domcontentloaded' });
  await page.evaluate(PAGE_HELPERS);
  await openFromExplorer(page, cfg.files[0], 60000);
  report.ms.workbench = Date.now() - started;
  report.status.first = await waitFor(page, 'server ready', () => {
    const s = lingls.status();
    return s && s.icon === 'codicon-sparkle' ? s : null;
  });

  // Type a function header at the end of the file; Enter indents the body line, where a statement is expected.
  await page.evaluate(() => lingls.watchStatus());
  await page.click('.editor-instance .monaco-editor .view-lines');
  await chord(page, 'Control', 'End');
  await page.keyboard.type('def area(radius):', { delay: 20 });
  await page.keyboard.press('Enter');
  report.ghost = await waitForGhost(page, 'ghost text');
  report.linesWithGhost = await page.evaluate(() => lingls.lines());
  await page.screenshot({ path: join(cfg.shots, 'ghost-text.png') });
  report.status.afterGhost = await waitFor(page, 'status ready after the request', () => {
    const s = lingls.status();
    return s && s.icon === 'codicon-sparkle' ? s : null;
  });
  report.status.states = await page.evaluate(() => window.linglsStates);

  // Ctrl+Right: accept one word; the rest stays shown.
  await chord(page, 'Control', 'ArrowRight');
  report.linesAfterWord = await waitFor(
    page,
    'accept-word to edit the document',
    (before) => {
      const now = lingls.lines();
      return JSON.stringify(now) !== JSON.stringify(before) ? now : null;
    },
    report.linesWithGhost,
  );
  report.ghostAfterWord = await waitForGhost(page, 'ghost text after accept-word');

  // Tab: accept the rest, then save, so the test can read the file VS Code wrote.
  await page.keyboard.press('Tab');
  report.linesAfterTab = await waitFor(
    page,
    'Tab to edit the document',
    (before) => {
      const now = lingls.lines();
      return JSON.stringify(now) !== JSON.stringify(before) ? now : null;
    },
    report.linesAfterWord,
  );
  await page.keyboard.press('Escape');
  await chord(page, 'Control', 's');
  await waitFor(page, 'the save', () => !document.querySelector('.tab.active.dirty'));

  // A file of the workspace's second folder gets suggestions from the same server.
  await openFromExplorer(page, cfg.files[1], 30000);
  await page.click('.editor-instance .monaco-editor .view-lines');
  await chord(page, 'Control', 'End');
  await page.keyboard.type('def mean(values):', { delay: 20 });
  await page.keyboard.press('Enter');
  report.secondFolder = { ghost: await waitForGhost(page, 'ghost text in the second folder') };
  const shown = await page.evaluate(() => lingls.lines());
  await page.keyboard.press('Tab');
  report.secondFolder.lines = await waitFor(
    page,
    'Tab in the second folder',
    (before) => {
      const now = lingls.lines();
      return JSON.stringify(now) !== JSON.stringify(before) ? now : null;
    },
    shown,
  );
  await page.keyboard.press('Escape');

  // A missing server binary, set in the Settings editor as a user would: the user sees why and how to fix it;
  // fixing the setting brings the server back.
  await chord(page, 'Control', 'Comma');
  await page.waitForSelector('.settings-editor', { timeout: 30000 });
  await page.keyboard.type('lingls.path');
  const input = await page.waitForSelector('.settings-editor [data-key="lingls.path"] input', { timeout: 30000 });
  const goodPath = await input.evaluate((el) => el.value);
  await setInput(page, input, cfg.missingPath);
  report.status.missing = await waitFor(page, 'status error for a missing binary', () => {
    const s = lingls.status();
    return s && s.icon === 'codicon-error' ? s : null;
  });
  report.notifications = await waitFor(page, 'a notification for a missing binary', () => {
    const n = lingls.notifications().filter((t) => t.message.includes('lingls'));
    return n.length ? n : null;
  });
  await page.screenshot({ path: join(cfg.shots, 'missing-binary.png') });
  await setInput(page, input, goodPath);
  report.status.fixed = await waitFor(page, 'status ready after fixing lingls.path', () => {
    const s = lingls.status();
    return s && s.icon === 'codicon-sparkle' ? s : null;
  });
}

/** Open a file by clicking it in the Explorer (every folder of a small workspace starts expanded). */
async function openFromExplorer(page, name, timeout) {
  const row = await page.waitForSelector(`.explorer-folders-view .monaco-list-row[aria-label^="${name}"]`, { timeout });
  await row.click();
  await page.waitForSelector(`.tab.active[aria-label^="${name}"]`, { timeout: 30000 });
  await page.waitForSelector('.editor-instance .monaco-editor .view-lines', { timeout: 30000 });
}

/** Replace the text of a Settings editor input, as typed. */
async function setInput(page, input, value) {
  await input.click({ clickCount: 3 });
  await chord(page, 'Control', 'a');
  await page.keyboard.type(value);
}

const browser = await puppeteer.launch({
  executablePath: cfg.chromium,
  headless: true,
  // --no-sandbox: Chromium's sandbox cannot start as root, which is how CI runs.
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--window-size=1100,640'],
  defaultViewport: { width: 1100, height: 640 },
});
try {
  const page = await browser.newPage();
  try {
    await scenario(page);
  } catch (err) {
    report.error = err.message;
    await page.screenshot({ path: join(cfg.shots, 'failure.png') }).catch(() => {});
  }
} finally {
  report.ms.total = Date.now() - started;
  await browser.close();
  process.stdout.write(JSON.stringify(report) + '\n');
}
