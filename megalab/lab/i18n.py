"""The tools' messages in the learner's language: a catalog keyed by the English text.

    say("Hint {level} of {levels} for {id} ({kind}):", lang, level=1, levels=2, id="dp.x", kind=...)

looks the English template up in megalab/lab/messages_<lang>.toml (its [frames] table) and fills it; with no
translation (English, or a frame not translated yet) the English is filled. The likely-mistake diagnoses
that checks and tests raise (`mistake(NAME, detail)`, megalab/lab/checks.py) are translated where they are
shown: `diagnosis(text, lang)` replaces "likely mistake: NAME" by the catalog's [diagnoses] entry for NAME (a
NAME built with an f-string is keyed by its template, each `{}` one value, filled in order or by `{0}`, `{1}`).
Statuses that tools parse (passed, failed, ...) stay English in tables and JSON, with the Chinese beside.

Tables are aligned by display columns: a CJK character takes two (`cols`, `pad`, `clip`).
tests/test_i18n.py lists every frame and diagnosis of the code that has no translation.
"""

from __future__ import annotations

import functools
import json
import re
import string
import unicodedata
from pathlib import Path

HERE = Path(__file__).resolve().parent
CATALOG = "messages_{lang}.toml"
MESSAGES = "megalab/lab/" + CATALOG  # where the catalog lives in the repository
MISTAKE = "likely mistake: "
_END = r"(?=$| — |\)|\n)"  # where a diagnosis ends: its detail, the verdict's parenthesis, the line


def lang_of(root) -> str:
    """The language of the workspace at `root` ("en" for the reference or a plain copy)."""
    path = Path(root) / ".megalab" / "workspace.json"
    try:
        return json.loads(path.read_text()).get("lang") or "en"
    except (OSError, ValueError):
        return "en"


@functools.cache
def catalog(lang: str) -> dict[str, dict[str, str]]:
    """{"frames": {English: translation}, "lines": {...}, "diagnoses": {...}} for `lang` (empty for English)."""
    import tomllib

    path = HERE / CATALOG.format(lang=lang)
    data = tomllib.loads(path.read_text(encoding="utf-8")) if lang != "en" and path.is_file() else {}
    return {kind: dict(data.get(kind, {})) for kind in ("frames", "lines", "diagnoses")}


def say(template: str, lang: str = "en", **values) -> str:
    """`template` (English, str.format fields) in `lang`, filled with `values`."""
    return catalog(lang)["frames"].get(template, template).format(**values)


# --------------------------------------------------------------------------- diagnoses


def _pattern(template: str) -> re.Pattern:
    """A regex matching what `template` (a str.format template with `{}` fields) renders to, one group per field."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append("(.+?)")
    return re.compile("".join(parts) + _END, re.DOTALL)


@functools.cache
def _compiled(lang: str) -> list[tuple[re.Pattern, str, int]]:
    """(pattern, translation, length of the English) for every diagnosis, the longest English first."""
    items = catalog(lang)["diagnoses"].items()
    return sorted(((_pattern(en), zh, len(en)) for en, zh in items), key=lambda t: -t[2])


def diagnosis(text: str, lang: str = "en") -> str:
    """`text` (a verdict) with each "likely mistake: NAME" and each line the catalog knows ([lines]) said in `lang`
    (NAME kept when the catalog has no entry for it)."""
    if lang == "en":
        return text
    lines = catalog(lang)["lines"]
    if lines:
        said = []
        for line in text.split("\n"):
            for en, zh in lines.items():
                m = re.fullmatch(_pattern(en).pattern.removesuffix(_END), line, re.DOTALL)
                if m:
                    line = zh.format(*m.groups())
                    break
            said.append(line)
        text = "\n".join(said)
    if MISTAKE not in text:
        return text
    label = say("likely mistake: ", lang)
    out, at = [], 0
    while (start := text.find(MISTAKE, at)) >= 0:
        name = start + len(MISTAKE)
        out.append(text[at:start])
        for pattern, zh, _ in _compiled(lang):
            m = pattern.match(text, name)
            if m:
                out.append(label + zh.format(*m.groups()))
                at = m.end()
                break
        else:
            out.append(MISTAKE)
            at = name
    return "".join(out) + text[at:]


# --------------------------------------------------------------------------- display width


def cols(text: str) -> int:
    """Columns `text` takes in a terminal: wide (CJK) and full-width characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 0 if unicodedata.combining(c) else 1 for c in text)


