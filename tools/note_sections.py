"""``python -m tools.note_sections``: each NOTE in the code names its section of the design document
(``# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §N``), and each section lists its NOTEs (a ``NOTEs:`` line).

    python -m tools.note_sections --check   # exit 1, naming each NOTE or section that disagrees
    python -m tools.note_sections --write   # write each NOTE's design line from the sections' lists

The sections' lists are the source: --write adds or corrects the design line of every listed NOTE (after its
``# Test:`` line, or on it where the block is at the 15-line limit) and adds to a section's list a NOTE that is
listed nowhere but already names that section.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = "DDP_GRADIENT_CHECKPOINTING_FIX.md"
MAX_LINES = 15
HEADING = re.compile(r"^(##|###) (\d+(?:\.\d+)?)\.? ")
LIST = re.compile(r"^NOTEs: ")
NOTE_DEF = re.compile(r"^(\s*)# NOTE \[([^\]]+)\]\s*$")
NOTE_REF = re.compile(r"NOTE \[([^\]\n]+)\]")
NOTE = "NOTE"  # not written out before a bracket: the layout test would read a reference here
DESIGN = re.compile(rf"(;\s*)?#?\s*Design: {re.escape(DOC)} §(\d+(?:\.\d+)?)\s*$")


def _read(rel: str) -> list[str]:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read().splitlines()


def sections() -> dict[str, list[str]]:
    """Section number -> the NOTE names its ``NOTEs:`` line lists, in the design document's order."""
    found: dict[str, list[str]] = {}
    current = None
    for line in _read(DOC):
        match = HEADING.match(line)
        if match:
            current = match.group(2)
            found[current] = []
        elif current and LIST.match(line):
            found[current] += NOTE_REF.findall(line)
    return found


def _python_files() -> list[str]:
    """The repository's Python files (git's list; a walk where there is no repository)."""
    done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode == 0:
        found = done.stdout.split()
    else:
        found = []
        for top, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            found += [os.path.relpath(os.path.join(top, n), ROOT) for n in names if n.endswith(".py")]
    return sorted(p for p in found if os.path.exists(os.path.join(ROOT, p)) and "/upstream/" not in p)


def notes() -> list[dict]:
    """Every NOTE block in the code: name, file, first line index, length, and the section it names (or None)."""
    found = []
    for rel in _python_files():
        lines = _read(rel)
        for i, line in enumerate(lines):
            match = NOTE_DEF.match(line)
            if not match:
                continue
            n = 1
            while i + n < len(lines) and lines[i + n].lstrip().startswith("#") and not NOTE_DEF.match(lines[i + n]):
                n += 1
            named = [m.group(2) for b in lines[i:i + n] if (m := DESIGN.search(b))]
            found.append({"name": match.group(2), "file": rel, "start": i, "length": n,
                          "section": named[0] if named else None})
    return found


def problems() -> list[str]:
    listed, out = sections(), []
    where: dict[str, list[str]] = {}
    for number, names in listed.items():
        for name in names:
            where.setdefault(name, []).append(number)
    defined = {note["name"]: note for note in notes()}
    for name, numbers in where.items():
        if len(numbers) > 1:
            out.append(f"{NOTE} [{name}] is listed in sections {', '.join(numbers)}: list it in one")
        if name not in defined:
            out.append(f"§{numbers[0]} lists {NOTE} [{name}], which no code defines")
    for name, note in defined.items():
        if name not in where:
            out.append(f"{note['file']}:{note['start'] + 1}: {NOTE} [{name}] is listed in no section of {DOC} "
                       "(add it to its section's NOTEs: line)")
        elif note["section"] != where[name][0]:
            out.append(f"{note['file']}:{note['start'] + 1}: {NOTE} [{name}] names section "
                       f"{note['section'] or 'none'}, but §{where[name][0]} lists it (python -m tools.note_sections "
                       "--write)")
        if note["length"] > MAX_LINES:
            out.append(f"{note['file']}:{note['start'] + 1}: {NOTE} [{name}] is {note['length']} lines "
                       f"(at most {MAX_LINES})")
    return out


def _adopt_unlisted() -> None:
    """A NOTE listed nowhere whose design line names an existing section joins that section's list."""
    listed = sections()
    everywhere = {name for names in listed.values() for name in names}
    orphans = [n for n in notes() if n["name"] not in everywhere and n["section"] in listed]
    if not orphans:
        return
    lines, current = _read(DOC), None
    for i, line in enumerate(lines):
        match = HEADING.match(line)
        if match:
            current = match.group(2)
        elif current and LIST.match(line):
            extra = [f"{NOTE} [{n['name']}]" for n in orphans if n["section"] == current]
            if extra:
                lines[i] = line.rstrip(".") + ", " + ", ".join(extra) + "."
                orphans = [n for n in orphans if n["section"] != current]
    with open(os.path.join(ROOT, DOC), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write() -> int:
    """Write each listed NOTE's design line; returns how many files changed."""
    _adopt_unlisted()
    where = {name: number for number, names in sections().items() for name in names}
    by_file: dict[str, list[dict]] = {}
    for note in notes():
        if note["name"] in where and note["section"] != where[note["name"]]:
            by_file.setdefault(note["file"], []).append(note)
    for rel, todo in by_file.items():
        lines = _read(rel)
        for note in sorted(todo, key=lambda n: -n["start"]):  # bottom up: earlier indices stay valid
            start, n = note["start"], note["length"]
            indent = NOTE_DEF.match(lines[start]).group(1)
            ref = f"Design: {DOC} §{where[note['name']]}"
            block = list(range(start, start + n))
            for i in reversed(block):  # every old reference goes first (bottom up: indices stay valid)
                if DESIGN.search(lines[i]):
                    stripped = DESIGN.sub("", lines[i]).rstrip()
                    if stripped.strip() in ("", "#"):
                        del lines[i]
                        n -= 1
                    else:
                        lines[i] = stripped
            block = list(range(start, start + n))
            tests = [i for i in block if lines[i].lstrip().startswith(("# Test:", "# Tests:"))]
            anchor = tests[-1] if tests else block[-1]
            while anchor + 1 in block and lines[anchor + 1].lstrip().startswith("# tests/"):  # a list over lines
                anchor += 1
            if n < MAX_LINES:
                lines.insert(anchor + 1, f"{indent}# {ref}")
            else:
                lines[anchor] = f"{lines[anchor].rstrip()}; {ref}"
        with open(os.path.join(ROOT, rel), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return len(by_file)


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        print(f"{write()} files updated")
        argv = ["--check"]
    if argv == ["--check"]:
        found = problems()
        print("\n".join(found) or f"every NOTE names its section of {DOC}, and every section lists its NOTEs")
        return 1 if found else 0
    print(f"tools.note_sections: expected --check or --write; found {argv or 'no argument'}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
