"""License of each top-level package in the training data, read from the installed distributions' metadata."""

from __future__ import annotations

from importlib import metadata


def _license_of(dist: metadata.Distribution) -> str:
    meta = dist.metadata
    expr = meta.get("License-Expression")
    if expr:
        return expr
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    text = (meta.get("License") or "").strip()
    if text and len(text) <= 80 and "\n" not in text:
        return text
    return "see the package's license file" if text else "not stated in its metadata"


def package_licenses(packages: list[str]) -> dict[str, dict]:
    """{'site:numpy': {'distribution': 'numpy', 'license': 'BSD-3-Clause'}, 'stdlib:json': {... PSF ...}}."""
    dists = metadata.packages_distributions()
    out = {}
    for key in packages:
        root, _, top = key.partition(":")
        if root == "stdlib":
            out[key] = {"distribution": "Python standard library",
                        "license": "PSF-2.0 (Python Software Foundation License)"}
            continue
        names = dists.get(top, [])
        # several distributions can ship a module of the same name: prefer the one named like it
        names = sorted(names, key=lambda n: n.lower().replace("-", "_") != top.lower())
        if not names:
            out[key] = {"distribution": "?", "license": "unknown (no installed metadata names it)"}
            continue
        try:
            dist = metadata.distribution(names[0])
        except metadata.PackageNotFoundError:
            out[key] = {"distribution": names[0], "license": "unknown"}
            continue
        out[key] = {"distribution": f"{dist.metadata['Name']} {dist.version}", "license": _license_of(dist)}
    return out
