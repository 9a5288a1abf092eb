/**
 * Finds the `lingls` executable that `lingls.path` names before the client starts it, so that a missing one is
 * reported as exactly that (with the path that was tried and the setting that fixes it) instead of as a failed
 * connection from deep inside the language client.
 */
import { accessSync, constants, statSync } from 'node:fs';
import { homedir } from 'node:os';
import * as path from 'node:path';

function isExecutableFile(file: string): boolean {
  try {
    accessSync(file, constants.X_OK);
    return statSync(file).isFile();
  } catch {
    return false;
  }
}

/** The file names `name` may have: on Windows, with each extension of PATHEXT too (`lingls.exe`). */
function candidates(name: string): string[] {
  if (process.platform !== 'win32') {
    return [name];
  }
  const extensions = (process.env.PATHEXT ?? '.EXE;.CMD;.BAT').split(';').filter(Boolean);
  return [name, ...extensions.map((ext) => name + ext.toLowerCase())];
}

/**
 * The absolute path of the executable `setting` names, or undefined when there is none. `setting` is a bare
 * name looked up on `PATH`, an absolute path, `~/...` (the home directory), or a relative path such as
 * `.venv/bin/lingls`, taken from the first workspace folder `base`.
 */
export function findExecutable(
  setting: string,
  base: string | undefined,
  envPath = process.env.PATH ?? '',
): string | undefined {
  let name = setting;
  if (name === '~' || name.startsWith('~/')) {
    name = path.join(homedir(), name.slice(1));
  }
  if (!name.includes('/') && !name.includes(path.sep)) {
    return envPath
      .split(path.delimiter)
      .filter(Boolean)
      .flatMap((dir) => candidates(path.join(dir, name)))
      .find(isExecutableFile);
  }
  const full = path.isAbsolute(name) ? name : path.resolve(base ?? process.cwd(), name);
  return candidates(full).find(isExecutableFile);
}
