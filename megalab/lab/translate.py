"""Translations of the course, kept in step with the English: one source of truth, generated notebooks.

The English notebooks are the source. A translation is a Markdown file per notebook beside the glossary,
course/<lang>/<chapter>/<notebook>.md, one section per markdown cell of the English notebook, then one per
exercise the notebook teaches (its task and hints, as `megalab student --lang` writes them into the code):

    <!-- cell 5f3a1c2e · en 9b1d0c44e2a7 -->
    ## 数据并行
    每个 rank 持有完整的模型 ...

    <!-- exercise dp.bucket_grads · en 41c0aa9e07d3 -->
    task: 把每个参数的梯度 ...
    hint 1: ...

`cell` is the English cell's id (an exercise's is its id), `en` the first 12 hex digits of the SHA-256 of
the English text when it was translated. `megalab translate status` lists what is missing or stale (the English changed since);
`megalab translate build` writes the translated notebooks: the English notebook with each markdown
cell's source replaced, code cells and their outputs untouched, so they are graded exactly like the
English ones. `megalab translate stub NOTEBOOK` appends a section (the English text, to be replaced)
for every cell that has none or whose English changed, for a translator to fill.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

LANGS = {"zh": "简体中文"}
COURSE = "course"
_SECTION = re.compile(r"^<!-- (?P<kind>cell|exercise) (?P<id>[\w.-]+) · en (?P<sha>[0-9a-f]{12}) -->[ \t]*$",
                      re.MULTILINE)
_EXERCISE_KEYWORD = re.compile(r"^(?:task|hint \d+):", re.MULTILINE)
_EXERCISE_LINE = re.compile(r"^(?:task|hint (?P<level>\d+)):[ \t]*(?P<text>.*)$")
GENERATED = "build/{lang}"  # where `build` writes the translated course (a tree like the repository's)


class TranslationError(ValueError):
    """A translation file is malformed, or a language is unknown; the message says where and what to do."""


def en_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:12]


@dataclass
class Section:
    cell: str  # the English cell's id, or the exercise's
    en: str  # hash of the English source it translates
    text: str
    kind: str = "cell"  # or "exercise"

    @property
    def key(self) -> str:
        return self.cell if self.kind == "cell" else f"exercise {self.cell}"


@dataclass
class NotebookStatus:
    notebook: str  # the English notebook, relative to the root
    cells: int  # markdown cells in the English notebook
    done: int  # translated and current
    missing: list[str] = field(default_factory=list)  # cell ids without a translation ("exercise ID" for one)
    stale: list[str] = field(default_factory=list)  # cell ids whose English changed since
    orphans: list[str] = field(default_factory=list)  # sections for cells the notebook no longer has
    exercises: int = 0  # exercises the notebook teaches
    exercises_done: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.stale or self.orphans)


def _state(s: Section | None, english: str, lang: str) -> str:
    """"missing" (none, or a `TODO(lang):` that `stub` wrote), "stale" (the English changed since) or "current"."""
    if s is None or re.search(rf"^TODO\({lang}\):", s.text, re.MULTILINE):
        return "missing"
    return "current" if s.en == en_hash(english) else "stale"


def _why(state: str) -> str:
    return "has no translation" if state == "missing" else "changed since it was translated"


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
    for bad in re.finditer(r"^<!-- (?:cell|exercise)\b.*$", text, re.MULTILINE):
        if not _SECTION.fullmatch(bad[0]):
            line = text.count("\n", 0, bad.start()) + 1
            raise TranslationError(f"{path}:{line}: malformed section line {bad[0]!r}; it must read "
                                   "`<!-- cell ID · en HASH -->` (or `exercise ID`) as `megalab translate stub` wrote it")
    sections = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        body = text[m.end() : nxt.start() if nxt else len(text)].strip("\n")
        s = Section(m["id"], m["sha"], body, m["kind"])
        if s.key in sections:
            raise TranslationError(f"{path}: {m['kind']} {m['id']} is translated twice; keep one section")
        sections[s.key] = s
    return sections


def write_sections(path: Path, sections: list[Section]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(f"<!-- {s.kind} {s.cell} · en {s.en} -->\n{s.text.strip()}" for s in sections)
                    + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- exercises: task and hints


def exercise_english(ex) -> str:
    """An exercise's text as its translation section holds it: `task:` then `hint n:` lines."""
    return "\n".join([f"task: {ex.task}"] + [f"hint {i}: {h}" for i, h in enumerate(ex.hints, 1)])


