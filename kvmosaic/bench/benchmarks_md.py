"""Keep this benchmark's own section of BENCHMARKS.md up to date (other sections untouched)."""

from __future__ import annotations

import shutil
from pathlib import Path

SECTION = "## Peers and workloads (issue 5)"

INTRO = """\
`kvmosaic bench` (code in `kvmosaic/bench/`) runs each engine in its own worker process, loaded
once, on the same prompt token ids; requests go one at a time, interleaved engine by engine
(A B C, then B C A, ...), so machine drift falls on every engine alike and cancels in the ratios.
The workloads are generated from the seed (text written by the project, no datasets). Plots and
the table below are written by the command shown; `results/` holds the latest run's
`bench.md`, `bench.json` (every request) and PNGs.

"""


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


def publish(md_path: Path, report_md: str, plots: list[Path]) -> Path:
    """Copy ``plots`` to ``docs/bench/`` beside ``md_path`` and write the report (its title
    dropped, its headings one level down, plot links pointing there) as this benchmark's
    section. Returns the plot folder."""
    plot_dir = md_path.parent / "docs" / "bench"
    plot_dir.mkdir(parents=True, exist_ok=True)
    body = INTRO + report_md.split("\n", 2)[2].replace("\n## ", "\n### ")
    for p in plots:
        shutil.copy2(p, plot_dir / p.name)
        body = body.replace(f"]({p.name})", f"](docs/bench/{p.name})")
    doc = md_path.read_text() if md_path.exists() else "# Benchmarks\n"
    md_path.write_text(replace_section(doc, SECTION, body))
    return plot_dir
