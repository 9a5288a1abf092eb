"""Collect real Python source from this machine: the standard library and installed site-packages.

Every file gets a stable name, `stdlib/<relpath>` or `site/<relpath>`, and a package (`stdlib:json`,
`site:numpy`: the top-level directory or module). The held-out set is whole packages, so the evaluation measures
code the model has never seen in any form, not a sibling file of a package it trained on: packages are taken in
the order of a hash of their name (independent of walk order and of the machine), skipping very small and very
large ones, until the held-out bytes reach HELDOUT_BYTES. Then every training file is dropped whose
(whitespace-normalised) content equals a held-out file's, or whose path looks like a vendored copy of a held-out
package (`pip/_vendor/six.py` when `six` is held out): packages are often vendored inside others.
Training files are also deduplicated by content among themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from training.tokenizer import SPECIAL_TOKENS

MAX_FILE_BYTES = 256_000  # larger .py files are nearly always generated tables or vendored bundles
MIN_FILE_BYTES = 64
HELDOUT_BYTES = 4_000_000  # held-out packages are added until their bytes reach this
HELDOUT_PACKAGE_BYTES = (20_000, 800_000)  # a held-out package's size range: big enough to evaluate on, and
# small enough that no single package (torch, transformers) is the whole held-out set
MAX_PACKAGE_SHARE = 0.12  # no single package (transformers, torch, ...) may fill more of the training bytes


@dataclass(frozen=True)
class SourceFile:
    name: str  # "stdlib/json/decoder.py", "site/numpy/core/_methods.py"
    text: str

    @property
    def package(self) -> str:
        """Top-level package (or stdlib module), used for the data manifest and its license notes."""
        root, _, rest = self.name.partition("/")
        top = rest.split("/", 1)[0]
        return f"{root}:{top.removesuffix('.py')}"


@dataclass
class Corpus:
    train: list[SourceFile]
    heldout: list[SourceFile]
    stats: dict = field(default_factory=dict)


def source_roots() -> list[tuple[str, Path]]:
    """(label, directory) for the standard library and every site-packages directory of this interpreter."""
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    seen = {roots[0][1].resolve()}
    candidates = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    for path in candidates:
        p = Path(path)
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            roots.append(("site", p))
    return roots


def _hash(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def heldout_packages(files: list[SourceFile], target_bytes: int | None = None) -> set[str]:
    """Whole packages, in the order of a hash of their name, within HELDOUT_PACKAGE_BYTES, until
    `target_bytes`. Names, not files, decide the order, so the split is the same wherever the package is."""
    target_bytes = HELDOUT_BYTES if target_bytes is None else target_bytes
    sizes = package_bytes(files)
    low, high = HELDOUT_PACKAGE_BYTES
    picked, total = set(), 0
    for pkg in sorted(sizes, key=_hash):
        if total >= target_bytes:
            break
        if low <= sizes[pkg] <= high:
            picked.add(pkg)
            total += sizes[pkg]
    return picked


VENDOR_DIRS = {"_vendor", "vendor", "_vendored", "vendored", "extern", "_extern", "externals", "third_party",
               "thirdparty", "_lib"}


def _vendors_heldout(f: SourceFile, tops: set[str]) -> bool:
    """Whether a training file may be a copy of held-out code: its top level has a held-out package's name
    (`site:pathlib` when `stdlib:pathlib` is held out), or it sits under a vendoring directory inside a
    directory or module named like one (`pip/_vendor/six.py`, `setuptools/_vendor/packaging/version.py`)."""
    parts = f.name.split("/")[1:]
    if parts[0].removesuffix(".py") in tops:
        return True
    below = [p.removesuffix(".py") for p in parts[1:]]
    return any(v in VENDOR_DIRS for v in below[:-1]) and any(p in tops for p in below)


def content_key(text: str) -> str:
    """Hash of the text with trailing whitespace and blank lines removed: copies that differ only there match."""
    norm = "\n".join(line.rstrip() for line in text.splitlines() if line.strip())
    return hashlib.sha1(norm.encode()).hexdigest()


def _looks_generated(text: str) -> bool:
    lines = text.splitlines()
    if not lines:
        return True
    longest = max(len(line) for line in lines)
    return longest > 2000 or len(text) / len(lines) > 200


def iter_files(roots: list[tuple[str, Path]]):
    """Yield SourceFile for each readable UTF-8 .py file under the roots, in name order."""
    found: dict[str, Path] = {}
    for label, root in roots:
        site_root = label == "site"
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = Path(dirpath).relative_to(root)
            # site-packages of the stdlib root are walked as their own root; skip caches everywhere
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not (
                not site_root and rel_dir == Path(".") and d in ("site-packages", "dist-packages")))
            for fn in filenames:
                if fn.endswith(".py"):
                    name = f"{label}/{(rel_dir / fn).as_posix()}"
                    found.setdefault(name, Path(dirpath) / fn)
    for name in sorted(found):
        path = found[name]
        try:
            size = path.stat().st_size
            if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        # a file that spells a special token would inject it into the training stream
        if "\x00" in text or _looks_generated(text) or any(t in text for t in SPECIAL_TOKENS):
            continue
        yield SourceFile(name, text.replace("\r\n", "\n"))


def collect(max_train_bytes: int, roots: list[tuple[str, Path]] | None = None) -> Corpus:
    """Split this machine's Python source into held-out and training files.

    Training files are kept in a name-hash order (so a byte cap samples across packages rather than
    taking the alphabetically first ones) until `max_train_bytes`.
    """
    files = list(iter_files(roots or source_roots()))
    held_pkgs = heldout_packages(files)
    held_tops = {pkg.split(":", 1)[1] for pkg in held_pkgs}
    heldout = [f for f in files if f.package in held_pkgs]
    heldout_keys = {content_key(f.text) for f in heldout}
    seen = set(heldout_keys)
    candidates = sorted((f for f in files if f.package not in held_pkgs), key=lambda f: _hash(f.name))
    train, total, dup_heldout, dup_train, vendored = [], 0, 0, 0, 0
    per_package: dict[str, int] = {}
    package_cap = MAX_PACKAGE_SHARE * max_train_bytes
    for f in candidates:
        if _vendors_heldout(f, held_tops):
            vendored += 1
            continue
        key = content_key(f.text)
        if key in seen:
            dup_heldout += key in heldout_keys
            dup_train += key not in heldout_keys
            continue
        used = per_package.get(f.package, 0)
        if total + len(f.text) > max_train_bytes or used + len(f.text) > package_cap:
            continue
        seen.add(key)
        train.append(f)
        total += len(f.text)
        per_package[f.package] = used + len(f.text)
    # the held-out set itself is deduplicated too, keeping the first name
    uniq, keys = [], set()
    for f in heldout:
        k = content_key(f.text)
        if k not in keys:
            keys.add(k)
            uniq.append(f)
    stats = {
        "files_found": len(files),
        "train_files": len(train),
        "train_bytes": total,
        "heldout_packages": sorted(held_pkgs),
        "heldout_files": len(uniq),
        "heldout_bytes": sum(len(f.text) for f in uniq),
        "dropped_as_copy_of_heldout": dup_heldout,
        "dropped_as_duplicate": dup_train,
        "dropped_as_vendored_heldout_package": vendored,
        "roots": [f"{label}:{path}" for label, path in (roots or source_roots())],
    }
    return Corpus(train=train, heldout=uniq, stats=stats)


def package_bytes(files: list[SourceFile]) -> dict[str, int]:
    """Bytes per top-level package, largest first (the model card lists them with their licenses)."""
    out: dict[str, int] = {}
    for f in files:
        out[f.package] = out.get(f.package, 0) + len(f.text)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def write_manifest(corpus: Corpus, path: Path) -> None:
    manifest = {
        "stats": corpus.stats,
        "heldout_names": [f.name for f in corpus.heldout],
        "train_package_bytes": package_bytes(corpus.train),
    }
    path.write_text(json.dumps(manifest, indent=1) + "\n")
