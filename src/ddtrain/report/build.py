"""``ddtrain report DIR``: a results folder -> ``report.md`` and a self-contained ``report.html``.

    ddtrain bench scaling ... --out results/ && ddtrain bench collectives ... --json results/coll.json
    ddtrain report results/       # results/report.md, results/report.html, results/report_files/*.png

Reads every JSON under DIR: ``scaling.json`` of ``bench scaling`` (and the cell records it
names), results records of ``ddtrain train --out`` and ``bench collectives --json`` output.
Draws the documents' figures (``report_plots``), puts the numbers in Markdown tables with
units, and writes the HTML with the PNGs embedded (no other file needed to view it).
"""
from __future__ import annotations

import base64
import datetime
import html
import json
from pathlib import Path

from ddtrain.errors import DDTrainError
from ddtrain.report.sections import NOT_DRAWN, collectives_blocks, records_blocks, scaling_blocks


def collect(root: Path) -> dict:
    """Every result under ``root``, by kind; files that are not results are skipped."""
    found: dict = {"scaling": [], "records": [], "collectives": [], "skipped": [], "damaged": []}
    for path in sorted(root.rglob("*.json")):
        if path.name.startswith(".") or "report_files" in path.parts:
            continue
        try:
            text = path.read_text()
            data = json.loads(text)
        except OSError as exc:
            found["skipped"].append(f"{path}: cannot be read ({exc.strerror or exc})")
            continue
        except ValueError as exc:  # UnicodeDecodeError is one too
            found["damaged"].append(damaged_json(path, exc))
            continue
        if not isinstance(data, dict) or "traceEvents" in data:
            continue
        if data.get("kind") == "ddtrain-bench-scaling":
            found["scaling"].append((path, data))
        elif isinstance(data.get("rows"), list) and data["rows"] and "busbw_GBps" in data["rows"][0]:
            found["collectives"].append((path, data))
        elif "epochs" in data and "config" in data:
            found["records"].append((path, data))
    return found


def damaged_json(path: Path, exc: ValueError) -> str:
    """One line on a .json file that does not parse: cut off, or not JSON at all."""
    size = path.stat().st_size if path.exists() else 0
    if isinstance(exc, json.JSONDecodeError):
        body = exc.doc.strip()
        if not body:
            return f"{path} is damaged: it is empty ({size} bytes), not JSON (run again to rewrite it, or remove it)"
        if body[0] in "{[" and body[-1:] != {"{": "}", "[": "]"}.get(body[:1]):  # opened, never closed
            return (f"{path} is damaged: it ends before its JSON does (cut off at {size} bytes: {exc.msg}); "
                    "it was not written whole (run again to rewrite it, or remove it)")
        return f"{path} is damaged: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    return f"{path} is damaged: not a text file ({type(exc).__name__}: {str(exc)[:80]})"


def build(root: Path, out: Path, *, title: str | None = None, all_timelines: bool = False) -> dict:
    """Write the report; returns the paths written and the figures' titles."""
    if not root.is_dir():
        raise DDTrainError(f"{root} is not a folder")
    found = collect(root)
    if not (found["scaling"] or found["records"] or found["collectives"]) and found["damaged"]:
        raise DDTrainError("; ".join(found["damaged"]) + " (no other results to report)")
    if not (found["scaling"] or found["records"] or found["collectives"]):
        raise DDTrainError(f"no results under {root}: expected scaling.json (bench scaling), results records "
                           f"(train --out) or bench collectives --json output")
    files = out / "report_files"
    files.mkdir(parents=True, exist_ok=True)
    calibration = next((c["calibration"] for _, c in found["collectives"] if c.get("calibration")), None)
    blocks: list[tuple] = [("h1", title or f"ddtrain report: {root.resolve().name}"),
                           ("p", f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} from "
                                 f"`{root.resolve()}`. Every figure is defined in docs/PERFORMANCE.md.")]
    in_scaling: set[Path] = set()
    for path, result in found["scaling"]:
        blocks += scaling_blocks(path, result, files, calibration, all_timelines)
        in_scaling |= {(path.parent / c["record"]).resolve() for c in result["cells"]}
    loose = [(p, r) for p, r in found["records"] if p.resolve() not in in_scaling]
    if loose:
        blocks += records_blocks(loose, root, files)
    for path, result in found["collectives"]:
        blocks += collectives_blocks(path, result, root, files)
    if not found["collectives"]:
        blocks += [("h2", "Collectives"),
                   ("p", f"{NOT_DRAWN} the bus-bandwidth plot: no `bench collectives` output here; run "
                         f"`ddtrain bench collectives --nproc 2 --sizes 1K:4M --json {root}/collectives.json` and "
                         "report again (its calibration also gives the scaling cells' cost-model times).")]
    for note in found["skipped"] + found["damaged"]:
        blocks.append(("p", f"Skipped: {note}"))
    from ddtrain.observe.files import atomic_write
    md_path, html_path = out / "report.md", out / "report.html"
    atomic_write(md_path, lambda tmp: Path(tmp).write_text(render_md(blocks, out)))
    atomic_write(html_path, lambda tmp: Path(tmp).write_text(render_html(blocks)))
    figures = [b[2] for b in blocks if b[0] == "img"]
    missing = [b for b in blocks if b[0] == "p" and b[1].startswith("(Plot ")]
    not_drawn = [b[1][len(NOT_DRAWN):].strip() for b in blocks if b[0] == "p" and b[1].startswith(NOT_DRAWN)]
    return {"markdown": md_path, "html": html_path, "figures": figures, "plots_missing": len(missing),
            "not_drawn": not_drawn,
            "damaged": found["damaged"]}


def render_md(blocks: list[tuple], out: Path) -> str:
    lines: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "pre":
            lines += ["```", block[1], "```", ""]
        elif kind == "table":
            columns, rows = block[1], block[2]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in columns) + " |")
            lines.append("|" + "|".join("---:" if _numeric(rows, i) else "---" for i in range(len(columns))) + "|")
            lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
            lines.append("")
        elif kind == "img":
            path, title = Path(block[1]), block[2]
            lines += [f"![{title}]({path.relative_to(out)})", "", f"*{title}*", ""]
    return "\n".join(lines)


def _numeric(rows, i) -> bool:
    cells = [str(r[i]) for r in rows if str(r[i]) not in ("", "n/a", "-")]
    return bool(cells) and all(c.replace(".", "", 1).replace("-", "", 1).replace("e", "", 1).isdigit() for c in cells)


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 7px}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:1.5em 0}img{max-width:100%;border:1px solid #eee}figcaption{font-style:italic;color:#555}
pre{background:#f6f6f6;padding:.7em;overflow-x:auto;font-size:12px}code{background:#f3f3f3;padding:0 3px}"""


def _inline(text: str) -> str:
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def render_html(blocks: list[tuple]) -> str:
    title = next((b[1] for b in blocks if b[0] == "h1"), "ddtrain report")
    body: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{html.escape(block[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline(block[1])}</p>")
        elif kind == "pre":
            body.append(f"<pre>{html.escape(block[1])}</pre>")
        elif kind == "table":
            columns, rows = block[1], block[2]
            numeric = [_numeric(rows, i) for i in range(len(columns))]
            head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
            trs = ["<tr>" + "".join(f"<td{' class=n' if numeric[i] else ''}>{html.escape(str(c))}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows]
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(trs)}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(Path(block[1]).read_bytes()).decode()
            body.append(f'<figure><img alt="{html.escape(block[2])}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{html.escape(block[2])}</figcaption></figure>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
