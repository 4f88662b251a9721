"""Every number in the docs against the raw files named beside it: writes results/claims/checklist.md.

    python tools/check_claims.py            # writes the checklist, prints the summary
    python tools/check_claims.py --strict   # exit 1 if a number is neither found nor annotated

For each document, each section (a heading and its text, plus the text of the sections above
it) names its raw files: paths under ``results/`` (globs allowed), or bare file names of a
``results/`` folder the section names. Every number of a prose line or a table row (integers
from 100 up, decimals, percentages and ratios; not flag values of a command, not "Table 5.1"
or "Fig 4.3", not model names) is looked for in those files: found when some number there
rounds to it at the doc's precision, directly, as a per cent (0.947 -> 94.7 %) or after the
unit changes the docs use (bytes -> MB, s -> ms). What is not found is listed for a person to
look at; ``results/claims/notes.tsv`` (document, number, note) records the reviewed ones
(derived by arithmetic from found figures, a setting, a figure of the source documents).
"""
from __future__ import annotations

import argparse
import glob
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "results" / "claims" / "checklist.md"
NOTES = REPO / "results" / "claims" / "notes.tsv"
DOCS = ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))

NUMBER = re.compile(r"(?<![\w.\-/+])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?\s?(%|×|x\b)?(?![\w/]|\.\d)")
NOT_A_CLAIM_BEFORE = re.compile(r"(Tables?|Figs?\.?|Figures?|§|ch\.|chapters?|issues?|[Dd]ocuments?|version|"
                                r"acceptance|step|steps|epoch|rank|ranks|rows?|line|lines|--[\w-]+|[=:])\s*$"
                                r"|(Tables?|Figs?\.?|§)\s*[\d.]+\s*[–-]\s*$")
RAW_PATH = re.compile(r"results/[\w.\-/*]+")
BARE_FILE = re.compile(r"`?([\w.\-*]+\.(?:txt|json|md|png|log))`?")
NUMBER_IN_RAW = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
SCALES = (1.0, 100.0, 0.01, 1e-6, 1e-3, 1e3, 1e-9)   # as is, fraction <-> %, B -> MB, ms <-> s, B -> GB


def sections(lines):
    """[(first line index, last line index, heading chain)] with fenced code tracked."""
    out, chain, start, fence = [], [], 0, False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"#{1,4} ", line):
            out.append((start, i, list(chain)))
            level = len(line) - len(line.lstrip("#"))
            chain = [c for c in chain if c[0] < level] + [(level, i)]
            start = i
    out.append((start, len(lines), list(chain)))
    return out


def raw_files(text: str) -> list[Path]:
    files: list[Path] = []
    folders = set()
    for ref in RAW_PATH.findall(text):
        ref = ref.rstrip(".,;:)`")
        matched = [Path(p) for p in glob.glob(str(REPO / ref))]
        for m in matched:
            if m.is_dir():
                folders.add(m)
                files += [p for p in m.rglob("*") if p.is_file()]
            else:
                folders.add(m.parent)
                files.append(m)
    for name in BARE_FILE.findall(text):
        for folder in folders:
            files += [Path(p) for p in glob.glob(str(folder / name))]
    return sorted(set(files))


_cache: dict[Path, tuple[list[float], set[str]]] = {}


def numbers_in(path: Path) -> tuple[list[float], set[str]]:
    """The numbers of a raw file, as values and as written."""
    if path not in _cache:
        tokens = []
        if path.suffix not in (".png", ".gz") and path.stat().st_size < 20_000_000:
            tokens = NUMBER_IN_RAW.findall(path.read_text(errors="replace").replace(",", ""))
        _cache[path] = ([float(t) for t in tokens], set(tokens))
    return _cache[path]


def significant_digits(written: str) -> int:
    return len(re.sub(r"[^0-9]", "", written).lstrip("0"))


