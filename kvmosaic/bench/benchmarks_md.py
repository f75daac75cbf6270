"""Keep this benchmark's own section of BENCHMARKS.md up to date (other sections untouched)."""

from __future__ import annotations

import shutil
from pathlib import Path

SECTION = "## Peers and workloads (issue 5)"


def replace_section(document: str, heading: str, body: str) -> str:
    """``document`` with the section under ``heading`` (up to the next ``## `` heading) replaced
    by ``body``, or with the section appended when it is missing."""
    block = f"{heading}\n\n{body.strip()}\n"
    lines = document.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    if start is None:
        sep = "" if not document or document.endswith("\n\n") else ("\n" if document.endswith("\n") else "\n\n")
        return document + sep + block
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + block + ("\n" + tail if tail else "")


def publish(md_path: Path, body: str, plots: list[Path], plot_dir: Path) -> None:
    """Copy ``plots`` to ``plot_dir`` and write ``body`` as this benchmark's section."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    for p in plots:
        shutil.copy2(p, plot_dir / p.name)
    doc = md_path.read_text() if md_path.exists() else "# Benchmarks\n"
    md_path.write_text(replace_section(doc, SECTION, body))
