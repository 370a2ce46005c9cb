"""Regenerate every table and figure from run records: markdown + LaTeX tables, PNG + PDF figures, each listing the
records it came from, and an index.md of all of them.

    report = regenerate(["outputs", "multirun"], out="analysis/out")
    report.tables, report.figures            # {name: Table}, {name: [png, pdf]}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from analysis import figures, tables
from analysis.records import load_frame
from mla_quant.record import atomic_path, write_text_atomic


@dataclass
class Report:
    out: Path
    frame: pd.DataFrame
    tables: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"{len(self.frame)} records read ({int((self.frame['status'] == 'ok').sum())} complete)"]
        lines += [f"  table  {self.out / (n + '.md')}" for n in self.tables]
        lines += [f"  figure {paths[0]}" for paths in self.figures.values()]
        return "\n".join(lines)


def _sources_text(sources: list[str]) -> str:
    return "Records:\n" + "\n".join(f"- {s}" for s in sorted(set(sources))) + "\n"


def write_table(t: tables.Table, out: Path) -> list[Path]:
    md = t.rows.to_markdown(index=False, floatfmt=".4g")
    write_text_atomic(out / f"{t.name}.md", f"## {t.title}\n\n{md}\n\n{_sources_text(t.sources)}")
    latex = t.rows.to_latex(index=False, float_format="%.4g", caption=t.title, label=f"tab:{t.name}",
                            escape=True)
    comments = "".join(f"% record: {s}\n" for s in t.sources)
    write_text_atomic(out / f"{t.name}.tex", comments + latex)
    with atomic_path(out / f"{t.name}.csv") as tmp:
        t.long.drop(columns=[c for c in ("cell",) if c in t.long], errors="ignore").to_csv(tmp, index=False)
    return [out / f"{t.name}.md", out / f"{t.name}.tex", out / f"{t.name}.csv"]


def write_figure(name: str, fig, sources: list[str], out: Path) -> list[Path]:
    paths = []
    for ext in ("png", "pdf"):
        with atomic_path(out / f"{name}.{ext}") as tmp:
            fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight")
        paths.append(out / f"{name}.{ext}")
    plt.close(fig)
    write_text_atomic(out / f"{name}.sources.txt", _sources_text(sources))
    return paths


def regenerate(roots, out: str | Path = "analysis/out", wandb_exports=()) -> Report:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, load_frame(roots, wandb_exports))
    built = {b.__name__: b(report.frame) for b in tables.BUILDERS}
    for name, t in built.items():
        if not t.empty:
            write_table(t, out)
            report.tables[name] = t
            report.sources[name] = t.sources
    makers = ((figures.amplification_figures, "amplification"), (figures.ruler_figures, "ruler"),
              (figures.memory_figures, "memory"), (figures.accuracy_vs_bytes, "accuracy"))
    for make, name in makers:
        for fig_name, (fig, sources) in make(built[name]).items():
            report.figures[fig_name] = write_figure(fig_name, fig, sources, out)
            report.sources[fig_name] = sources
    index = ["# Tables and figures", "", f"From {len(report.frame)} records under {', '.join(map(str, roots))}.", ""]
    for name in report.tables:
        index.append(f"- table `{name}` ({name}.md, {name}.tex, {name}.csv): {len(set(report.sources[name]))} records")
    for name in report.figures:
        index.append(f"- figure `{name}` ({name}.png, {name}.pdf): {len(set(report.sources[name]))} records")
    missing = [t.name for t in built.values() if t.empty]
    if missing:
        index.append(f"\nNo complete records for: {', '.join(missing)}")
    write_text_atomic(out / "index.md", "\n".join(index) + "\n")
    return report
