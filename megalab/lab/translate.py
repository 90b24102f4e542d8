"""Translations of the course, kept in step with the English: one source of truth, generated notebooks.

The English notebooks are the source. A translation is a Markdown file per notebook beside the glossary,
course/<lang>/<chapter>/<notebook>.md, one section per markdown cell of the English notebook:

    <!-- cell 5f3a1c2e · en 9b1d0c44e2a7 -->
    ## 数据并行 (data parallelism)
    每个 rank 持有完整的模型 ...

`cell` is the English cell's id, `en` the first 12 hex digits of the SHA-256 of its source when it was
translated. `megalab translate status` lists what is missing or stale (the English changed since);
`megalab translate build` writes the translated notebooks: the English notebook with each markdown
cell's source replaced, code cells and their outputs untouched, so they are graded exactly like the
English ones. `megalab translate stub NOTEBOOK` appends a section (the English text, to be replaced)
for every cell that has none or whose English changed, for a translator to fill.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

LANGS = {"zh": "简体中文"}
COURSE = "course"
_SECTION = re.compile(r"^<!-- cell (?P<id>[\w-]+) · en (?P<sha>[0-9a-f]{12}) -->[ \t]*$", re.MULTILINE)
GENERATED = "build/{lang}"  # where `build` writes the translated course (a tree like the repository's)


class TranslationError(ValueError):
    """A translation file is malformed, or a language is unknown; the message says where and what to do."""


def en_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:12]


@dataclass
class Section:
    cell: str
    en: str  # hash of the English source it translates
    text: str


@dataclass
class NotebookStatus:
    notebook: str  # the English notebook, relative to the root
    cells: int  # markdown cells in the English notebook
    done: int  # translated and current
    missing: list[str] = field(default_factory=list)  # cell ids without a translation
    stale: list[str] = field(default_factory=list)  # cell ids whose English changed since
    orphans: list[str] = field(default_factory=list)  # sections for cells the notebook no longer has

    @property
    def ok(self) -> bool:
        return not (self.missing or self.stale or self.orphans)


def _check_lang(lang: str) -> None:
    if lang not in LANGS:
        raise TranslationError(f"no translation {lang!r}; the course has: {', '.join(LANGS)}")


def source_of(root: Path, notebook: str, lang: str) -> Path:
    """course/01_x/02_y.ipynb -> course/<lang>/01_x/02_y.md"""
    rel = Path(notebook).relative_to(COURSE)
    return root / COURSE / lang / rel.with_suffix(".md")


def read_sections(path: Path) -> dict[str, Section]:
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    marks = list(_SECTION.finditer(text))
    if text[: marks[0].start() if marks else len(text)].strip():
        raise TranslationError(f"{path}: text before the first `<!-- cell ID · en HASH -->` line; every section "
                               "starts with one")
    sections = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        body = text[m.end() : nxt.start() if nxt else len(text)].strip("\n")
        if m["id"] in sections:
            raise TranslationError(f"{path}: cell {m['id']} is translated twice; keep one section")
        sections[m["id"]] = Section(m["id"], m["sha"], body)
    return sections


def write_sections(path: Path, sections: list[Section]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(f"<!-- cell {s.cell} · en {s.en} -->\n{s.text.strip()}" for s in sections) + "\n",
                    encoding="utf-8")


def _markdown_cells(nb) -> list:
    cells = [c for c in nb.cells if c.cell_type == "markdown"]
    missing = [i for i, c in enumerate(nb.cells) if "id" not in c]
    if missing:
        raise TranslationError(f"cells {missing} have no id (nbformat 4.5 ids are what translations are keyed by)")
    return cells


def english_notebooks(root: Path) -> list[str]:
    from megalab.lab.notebooks import find_notebooks

    return [p.relative_to(root).as_posix() for p in find_notebooks([str(root / COURSE)])
            if p.relative_to(root / COURSE).parts[0] not in LANGS and not p.name.startswith(".")]


def status(root: Path, lang: str, notebooks: list[str] | None = None) -> list[NotebookStatus]:
    import nbformat

    _check_lang(lang)
    out = []
    for rel in notebooks or english_notebooks(root):
        cells = _markdown_cells(nbformat.read(root / rel, as_version=4))
        sections = read_sections(source_of(root, rel, lang))
        st = NotebookStatus(rel, len(cells), 0)
        for c in cells:
            s = sections.get(c.id)
            if s is None or s.text.startswith(f"TODO({lang})"):
                st.missing.append(c.id)
            elif s.en != en_hash(c.source):
                st.stale.append(c.id)
            else:
                st.done += 1
        st.orphans = sorted(set(sections) - {c.id for c in cells})
        out.append(st)
    return out


def translated(root: Path, notebook: str, lang: str, allow_missing: bool = False):
    """The English notebook with its markdown in `lang` (code cells and outputs untouched)."""
    import nbformat

    _check_lang(lang)
    nb = nbformat.read(root / notebook, as_version=4)
    sections = read_sections(source_of(root, notebook, lang))
    for c in _markdown_cells(nb):
        s = sections.get(c.id)
        if s is None or s.en != en_hash(c.source) or s.text.startswith(f"TODO({lang})"):
            if allow_missing:
                continue
            why = "has no translation" if s is None else "changed since it was translated"
            raise TranslationError(f"{notebook}: cell {c.id} {why}; run `megalab translate stub {notebook}` and "
                                   f"translate it in {source_of(root, notebook, lang).relative_to(root)}")
        c.source = s.text
    nb.metadata["language_info_human"] = LANGS[lang]
    nb.metadata.setdefault("megalab", {})["translated_from"] = notebook
    return nb


def build(root: Path, lang: str, out: Path | None = None, allow_missing: bool = False) -> list[Path]:
    """Write every translated notebook under `out` (default build/<lang>/), at the English notebook's path."""
    import nbformat

    out = out or root / GENERATED.format(lang=lang)
    written = []
    for rel in english_notebooks(root):
        nb = translated(root, rel, lang, allow_missing)
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, path)
        written.append(path)
    return written


def stub(root: Path, notebook: str, lang: str) -> int:
    """Add a section (the English text, to translate) for each cell with none or a stale one; returns how many."""
    import nbformat

    _check_lang(lang)
    path = source_of(root, notebook, lang)
    sections = read_sections(path)
    cells = _markdown_cells(nbformat.read(root / notebook, as_version=4))
    ordered, added = [], 0
    for c in cells:
        s = sections.get(c.id)
        if s is None or s.en != en_hash(c.source):
            note = "" if s is None else f"<!-- was: {json.dumps(s.text[:60], ensure_ascii=False)} -->\n"
            s = Section(c.id, en_hash(c.source), f"{note}TODO({lang}):\n{c.source}")
            added += 1
        ordered.append(s)
    write_sections(path, ordered)
    return added
