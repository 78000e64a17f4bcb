"""What a model repository directory holds: one `Entry` per model, found by `scan`.

A model repository (`serve --model-repository DIR`) is a directory whose subdirectories are
models: each one that holds a model.json (the output of `python -m export`, as it is) is a
model named after the subdirectory. Hidden subdirectories (a leading ".") are skipped, so a
new version can be written beside the repository's models and renamed into place; a
subdirectory may be a symbolic link, so that a version can be swapped in with `ln -sfn`.

Each entry carries its version, a digest of its model.json and of the names, sizes and
modification times of the files beside it (a new export, or a file rewritten in place, is a
new version), and the memory it is counted for: the total size of those files (the graphs,
their external weights, the tokenizer), which ONNX Runtime holds in memory once loaded. Known
before loading, it lets the repository make room before a load starts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tfserve.artifacts.manifest import MANIFEST_FILE, Manifest, inside

log = logging.getLogger("tfserve.server")

# a model's name goes into URLs (/v1/models/NAME), health service names and metric labels
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
VERSION_CHARS = 16  # hex digits of the version digest shown


@dataclass(frozen=True)
class Entry:
    """One model of a repository as found on disk.

    `manifest_error` is why its model.json could not be read ("" when it could): the entry is
    still listed, and loading it fails with that reason. `encoder_only`: an encoder model
    (decoder_layers 0), which answers Encode only (the inference protocol's front end reads
    it to map a request before the model loads).
    """

    name: str
    path: Path
    version: str
    memory_bytes: int
    model_name: str = ""
    source_language: str = ""
    target_language: str = ""
    manifest_error: str = ""
    encoder_only: bool = False


def read_entry(name: str, path: Path) -> Entry:
    """The entry of the model in `path`; OSError when its files cannot be listed or read
    (being replaced: the caller keeps what it knew)."""
    manifest = path / MANIFEST_FILE
    # a model.json that leads outside the model's directory is not read (Manifest.load
    # refuses it below); where it leads stands for its content in the version
    digest = hashlib.sha256(manifest.read_bytes() if inside(path, MANIFEST_FILE)
                            else str(manifest.resolve()).encode())
    total = 0
    with os.scandir(path) as items:
        files = sorted((item for item in items if item.is_file()), key=lambda item: item.name)
        for item in files:
            stat = item.stat()
            total += stat.st_size
            digest.update(f"{item.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    try:
        config = Manifest.load(path).config
    except (ValueError, KeyError, TypeError) as exc:
        return Entry(name, path, digest.hexdigest()[:VERSION_CHARS], total,
                     manifest_error=str(exc))  # it names the file
    return Entry(name, path, digest.hexdigest()[:VERSION_CHARS], total, config.name,
                 config.source_language, config.target_language,
                 encoder_only=bool(config.encoder_only))


def relative_paths(text: str, entry: Entry, repository: Path | None) -> str:
    """`text` (a reason why `entry` cannot load) with the server's paths made relative to the
    model repository: the model's directory, as given, absolute or with its links resolved,
    becomes the model's name (`demo/encoder.onnx`), the repository's own path (`--model
    DIR`: the directory holding DIR) is dropped. What a client is told of a model's files,
    without learning the server's file system."""
    names: dict[str, str] = {}
    for base, name in ((repository or entry.path.parent, ""), (entry.path, entry.name)):
        for form in _path_forms(base):
            names[form] = name
    if not names:
        return text
    # the longest first, whole path components only: neither /repo/demo2 nor a/repo/demo
    pattern = re.compile(r"(?<![\w.\-/])(?P<path>"
                         + "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
                         + r")(?P<slash>/)?(?(slash)|(?![\w.\-]))")

    def shown(match: re.Match[str]) -> str:
        name = names[match["path"]]
        if match["slash"]:
            return f"{name}/" if name else ""
        return name or "."

    return pattern.sub(shown, text)


def _path_forms(path: Path) -> set[str]:
    """How a message may spell `path`: as given, absolute, links resolved (never "." or
    "/", which would match any text)."""
    forms = {str(path), str(path.absolute())}
    try:
        forms.add(str(path.resolve()))
    except (OSError, RuntimeError):  # a link loop: the other spellings stand
        pass
    return {form for form in forms if form not in ("", ".", "/")}


def single_entry(path: Path, name: str = "") -> Entry:
    """`serve --model DIR` as a repository of one: the model named after its directory."""
    path = Path(path)
    return read_entry(name or path.resolve().name, path)


@dataclass
class Scan:
    """One look at the repository: the entries found, and the names of models whose files
    could not be read this time (being written or replaced; not taken as removed)."""

    entries: dict[str, Entry]
    unreadable: set[str]


def scan(directory: Path, warned: set[str] | None = None) -> Scan:
    """The models in `directory`, by name. ValueError naming --model-repository when the
    directory itself cannot be read. A subdirectory whose name cannot be a model's name is
    skipped with a warning (once per name, when `warned` keeps them)."""
    try:
        children = sorted(directory.iterdir())
    except OSError as exc:
        raise ValueError(f"--model-repository {directory}: cannot read it "
                         f"({exc.strerror or exc})") from None
    found = Scan({}, set())
    for child in children:
        name = child.name
        if name.startswith("."):
            continue
        try:
            if not (child.is_dir() and (child / MANIFEST_FILE).is_file()):
                continue
        except OSError:
            continue
        if not NAME_PATTERN.fullmatch(name):
            if warned is None or name not in warned:
                log.warning("model repository: %r is not a model name (letters, digits, '.', "
                            "'_' and '-', at most 128, starting with a letter or digit); "
                            "skipped", name)
                if warned is not None:
                    warned.add(name)
            continue
        try:
            found.entries[name] = read_entry(name, child)
        except OSError:
            found.unreadable.add(name)
    return found