def parse_exercise(text: str, where: str, levels: int) -> tuple[str, list[str]]:
    """`task: ...` / `hint n: ...` lines (a line that starts with neither continues the one above)."""
    task, hints = None, []
    for line in text.strip().splitlines():
        m = _EXERCISE_LINE.match(line)
        if m is None and (task is not None) and line.strip():
            if hints:
                hints[-1] += " " + line.strip()
            else:
                task += " " + line.strip()
            continue
        if m is None:
            continue
        if m["level"] is None:
            task = m["text"].strip()
        elif int(m["level"]) != len(hints) + 1:
            raise TranslationError(f"{where}: `hint {m['level']}` comes after {len(hints)} hint(s); number them 1, 2, ...")
        else:
            hints.append(m["text"].strip())
    if not task:
        raise TranslationError(f"{where}: no `task:` line")
    if len(hints) != levels:
        raise TranslationError(f"{where}: {len(hints)} hint(s), the English has {levels}; translate each level")
    return task, hints


def _exercises_by_notebook(root: Path) -> dict[str, list]:
    from megalab.lab.exercises import load

    out: dict[str, list] = {}
    for ex in load(root).exercises.values():
        if ex.notebook:
            out.setdefault(ex.notebook, []).append(ex)
    return out


def exercise_translations(root: Path, lang: str) -> dict[str, tuple[str, list[str]]]:
    """{exercise id: (task, hints)} in `lang`, for every exercise; a missing or stale one raises."""
    _check_lang(lang)
    out = {}
    for notebook, exercises in _exercises_by_notebook(root).items():
        path = source_of(root, notebook, lang)
        sections = read_sections(path)
        for ex in exercises:
            s = sections.get(f"exercise {ex.id}")
            state = _state(s, exercise_english(ex), lang)
            if state != "current":
                raise TranslationError(f"exercise {ex.id} (task or hints) {_why(state)}; run `megalab translate stub "
                                       f"{notebook}` and translate it in {path.relative_to(root)}")
            out[ex.id] = parse_exercise(s.text, f"{path.relative_to(root)}: exercise {ex.id}", len(ex.hints))
    return out


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


def _units(root: Path, notebook: str, by_notebook: dict[str, list]) -> list[tuple[str, str, str]]:
    """What a notebook's translation holds, in order: (section key, kind, English) for each markdown cell, then
    for each exercise it teaches."""
    import nbformat

    units = [(c.id, "cell", c.source) for c in _markdown_cells(nbformat.read(root / notebook, as_version=4))]
    return units + [(f"exercise {ex.id}", "exercise", exercise_english(ex)) for ex in by_notebook.get(notebook, [])]


def status(root: Path, lang: str, notebooks: list[str] | None = None) -> list[NotebookStatus]:
    _check_lang(lang)
    out, by_notebook = [], _exercises_by_notebook(root)  # the registry, read once
    for rel in notebooks or english_notebooks(root):
        units, sections = _units(root, rel, by_notebook), read_sections(source_of(root, rel, lang))
        st = NotebookStatus(rel, sum(kind == "cell" for _, kind, _ in units), 0,
                            exercises=sum(kind == "exercise" for _, kind, _ in units))
        for key, kind, english in units:
            state = _state(sections.get(key), english, lang)
            if state == "current":
                st.done += kind == "cell"
                st.exercises_done += kind == "exercise"
            else:
                (st.missing if state == "missing" else st.stale).append(key)
        st.orphans = sorted(set(sections) - {key for key, _, _ in units})
        out.append(st)
    return out


_CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"  # CJK punctuation, ideographs, full-width forms
_SOFT_BREAK = re.compile(rf"(?<=[{_CJK}])\n(?=[{_CJK}])")


def join_lines(markdown: str) -> str:
    """Join a paragraph's lines where both sides are Chinese: a browser shows a line break inside a paragraph
    as a space, which Chinese text must not have. Code blocks and headings keep their lines."""
    parts = re.split(r"(^```.*?^```[ \t]*$)", markdown, flags=re.MULTILINE | re.DOTALL)
    for i in range(0, len(parts), 2):  # the even parts are outside code blocks
        lines = parts[i].split("\n")
        out = lines[:1]
        for line in lines[1:]:
            if out[-1] and not out[-1].lstrip().startswith("#") and _SOFT_BREAK.search(
                    out[-1][-1:] + "\n" + line.lstrip()[:1]):
                out[-1] += line.lstrip()
            else:
                out.append(line)
        parts[i] = "\n".join(out)
    return "".join(parts)