def claims(line: str):
    """(number as written, value, decimals) for each checkable number on a line."""
    if line.lstrip().startswith(("$ ", "python", "ddtrain", "sudo", "torchrun", "PYTHONPATH", "bash ", "pip ")):
        return
    for m in NUMBER.finditer(line):
        whole, frac, unit = m.group(1), m.group(2) or "", m.group(3) or ""
        before = line[:m.start()]
        if NOT_A_CLAIM_BEFORE.search(before) or re.search(r"[A-Za-z]$", before):
            continue
        value = float(whole.replace(",", "") + frac)
        decimals = len(frac) - 1 if frac else 0
        if not frac and not unit and value < 100:
            continue            # small integers are counts and settings (4 ranks, 2 epochs), not measurements
        if not frac and 1900 <= value <= 2100 and not unit:
            continue            # years
        yield m.group(0).strip(), value, decimals


def found(written: str, value: float, decimals: int, files: list[Path]):
    """The first file holding the number: rounded from any number there when it has 3 or more
    significant digits or 3 or more decimals; written the same way otherwise (0.5 rounds from too much)."""
    tolerance = 0.5 * 10 ** -decimals + 1e-9
    literal = re.sub(r"[^0-9.]", "", written)
    # 3 decimals bound the match as tightly as 3 significant digits do below 1 (0.081 as 0.334: +-0.0005)
    precise = significant_digits(literal) >= 3 or decimals >= 3
    for path in files:
        values, tokens = numbers_in(path)
        if not precise:
            if literal in tokens:
                return path
            continue
        # JSON holds seconds and fractions: ms (x 1e3) and per cent (x 100) as well as the value
        scales = SCALES if path.suffix in (".txt", ".md", ".log") else (1.0, 100.0, 0.01, 1e3)
        for v in values:
            for scale in scales:
                if abs(v * scale - value) <= tolerance:
                    return path
    return None


def load_notes() -> dict:
    notes = {}
    if NOTES.exists():
        for row in NOTES.read_text().splitlines():
            if row.strip() and not row.startswith("#"):
                doc, number, note = (row.split("\t") + ["", ""])[:3]
                notes[(doc, number)] = note
    return notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 when a number is neither found nor annotated")
    args = parser.parse_args(argv)
    notes = load_notes()
    out = ["# Numbers in the docs and the raw files they come from", "",
           "Written by `python tools/check_claims.py` (see its docstring for the rules). Status: **found** "
           "(a number in the named raw file rounds to it), **note** (reviewed by hand: the note says why it has "
           "no raw file of its own), **unchecked** (neither: to fix). "
           "Documents: README.md and every docs/*.md.", "",
           "Limits: *found* means some number in the named file rounds to the doc's at its precision (numbers "
           "of fewer than 3 significant digits and 3 decimals must appear as written), not that it sits in the "
           "same row; integers below 100 without a unit (counts and settings: 4 ranks, 2 epochs) are not checked.", ""]
    totals = {"found": 0, "note": 0, "unchecked": 0}
    for doc in DOCS:
        lines = (REPO / doc).read_text().splitlines()
        rows = []
        for start, end, chain in sections(lines):
            context = "\n".join(lines[i] for _, i in chain[:-1]) + "\n" + "\n".join(lines[start:end])
            # a parent section's own text (up to its first subsection) also names files for its children
            for _level, i in chain[:-1]:
                j = i + 1
                while j < len(lines) and not re.match(r"#{1,4} ", lines[j]):
                    j += 1
                context += "\n" + "\n".join(lines[i:j])
            files = raw_files(context)
            for n in range(start, end):
                for written, value, decimals in claims(lines[n]):
                    where = found(written, value, decimals, files)
                    note = notes.get((doc, written))
                    if where is not None:
                        status, source = "found", str(where.relative_to(REPO))
                    elif note is not None:
                        status, source = "note", note
                    else:
                        status, source = "unchecked", ", ".join(str(f.relative_to(REPO)) for f in files[:3]) or "-"
                    totals[status] += 1
                    rows.append(f"| {n + 1} | {written} | {status} | {source} |")
        out += [f"## {doc}", "", "| line | number | status | raw file (or note) |", "|---:|---|---|---|", *rows, ""]
    summary = (f"{sum(totals.values())} numbers: {totals['found']} found in their raw file, {totals['note']} "
               f"reviewed with a note, {totals['unchecked']} unchecked")
    out.insert(4, f"**{summary}.**\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(out) + "\n")
    print(summary)
    print(f"written: {OUT.relative_to(REPO)}")
    return 1 if args.strict and totals["unchecked"] else 0


if __name__ == "__main__":
    sys.exit(main())
