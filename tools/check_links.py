"""Every relative link in README.md, the design document and docs/**/*.md resolves: the file exists and, for a Markdown target, the
#anchor is one of its headings (GitHub's slugs). Anchors into the design document are refused: it is rewritten
as a whole, so link the file.

    python -m tools.check_links        # prints each broken link; exit 1 if any
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_ANCHORS = {"DDP_GRADIENT_CHECKPOINTING_FIX.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list[str]:
    found = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "DDP_GRADIENT_CHECKPOINTING_FIX.md")]
    for top, _, names in os.walk(os.path.join(ROOT, "docs")):
        found += [os.path.join(top, n) for n in sorted(names) if n.endswith(".md")]
    return found


def slugs(path: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
            if in_fence or not line.startswith("#"):
                continue
            text = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken() -> list[str]:
    problems = []
    for page in pages():
        with open(page, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                path = page if not file else os.path.normpath(os.path.join(os.path.dirname(page), file))
                where = f"{os.path.relpath(page, ROOT)}:{number}: {target}"
                if not os.path.exists(path):
                    problems.append(f"{where} (no such file)")
                elif anchor and os.path.basename(path) in NO_ANCHORS:
                    problems.append(f"{where} (link the design document's file, not an anchor)")
                elif anchor and path.endswith(".md") and anchor not in slugs(path):
                    problems.append(f"{where} (no heading with that anchor)")
    return problems


def main() -> int:
    problems = broken()
    print("\n".join(problems) or f"{len(pages())} pages: every relative link resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
