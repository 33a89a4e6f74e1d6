"""A folder's files, sized and hashed in a ``manifest.json``, written durably: the integrity half of a
native checkpoint (:mod:`spader_pipeline.native.checkpoint`).

:func:`write_manifest` fsyncs every file, then writes and fsyncs the manifest and the folder;
:func:`manifest_problem` says which file no longer matches it (missing, another size, another hash).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """Flush a file or folder to the disk (folders: their entries, i.e. renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path) -> dict[str, Any]:
    """fsync every file under ``folder``, then write and fsync ``manifest.json`` listing them."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        fsync(path)
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": sha256(path)}
    manifest = {"version": 1, "files": files}
    target = folder / MANIFEST_FILE
    target.write_text(json.dumps(manifest, indent=1))
    fsync(target)
    fsync(folder)
    return manifest


def manifest_problem(folder: Path, required: tuple[str, ...] = ()) -> str | None:
    """Why the files of ``folder`` do not match its manifest (naming the file), or ``None`` when they
    do. ``required``: files the manifest must list."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"{MANIFEST_FILE} is missing (an unfinished write, or a checkpoint of an older version)"
    except (ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({exc})"
    for name in required:
        if name not in files:
            return f"{MANIFEST_FILE} does not list {name}"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, the manifest says {expected['size']}"
        if sha256(path) != expected["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None

