"""Translations (megalab/lab/translate.py): keyed by cell id and the English text's hash; a changed English
cell makes its translation stale; built notebooks keep code cells and outputs byte for byte."""

import json
import re
from pathlib import Path

import nbformat
import pytest

from megalab.lab import cli
from megalab.lab.exercises import load
from megalab.lab.translate import (
    TranslationError,
    build,
    en_hash,
    english_notebooks,
    glossary_problems,
    read_sections,
    source_of,
    status,
    stub,
    translated,
)

NB = "course/01_x/01_toy.ipynb"


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "megalab").mkdir()
    (tmp_path / "megalab" / "__init__.py").write_text("")
    (tmp_path / "course" / "01_x").mkdir(parents=True)
    code = nbformat.v4.new_code_cell("print(1 + 1)")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="2\n")]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Data parallelism\nEach rank holds the model."),
                                         code, nbformat.v4.new_markdown_cell("## Recap\nAll-reduce the grads.")])
    nbformat.write(nb, tmp_path / NB)
    return tmp_path


def _translate_all(tree):
    nb = nbformat.read(tree / NB, as_version=4)
    path = source_of(tree, NB, "zh")
    text = path.read_text()
    for c, zh in zip([c for c in nb.cells if c.cell_type == "markdown"], ["# 数据并行\n每个 rank 持有完整的模型。",
                                                                          "## 小结\n对梯度做 all-reduce。"]):
        text = text.replace(f"TODO(zh):\n{c.source}", zh)
    path.write_text(text)


def test_stub_translate_build_and_stale(tree):
    [st] = status(tree, "zh")
    assert (st.cells, st.done, len(st.missing)) == (2, 0, 2)
    assert stub(tree, NB, "zh") == 2
    assert status(tree, "zh")[0].missing  # TODO sections are not translations
    _translate_all(tree)
    assert status(tree, "zh")[0].ok
    [path] = build(tree, "zh")
    assert path == tree / "build" / "zh" / NB
    en, zh = nbformat.read(tree / NB, as_version=4), nbformat.read(path, as_version=4)
    assert zh.cells[0].source.startswith("# 数据并行") and zh.cells[2].source.startswith("## 小结")
    assert [c for c in zh.cells if c.cell_type == "code"] == [c for c in en.cells if c.cell_type == "code"]

    en.cells[2].source += "\nAnd step."  # the English changes: its translation is stale, the build refuses
    nbformat.write(en, tree / NB)
    assert status(tree, "zh")[0].stale == [en.cells[2].id]
    with pytest.raises(TranslationError, match="changed since it was translated; run `megalab translate stub"):
        translated(tree, NB, "zh")
    assert stub(tree, NB, "zh") == 1
    sections = read_sections(source_of(tree, NB, "zh"))
    assert sections[en.cells[2].id].en == en_hash(en.cells[2].source)
    assert sections[en.cells[2].id].text.startswith('TODO(zh): was "## 小结\\n对梯度做 all-reduce。"\n## Recap')


def test_bad_input_is_said(tree, capsys, monkeypatch):
    with pytest.raises(TranslationError, match="no translation 'fr'"):
        status(tree, "fr")
    path = source_of(tree, NB, "zh")
    path.parent.mkdir(parents=True)
    path.write_text("stray text\n<!-- cell abc · en 0123456789ab -->\nx\n")
    with pytest.raises(TranslationError, match="text before the first"):
        status(tree, "zh")
    path.write_text("<!-- cell abc · en 0123456789ab -->\nx\n<!-- cell def · en 01234 -->\ny\n")  # a cut hash
    with pytest.raises(TranslationError, match=r"01_toy.md:3: malformed section line '<!-- cell def · en 01234 -->'"):
        status(tree, "zh")
    monkeypatch.chdir(tree)
    assert cli.main(["translate", "status"]) == 2
    assert "megalab translate:" in capsys.readouterr().err


# --------------------------------------------------------------------------- a learner's Chinese workspace

