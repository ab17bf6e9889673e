"""mkdocs hook (``hooks:`` in mkdocs.yml): lay out the package as it is imported, for mkdocstrings.

The import package ``schedspec`` is assembled from several folders (pyproject.toml's
``tool.setuptools.package-dir``: ``spec/`` is ``schedspec.spec``, ``reference/`` is
``schedspec.reference``, ...). Griffe, which reads the source for mkdocstrings without importing it,
looks for ``schedspec/spec`` and does not find it. This hook builds ``build/api-src/schedspec`` out of
symbolic links (the files of ``schedspec/`` plus one link per mapped folder) before the build, and
mkdocs.yml points mkdocstrings' ``paths`` there. Nothing is copied; ``build/`` is ignored by git.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "api-src"


def build_tree() -> Path:
    """Create ``build/api-src/schedspec`` (replacing an old one); return ``build/api-src``."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    package = TREE / "schedspec"
    if TREE.exists():
        shutil.rmtree(TREE)
    package.mkdir(parents=True)
    for entry in (ROOT / mapping["schedspec"]).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        parts = name.split(".")
        if len(parts) == 2:  # schedspec.X -> folder (deeper ones are inside it already)
            (package / parts[1]).symlink_to(ROOT / folder, target_is_directory=True)
    return TREE


def on_startup(command: str, dirty: bool) -> None:
    build_tree()