def translated(root: Path, notebook: str, lang: str, allow_missing: bool = False):
    """The English notebook with its markdown in `lang` (code cells and outputs untouched)."""
    import nbformat

    _check_lang(lang)
    nb = nbformat.read(root / notebook, as_version=4)
    sections = read_sections(source_of(root, notebook, lang))
    for c in _markdown_cells(nb):
        s = sections.get(c.id)
        state = _state(s, c.source, lang)
        if state != "current":
            if allow_missing:
                continue
            raise TranslationError(f"{notebook}: cell {c.id} {_why(state)}; run `megalab translate stub {notebook}` "
                                   f"and translate it in {source_of(root, notebook, lang).relative_to(root)}")
        c.source = with_glosses(join_lines(s.text), diagram_words(root, lang))
    nb.metadata.setdefault("megalab", {}).update(lang=lang, translated_from=notebook)
    return nb


_CODE_LANGS = {"python", "py", "bash", "sh", "shell", "console", "json", "yaml", "toml", "text"}
_DIAGRAM = re.compile(r"^```(?P<lang>[\w-]*)[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
GLOSS = "图中英文："  # the line a built notebook adds under a diagram whose labels stay English


def diagram_words(root: Path, lang: str) -> list[tuple[str, str]]:
    """(English word, translation) for a diagram's labels: the glossary's DIAGRAM section, then its terms whose
    translation is not the English itself."""
    if not (root / GLOSSARY.format(lang=lang)).is_file():
        return []
    words = [(alt.strip(), tr) for en, tr in _tables(root, lang).get("DIAGRAM", []) for alt in en.split(" / ")]
    for term in glossary(root, lang):
        words += [(alt, term.translation) for alt in term.english if alt.lower() != term.translation.lower()]
    return words


def diagram_gloss(diagram: str, words: list[tuple[str, str]]) -> str | None:
    """`图中英文：forward 前向 · bucket 桶 · ...`: the translation of each label word of `diagram` that `words`
    knows (in the diagram's order, once each), or None when it has none."""
    found: list[tuple[int, int, str, str]] = []  # (start, end, the label as written, its translation)
    for en, tr in words:
        m = Term([en], tr).pattern.search(diagram)
        if m and en.lower() != tr.lower() and all(tr != t for _, _, _, t in found) and all(
                not (a <= m.start() < b) for a, b, _, _ in found):
            found.append((m.start(), m.end(), m[0], tr))
    return GLOSS + " · ".join(f"{en} {tr}" for _, _, en, tr in sorted(found)) if found else None


def with_glosses(markdown: str, words: list[tuple[str, str]]) -> str:
    """`markdown` with a gloss line (*图中英文：...*) under each diagram (a fenced block that is not code) whose
    English labels the glossary translates, unless the translation already glosses it."""
    out, at = [], 0
    for m in _DIAGRAM.finditer(markdown):
        out.append(markdown[at : m.end()])
        at = m.end()
        if m["lang"].lower() in _CODE_LANGS or markdown[at:].lstrip("\n").startswith(("*" + GLOSS, GLOSS, "图中")):
            continue
        gloss = diagram_gloss(m["body"], words)
        if gloss:
            out.append(f"\n\n*{gloss}*")
    return "".join(out) + markdown[at:]


# --------------------------------------------------------------------------- the glossary

GLOSSARY = "course/{lang}/GLOSSARY.md"
_ROW = re.compile(r"^\|\s*(?P<en>[^|]+?)\s*\|\s*(?P<tr>[^|]+?)\s*\|")
_NOT_PROSE = re.compile(r"```.*?```|`[^`]*`|\]\([^)]*\)|<!--.*?-->|https?://\S+|\$[^$\n]+\$", re.DOTALL)


@dataclass
class Term:
    english: list[str]  # alternatives
    translation: str

    @property
    def pattern(self) -> re.Pattern:
        words = "|".join(r"[ -]?".join(map(re.escape, re.split(r"[ -]", alt))) for alt in self.english)
        return re.compile(rf"(?<!\w)(?:{words})(?:s|es|ism|isms)?(?!\w)", re.IGNORECASE)


def _tables(root: Path, lang: str) -> dict[str, list[tuple[str, str]]]:
    """The glossary's table rows (first two columns) by section: "" for the terms at the top, then each `## `
    section's title up to its first space (e.g. "AVOID", "LABELS", "FIRST")."""
    path = root / GLOSSARY.format(lang=lang)
    if not path.is_file():
        raise TranslationError(f"{path.relative_to(root)} is missing; the translation's terms are fixed there")
    tables: dict[str, list[tuple[str, str]]] = {"": []}
    section = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].split()[0]
            tables.setdefault(section, [])
        m = _ROW.match(line)
        if m and not set(m["en"]) <= set("-: ") and not set(m["tr"]) <= set("-: ") and m["en"] not in (
                "English", "用", "English heading", "English sentence", "中文"):
            tables[section].append((m["en"].replace("\\|", "|"), m["tr"].replace("\\|", "|")))
    return tables