TWICE = '''\
def double(x):
    """Twice x."""
    # EXERCISE twice.double: return 2 * x
    ### BEGIN SOLUTION
    # HINT 1: The idea. Add x to itself.
    # HINT 2: A pitfall. Return it, don't print it.
    return 2 * x
    ### END SOLUTION
'''
TWICE_TESTS = '''\
import pytest
from megalab.twice import double

@pytest.mark.exercise("twice.double")
def test_double():
    assert double(3) == 6, f"double(3) is {double(3)}, expected 6"
'''
TWICE_NB = "course/01_x/02_twice.ipynb"
ZH = {"# Doubling\n**Exercise `twice.double`**: data parallel ranks all-reduce.": "# 翻倍\n**练习 `twice.double`**：数据并行的各个 rank 做 all-reduce。",
      "task: return 2 * x\nhint 1: The idea. Add x to itself.\nhint 2: A pitfall. Return it, don't print it.":
      "task: 返回 2 * x\nhint 1: 思路：把 x 和自己相加。\nhint 2: 陷阱：要 return，不要 print。"}


def _fill(root, notebook, table):
    """Translate the stub sections of `notebook` by `table` (English text -> Chinese)."""
    stub(root, notebook, "zh")
    path = source_of(root, notebook, "zh")
    text = path.read_text()
    for en, zh in table.items():
        text = re.sub(rf"^TODO\(zh\):.*\n{re.escape(en)}$", lambda m, zh=zh: zh, text, flags=re.MULTILINE)
    path.write_text(text)


@pytest.fixture
def zh_ref(tmp_path):
    from tests.test_exercises import _notebook, _toy_tree

    ref = _toy_tree(tmp_path / "ref")
    (ref / "megalab" / "twice.py").write_text(TWICE)
    (ref / "tests" / "test_twice.py").write_text(TWICE_TESTS)
    _notebook(ref / TWICE_NB, next(iter(ZH)), "from megalab.twice import double\nprint('double(3) =', double(3))",
              "double(3) = 6\n")
    for rel in translate_status_notebooks(ref):  # the toy tree's other notebooks: kept in English
        _fill(ref, rel, {c: c for c in _markdown_sources(ref, rel)})
    _fill(ref, TWICE_NB, ZH)
    assert all(st.ok for st in status(ref, "zh"))
    return ref


def translate_status_notebooks(root):
    return [st.notebook for st in status(root, "zh") if st.notebook != TWICE_NB]


def _markdown_sources(root, rel):
    from megalab.lab.exercises import load
    from megalab.lab.translate import exercise_english

    nb = nbformat.read(root / rel, as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "markdown"]
    return sources + [exercise_english(ex) for ex in load(root).exercises.values() if ex.notebook == rel]


def test_a_chinese_workspace_has_chinese_notebooks_tasks_and_hints(zh_ref, tmp_path, monkeypatch):
    from megalab.lab.grading import grade
    from megalab.lab.progress import hint
    from megalab.lab.workspace import create, open_workspace, restore, update

    create(zh_ref, tmp_path / "ws", lang="zh")
    ws = open_workspace(tmp_path / "ws")
    assert ws.config["lang"] == "zh"
    en, zh = nbformat.read(zh_ref / TWICE_NB, as_version=4), nbformat.read(ws.root / TWICE_NB, as_version=4)
    assert zh.cells[0].source.startswith("# 翻倍") and zh.cells[1] == en.cells[1]  # code and outputs as in English
    code = (ws.root / "megalab/twice.py").read_text()
    assert "    # EXERCISE twice.double: 返回 2 * x\n" in code
    assert 'raise NotImplementedError("exercise twice.double: 返回 2 * x — 见 course/01_x/02_twice.ipynb")' in code
    assert hint(ws.root, "twice.double")[2] == "思路：把 x 和自己相加。"
    assert hint(ws.root, "twice.double")[2] == "陷阱：要 return，不要 print。"

    monkeypatch.chdir(ws.root)
    [row] = grade(".", "twice.double", timeout=60).exercises
    assert (row.status, row.detail) == ("not implemented", "NotImplementedError: exercise twice.double: 返回 2 * x — "
                                        "见 course/01_x/02_twice.ipynb")
    verdict = grade(".", "twice.double", timeout=60).verdict()  # said in Chinese, statuses still readable
    assert verdict.startswith("twice.double: 未实现 (not implemented)\n") and "你的代码：megalab/twice.py:3" in verdict
    assert "；已用提示：2" in verdict  # the two hints seen above
    from megalab import banner
    assert f"你的工作区 {ws.root}/megalab · 已实现 0 / 3 个练习" in banner(ws.root)  # toy.double, toy.g and this one
    (ws.root / "megalab/twice.py").write_text(code.replace('raise NotImplementedError("exercise twice.double: 返回 '
                                                            '2 * x — 见 course/01_x/02_twice.ipynb")', "return x + x"))
    report = grade(".", TWICE_NB, timeout=120)  # its exercise, and the Chinese notebook against its outputs
    assert [r.status for r in report.exercises] == ["passed"] and report.ok, (report.exercises, report.notebooks)

    (ws.root / TWICE_NB).write_text("{}")  # a broken save: restore brings back the Chinese notebook
    restore(ws, ws.root / TWICE_NB)
    assert nbformat.read(ws.root / TWICE_NB, as_version=4).cells[0].source.startswith("# 翻倍")

    # the course changes its English and its translation: update brings the new Chinese, keeps the solution
    nb = nbformat.read(zh_ref / TWICE_NB, as_version=4)
    nb.cells[0].source += "\nNow with more."
    nbformat.write(nb, zh_ref / TWICE_NB)
    _fill(zh_ref, TWICE_NB, {nb.cells[0].source: "# 翻倍（新版）\n**练习 `twice.double`**：数据并行的各个 rank 做 all-reduce。"})
    update(ws)
    assert nbformat.read(ws.root / TWICE_NB, as_version=4).cells[0].source.startswith("# 翻倍（新版）")
    assert "return x + x" in (ws.root / "megalab/twice.py").read_text()


