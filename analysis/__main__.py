"""python -m analysis [ROOT ...] [--out analysis/out] [--wandb-export runs.csv]

Reads every run record (record.json) under the roots (default: outputs multirun), and an exported W&B project if
given, into one DataFrame, and regenerates every table (markdown, LaTeX, CSV) and figure (PNG, PDF) into --out,
each with the records it came from; index.md lists them.
"""

from __future__ import annotations

import argparse

from analysis.report import regenerate


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", default=["outputs", "multirun"], help="folders holding run records")
    parser.add_argument("--out", default="analysis/out", help="where tables and figures go")
    parser.add_argument("--wandb-export", action="append", default=[], metavar="FILE",
                        help="an exported W&B runs table (CSV from the UI, or JSON), read as records")
    args = parser.parse_args(argv)
    report = regenerate(args.roots, args.out, args.wandb_export)
    for t in report.tables.values():
        print(f"## {t.title}\n\n{t.rows.to_markdown(index=False, floatfmt='.4g')}\n")
    print(report.summary())


if __name__ == "__main__":
    main()