def glossary(root: Path, lang: str) -> list[Term]:
    """The glossary's terms: the rows `| English / alternative | translation | note |` of its first table."""
    return [Term([alt.strip() for alt in en.split(" / ")], tr) for en, tr in _tables(root, lang)[""]]


def avoided(root: Path, lang: str) -> list[tuple[str, str]]:
    """(the rendering to avoid, the one to use) of the glossary's AVOID section: one idea, one word."""
    return [(bad.strip(), use) for use, bads in _tables(root, lang).get("AVOID", []) for bad in bads.split(" / ")]


def first_use(root: Path, lang: str) -> list[tuple[str, str]]:
    """(translation, English) of the glossary's FIRST section: at its first use in a notebook the translation is
    followed by the English term in brackets, e.g. 数据并行（data parallelism）."""
    return _tables(root, lang).get("FIRST", [])


def labels(root: Path, lang: str) -> list[tuple[str, str]]:
    """(English, translation) of the glossary's LABELS section: the fixed headings and sentences, said one way.
    A heading is `## Label` (it may go on: `## Run: ...`, `## Build 1`); a sentence's `{name}` is a list of code
    spans (", " between them in English, "、" in the translation)."""
    return _tables(root, lang).get("LABELS", [])


def _label_problems(pairs: list[tuple[str, str]], english: str, translation: str) -> list[str]:
    """How `translation` says a fixed label or sentence of `english` other than the glossary's way."""
    out = []
    en_lines, tr_lines = english.splitlines(), translation.splitlines()
    for en, tr in pairs:
        if en.startswith("#"):
            for line in en_lines:
                m = re.match(rf"{re.escape(en)}(?P<rest>$|[: ]\s*\S.*)", line)
                if m:
                    rest = m["rest"].strip(": ")
                    ok = [t for t in tr_lines if t.startswith(tr) and (not rest or t[len(tr):][:1] in ("：", " "))]
                    if not ok:
                        out.append(f"{line!r} -> {tr}{'：…' if m['rest'].startswith(':') else ' …' if rest else ''}")
            continue
        spans = r"`[^`]+`(?:, `[^`]+`)*"
        parts = re.split(r"(\{\w+\})", en)
        pattern = "".join(f"(?P<{part[1:-1]}>{spans})" if part.startswith("{") else re.escape(part) for part in parts)
        for m in re.finditer(pattern, english):
            said = tr.format(**{k: v.replace(", ", "、") for k, v in m.groupdict().items()})
            if said not in translation:
                out.append(f"{m[0][:40]!r}… -> {said}")
    return out


def first_at(text: str, term: str, longer: list[str]) -> int:
    """Where `term` first stands on its own in `text` (not inside one of the `longer` terms that hold it), or -1."""
    covered = {i for big in longer for m in re.finditer(re.escape(big), text) for i in range(m.start(), m.end())}
    return next((m.start() for m in re.finditer(re.escape(term), text) if m.start() not in covered), -1)