def test_a_chinese_copy_refuses_a_missing_translation(zh_ref, tmp_path, monkeypatch, capsys):
    from megalab.lab.workspace import WorkspaceError, create

    (zh_ref / "megalab/twice.py").write_text(TWICE.replace("Add x to itself.", "Add x to x."))  # hint changed
    said = ("the zh edition is not complete: exercise twice.double (task or hints) changed since it was translated; "
            "run `megalab translate stub course/01_x/02_twice.ipynb`")
    with pytest.raises(WorkspaceError, match=re.escape(said)):
        create(zh_ref, tmp_path / "ws", lang="zh")
    monkeypatch.chdir(zh_ref)
    assert cli.main(["student", str(tmp_path / "student"), "--lang", "zh"]) == 1
    assert said in capsys.readouterr().err and not (tmp_path / "student").exists()
    assert status(zh_ref, "zh")[[st.notebook for st in status(zh_ref, "zh")].index(TWICE_NB)].stale == [
        "exercise twice.double"]


def test_the_glossary_check_reads_prose_only():
    from megalab.lab.translate import Term, glossary_misses

    terms = [Term(["data parallel"], "数据并行"), Term(["all-reduce"], "all-reduce"), Term(["recompute", "recomputation"], "重计算")]
    english = "With **data-parallel** training (`data_parallel_size`), ranks all-reduce; see [recomputation](x.md)."
    assert glossary_misses(terms, english, "数据并行训练中各 rank 做 All Reduce；见[重计算](x.md)。") == []
    assert glossary_misses(terms, english, "数据平行训练中各 rank 做 allreduce；见[重算](x.md)。") == [
        "'data-parallel' -> 数据并行", "'recomputation' -> 重计算"]
    assert glossary_misses(terms, "Call `all_reduce` in `recompute()`.", "调用 `all_reduce`。") == []  # code spans


# --------------------------------------------------------------------------- the course's Chinese edition

REPO = Path(__file__).resolve().parent.parent
CJK = re.compile(r"[\u4e00-\u9fff]")


def test_every_cell_and_exercise_of_the_course_is_translated_and_current():
    """Fails when an English cell or exercise changed since its translation, or has none: run
    `megalab translate status` to see which, `megalab translate stub NOTEBOOK` to mark them for translation."""
    rows = status(REPO, "zh")
    assert len(rows) == len(english_notebooks(REPO)) >= 35
    behind = {r.notebook: r.missing + r.stale + r.orphans for r in rows if not r.ok}
    assert not behind, f"translations missing or stale (megalab translate status): {behind}"
    assert sum(r.exercises for r in rows) == len(load(REPO).exercises)
    misses = glossary_problems(REPO, "zh")
    assert not misses, "terms not as course/zh/GLOSSARY.md fixes them:\n" + "\n".join(misses)