def pad(text: str, width: int, right: bool = False) -> str:
    """`text` padded with spaces to `width` columns (on the left with right=True)."""
    fill = " " * max(0, width - cols(text))
    return fill + text if right else text + fill


def clip(text: str, width: int) -> str:
    """`text` cut to at most `width` columns, with "…" where it was cut."""
    if cols(text) <= width:
        return text
    out, used = [], 0
    for c in text:
        w = cols(c)
        if used + w > width - 1:
            break
        out.append(c)
        used += w
    return "".join(out) + "…"


def terminal_width(default: int = 100) -> int:
    """The terminal's columns (COLUMNS, else the terminal, else `default`)."""
    import shutil

    return shutil.get_terminal_size((default, 24)).columns


# --------------------------------------------------------------------------- what the code says (for the catalog's test)

# where diagnoses are raised for a learner: the exercise tests and checks, megalab's own checks (not the tests of the
# tools, the mutants, or the independent and blind runs, whose strings describe mistakes rather than say them)
NOT_SAID = ("tests/mistakes/", "tests/independent/", "tests/blind/", "tests/test_checks.py", "tests/test_progress.py",
            "tests/test_i18n.py", "tests/test_learner.py", "tests/test_independent", "tests/test_mistakes",
            "megalab/lab/")


def _template(node) -> str | None:
    """The str.format template a string expression renders by (`{}` for each interpolated value), or None."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.replace("{", "{{").replace("}", "}}")
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value.replace("{", "{{").replace("}", "}}") if isinstance(v, ast.Constant) else "{}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        return left + right if left is not None and right is not None else None
    return None


def english_messages(root) -> dict[str, dict[str, str]]:
    """{"frames": {template: where}, "diagnoses": {template: where}} said by the code under `root`: the templates
    given to `say(...)`, and the names of likely mistakes (`mistake(NAME, ...)`, `mistakes={NAME: ...}`, the keys
    of a dict assigned to a *MISTAKES* name, "likely mistake: NAME — ..." strings)."""
    import ast

    root = Path(root)
    found: dict[str, dict[str, str]] = {"frames": {}, "diagnoses": {}}

    def add(kind, text, path, node):
        if text is not None and text.strip(" {}"):
            found[kind].setdefault(text, f"{path}:{node.lineno}")

    for folder in ("megalab", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), rel)
            parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", getattr(node.func, "attr", None))
                    if name == "say" and node.args and isinstance(node.args[0], ast.Constant) and rel.startswith(
                            "megalab/"):
                        add("frames", node.args[0].value, rel, node)
                if rel.startswith(NOT_SAID):
                    continue
                if isinstance(node, ast.Call):
                    if getattr(node.func, "id", getattr(node.func, "attr", None)) == "mistake" and node.args:
                        add("diagnoses", _template(node.args[0]), rel, node)
                    for kw in node.keywords:
                        if kw.arg == "mistakes" and isinstance(kw.value, ast.Dict):
                            for key in kw.value.keys:
                                add("diagnoses", _template(key), rel, node)
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                        "mistake" in getattr(t, "id", "").lower() for t in node.targets):
                    # {short name: diagnosis} or {diagnosis: what it computes}: the diagnoses are the prose side
                    values = [_template(v) for v in node.value.values]
                    for text in values if all(v and " " in v for v in values) else [_template(k) for k in
                                                                                     node.value.keys]:
                        add("diagnoses", text, rel, node)
                elif isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in parts:
                    text = _template(node)
                    if text and text.startswith(MISTAKE):
                        add("diagnoses", text[len(MISTAKE):].split(" — ")[0], rel, node)
    return found


def untranslated(root, lang: str) -> dict[str, dict[str, str]]:
    """What `english_messages` finds that the catalog of `lang` does not translate: {kind: {template: where}}."""
    have = catalog(lang)
    return {kind: {en: where for en, where in said.items() if en not in have[kind]}
            for kind, said in english_messages(root).items()}