def _first_use_problems(pairs: list[tuple[str, str]], english: str, sections: list[str],
                        terms: list[Term]) -> list[str]:
    """Each FIRST term the notebook's English uses whose first translation in prose (cell order, headings and
    code left out; not inside a longer glossary term, e.g. 专家数据并行) is not followed by the English in brackets."""
    out = []
    prose = [_NOT_PROSE.sub(" ", "\n".join(line for line in text.splitlines() if not line.startswith("#")))
             for text in sections]
    for tr, en in pairs:
        if not Term([en], tr).pattern.search(_NOT_PROSE.sub(" ", english)):
            continue
        longer = [t.translation for t in terms if tr in t.translation and t.translation != tr]
        for text in prose:
            at = first_at(text, tr, longer)
            if at >= 0:
                if not re.match(rf"[（(]{re.escape(en)}", text[at + len(tr):].lstrip(), re.IGNORECASE):
                    out.append(f"first {tr!r} -> {tr}（{en}）")
                break
    return out


def _squash(text: str) -> str:
    return re.sub(r"[\s-]", "", text.lower())


def glossary_misses(terms: list[Term], english: str, translation: str) -> list[str]:
    """The glossary terms `english` uses in prose whose fixed translation `translation` lacks."""
    prose, target = _NOT_PROSE.sub(" ", english), _squash(translation)
    return [f"{t.pattern.search(prose)[0]!r} -> {t.translation}" for t in terms
            if t.pattern.search(prose) and _squash(t.translation) not in target]


def glossary_problems(root: Path, lang: str, notebooks: list[str] | None = None) -> list[str]:
    """Every current translation that leaves a glossary term out (`notebook: cell ID: 'term' -> 译法`), uses a
    rendering the glossary avoids, says a fixed label or sentence another way, or gives a FIRST term without its
    English at its first use in the notebook."""
    terms, problems = glossary(root, lang), []
    avoid, fixed, first = avoided(root, lang), labels(root, lang), first_use(root, lang)
    by_notebook = _exercises_by_notebook(root)
    for rel in notebooks or english_notebooks(root):
        sections = read_sections(source_of(root, rel, lang))
        current, whole = [], []
        for key, kind, english in _units(root, rel, by_notebook):
            if _state(sections.get(key), english, lang) != "current":
                continue  # missing or stale: `status` says so
            text = sections[key].text
            where = f"{rel}: {'cell ' if kind == 'cell' else ''}{key}"
            prose = _EXERCISE_KEYWORD.sub("", english) if kind == "exercise" else english  # not `hint 1:`
            problems += [f"{where}: {miss}" for miss in glossary_misses(terms, prose, text)]
            said = _NOT_PROSE.sub(" ", text)
            problems += [f"{where}: {bad!r} -> {use}" for bad, use in avoid if bad in said]
            problems += [f"{where}: {miss}" for miss in _label_problems(fixed, english, text)]
            if kind == "cell":
                current.append(text)
                whole.append(english)
        problems += [f"{rel}: {miss}" for miss in _first_use_problems(first, "\n".join(whole), current, terms)]
    return problems


def edition(root: Path, lang: str):
    """The whole course in `lang` for a learner's copy (`megalab workspace/student --lang`): every notebook and
    every exercise's words; anything missing or stale is an error that says what to translate."""
    from megalab.lab.exercises import Edition

    try:
        words = exercise_translations(root, lang)
        return Edition(lang, {rel: translated(root, rel, lang) for rel in english_notebooks(root)}, words)
    except TranslationError as exc:
        raise TranslationError(f"the {lang} edition is not complete: {exc}") from None


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
    if (root / GLOSSARY.format(lang=lang)).is_file():  # the notebooks link to it (../<lang>/GLOSSARY.md)
        (out / GLOSSARY.format(lang=lang)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / GLOSSARY.format(lang=lang), out / GLOSSARY.format(lang=lang))
    return written


def _was(s: Section | None) -> str:
    """On a stale section's TODO line: the start of its old translation, to rework rather than redo."""
    return "" if s is None else f" was {json.dumps(s.text[:80], ensure_ascii=False)}"


def stub(root: Path, notebook: str, lang: str) -> int:
    """Mark `TODO(lang):` (with the English to translate) every section that is missing or stale, in the
    notebook's order; returns how many. Sections of cells the notebook no longer has are dropped."""
    _check_lang(lang)
    path = source_of(root, notebook, lang)
    sections = read_sections(path)
    ordered, added = [], 0
    for key, kind, english in _units(root, notebook, _exercises_by_notebook(root)):
        s = sections.get(key)
        if s is None or s.en != en_hash(english):
            s = Section(key.removeprefix("exercise "), en_hash(english), f"TODO({lang}):{_was(s)}\n{english}", kind)
            added += 1
        ordered.append(s)
    write_sections(path, ordered)
    return added