def test_the_chinese_notebooks_have_the_english_code_and_outputs(tmp_path):
    """The Chinese notebooks are graded like the English ones because their code cells (source, outputs,
    execution counts, metadata) and every cell's id, type and place are the English notebooks' byte for byte;
    only the markdown differs, and it is Chinese."""
    written = build(REPO, "zh", tmp_path)
    assert len(written) == len(english_notebooks(REPO))
    for path in written:
        rel = path.relative_to(tmp_path).as_posix()
        en, zh = nbformat.read(REPO / rel, as_version=4), nbformat.read(path, as_version=4)
        assert [(c.id, c.cell_type) for c in zh.cells] == [(c.id, c.cell_type) for c in en.cells], rel
        for c_en, c_zh in zip(en.cells, zh.cells):
            if c_en.cell_type == "code":
                assert json.dumps(c_zh, sort_keys=True) == json.dumps(c_en, sort_keys=True), f"{rel} cell {c_en.id}"
        prose = [c.source for c in zh.cells if c.cell_type == "markdown"]
        assert sum(bool(CJK.search(p)) for p in prose) >= len(prose) - 2, f"{rel}: markdown not in Chinese"


def test_a_chinese_student_copy_of_the_course(tmp_path):
    from megalab.lab.exercises import write_student
    from megalab.lab.translate import edition

    copy = write_student(REPO, tmp_path / "student", edition=edition(REPO, "zh"))
    registry = load(REPO)
    hints = json.loads((copy.dest / ".megalab/hints.json").read_text(encoding="utf-8"))
    assert hints.keys() == registry.exercises.keys()
    for ex in registry.exercises.values():
        assert len(hints[ex.id]) == len(ex.hints) and all(CJK.search(h) for h in hints[ex.id]), ex.id
    blanked = [ex for ex in copy.blanked if ex.buggy is None]
    for ex in blanked:  # every blank raises its task in Chinese, after the `exercise <id>:` the grader reads
        text = (copy.dest / ex.path).read_text(encoding="utf-8")
        raise_line = next(line for line in text.splitlines() if f'NotImplementedError("exercise {ex.id}:' in line)
        assert CJK.search(raise_line) and "— 见 course/" in raise_line, raise_line
    first = nbformat.read(copy.dest / "course/01_foundations/01_setup_and_torchrun.ipynb", as_version=4)
    assert CJK.search(first.cells[0].source)


def test_a_chinese_paragraph_is_one_line_where_it_renders():
    """A line break inside a paragraph renders as a space: between two Chinese characters it must go; code
    blocks, headings, list items and a break before English keep their lines."""
    from megalab.lab.translate import join_lines

    text = "# 标题\n第一行，\n  第二行。\nEnglish 之后\n- 列表\n- 列表二\n\n```python\nx = 1  # 中文\n# 注释\n```"
    assert join_lines(text) == ("# 标题\n第一行，第二行。\nEnglish 之后\n- 列表\n- 列表二\n\n"
                                "```python\nx = 1  # 中文\n# 注释\n```")


def test_the_translations_keep_every_code_span_block_and_link_of_the_english():
    """Code, names, flags, paths, magics and link targets stay in English: each of the English cell's inline
    code spans, fenced blocks and link targets is in its translation (line wrapping aside)."""
    from megalab.lab.translate import join_lines

    kept = re.compile(r"```.*?```|`[^`]+`|\]\([^)]+\)", re.DOTALL)

    def items(text):
        return sorted(" ".join(m.group(0).split()) for m in kept.finditer(text))

    lost = []
    for rel in english_notebooks(REPO):
        sections = read_sections(source_of(REPO, rel, "zh"))
        for cell in nbformat.read(REPO / rel, as_version=4).cells:
            if cell.cell_type == "markdown":
                zh = items(join_lines(sections[cell.id].text))
                lost += [f"{rel} cell {cell.id}: {item[:80]}" for item in items(cell.source) if item not in zh]
    assert not lost, "translations that lost or changed code, a block or a link:\n" + "\n".join(lost)
