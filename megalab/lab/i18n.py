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
MISTAKE = "likely mistake: "


def lang_of(root) -> str:
    """The language of the workspace at `root` ("en" for the reference or a plain copy)."""
    path = Path(root) / ".megalab" / "workspace.json"
    try:
        return json.loads(path.read_text()).get("lang") or "en"
    except (OSError, ValueError):
        return "en"


@functools.cache
def catalog(lang: str) -> dict[str, dict[str, str]]:
    """{"frames": {English: translation}, "diagnoses": {English: translation}} for `lang` (empty for English)."""
    import tomllib

    path = HERE / CATALOG.format(lang=lang)
    if lang == "en" or not path.is_file():
        return {"frames": {}, "diagnoses": {}}
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return {"frames": dict(data.get("frames", {})), "diagnoses": dict(data.get("diagnoses", {}))}


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
    return re.compile("".join(parts) + r"(?=$| — |\)|\n)", re.DOTALL)


@functools.cache
def _compiled(lang: str) -> list[tuple[re.Pattern, str, int]]:
    """(pattern, translation, length of the English) for every diagnosis, the longest English first."""
    items = catalog(lang)["diagnoses"].items()
    return sorted(((_pattern(en), zh, len(en)) for en, zh in items), key=lambda t: -t[2])


def diagnosis(text: str, lang: str = "en") -> str:
    """`text` with each "likely mistake: NAME" said in `lang` (NAME kept when the catalog has no entry for it)."""
    if lang == "en" or MISTAKE not in text:
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
