"""The tools speak the workspace's language (megalab/lab/i18n.py): a Chinese workspace's hint, grade of a wrong
answer, progress, update and restore carry no untranslated English frame; every frame and diagnosis of the code has
a translation; tables fit the terminal; the printed next steps run as printed; README's numbers are the course's."""

import json
import re
from pathlib import Path

import nbformat
import pytest

from megalab.lab import cli
from megalab.lab.i18n import catalog, clip, cols, diagnosis, pad, untranslated
from tests.test_translate import TWICE_NB, zh_ref  # noqa: F401  (the fixture: a toy course translated to zh)

REPO = Path(__file__).resolve().parent.parent

# What may stay English in a Chinese message: code spans, ids, paths, commands, statuses beside their Chinese.
_ALLOWED = re.compile(r"`[^`]*`|%\w+ [\w.]+|\([a-z ]+\)|[\w.-]*[/.][\w./-]*|megalab \w+|\b[A-Za-z_]+\.[\w.]+\b|"
                      r"<<<<<<<|>>>>>>>|NotImplementedError|AssertionError|PATH|JupyterLab|notebook|[A-Z]+\b")


def english_runs(text: str) -> list[str]:
    """Runs of three or more English words left once code, ids, paths and statuses are taken out."""
    plain = _ALLOWED.sub(" ", text)
    return re.findall(r"[A-Za-z]{2,}(?:[ ,;:'\d-]+[A-Za-z]{2,}){2,}", plain)


def test_the_frame_check_catches_english():
    assert english_runs("Hint 1 of 2 for twice.double (the idea):") == ["Hint 1 of 2 for"]  # English is caught ...
    assert english_runs("twice.double 的提示 1 / 2（思路）：") == []  # ... its translation is not
    assert english_runs("你的代码：megalab/twice.py:3；讲解见 course/01_x/02_twice.ipynb  (0.4 s)") == []


def _say(capsys, *argv) -> str:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return f"{out.out}{out.err}[exit {code}]"


def test_a_chinese_workspace_says_everything_in_chinese(zh_ref, tmp_path, monkeypatch, capsys):  # noqa: F811
    ws = tmp_path / "ws"
    monkeypatch.chdir(zh_ref)
    made = _say(capsys, "workspace", str(ws), "--lang", "zh")
    monkeypatch.chdir(ws)
    (ws / "megalab/twice.py").write_text((ws / "megalab/twice.py").read_text().replace(
        'raise NotImplementedError("exercise twice.double: 返回 2 * x — 见 course/01_x/02_twice.ipynb")', "return x * 3"))
    outputs = {
        "workspace": made,
        "hint": _say(capsys, "hint", "twice.double"),
        "last hint": _say(capsys, "hint", "twice.double"),
        "unknown hint": _say(capsys, "hint", "twice.doubel"),
        "grade (wrong)": _say(capsys, "grade", "twice.double", "--timeout", "60"),
        "grade (chapter)": _say(capsys, "grade", "01", "--no-notebooks", "--timeout", "60"),
        "grade (unknown)": _say(capsys, "grade", "twice.doubel"),
        "progress": _say(capsys, "progress"),
        "restore": _say(capsys, "restore", TWICE_NB),
        "update": _say(capsys, "update"),
    }
    for name, text in outputs.items():  # (the toy's other notebooks and tasks stay English: the fixture keeps them)
        text = "\n".join(line for line in text.splitlines() if "exercise toy." not in line)
        assert english_runs(text) == [], f"{name}: untranslated {english_runs(text)} in:\n{text}"
    assert "twice.double 的提示 1 / 2（思路）：" in outputs["hint"] and "（这是最后一条提示" in outputs["last hint"]
    assert "未通过 (failed)" in outputs["grade (wrong)"] and "已恢复 " in outputs["restore"]
    assert "make grade ID=dist.shard_bounds" in made and "工作区已与 " in outputs["update"]
    for name in ("grade (chapter)", "progress", "hint", "workspace"):  # no wrap at 100 columns (CJK: two each)
        assert all(cols(line) <= 100 for line in outputs[name].splitlines() if str(tmp_path) not in line), name
    # the notebooks show this workspace's banner, also after restore and update
    for rel in (TWICE_NB, "course/01_x/01_toy.ipynb"):
        saved = json.dumps(nbformat.read(ws / rel, as_version=4).dict(), ensure_ascii=False)
        assert "every exercise solved" not in saved and "the reference implementation" not in saved


def test_the_banner_of_an_english_workspace(tmp_path, monkeypatch, capsys):
    from tests.test_exercises import _notebook, _toy_tree

    ref = _toy_tree(tmp_path / "ref")
    nb = ref / "course/01_x/03_banner.ipynb"
    _notebook(nb, "Banner.", "%load_ext megalab", "megalab 0.1.0 · the reference implementation · every exercise solved\n"
              "megalab                 0.1.0 from this folder's tree: the reference (every exercise solved), 2 of 2 "
              "exercises implemented\n")  # the banner, and `megalab doctor`'s line
    monkeypatch.chdir(ref)
    _say(capsys, "workspace", str(tmp_path / "ws"))
    text = (tmp_path / "ws/course/01_x/03_banner.ipynb").read_text()
    assert "every exercise solved" not in text and f"your workspace {tmp_path / 'ws'}/megalab · 0 of 2" in text
    assert f"from this folder's tree: a workspace made from {ref}, 0 of 2 exercises implemented" in text
    monkeypatch.chdir(tmp_path / "ws")
    _say(capsys, "restore", "course/01_x/03_banner.ipynb")
    assert "every exercise solved" not in (tmp_path / "ws/course/01_x/03_banner.ipynb").read_text()
    assert "0 file(s) changed" in _say(capsys, "update")  # the banner alone never counts as a change


def test_every_frame_and_diagnosis_has_a_chinese_translation():
    """Lists every English message of the code without a Chinese one (add it to megalab/lab/messages_zh.toml)."""
    missing = untranslated(REPO, "zh")
    lines = [f"{kind}: {en!r} ({where})" for kind, said in missing.items() for en, where in said.items()]
    assert not lines, f"{len(lines)} message(s) without a translation:\n" + "\n".join(lines)
    for kind, table in catalog("zh").items():  # a translation keeps every value of its English
        for en, zh in table.items():
            assert en.count("{") - en.count("{{") * 2 == zh.count("{") - zh.count("{{") * 2, (kind, en, zh)


def test_a_diagnosis_is_translated_where_it_is_shown():
    said = diagnosis("AssertionError: likely mistake: forgot the all-reduce (only this rank's partial sum) — got 3", "zh")
    assert said == "AssertionError: 可能的错误：忘了 all-reduce（只有本 rank 的部分和） — got 3"
    templated = ("AssertionError: likely mistake: the logits hold 4 of the 10 vocabulary entries on rank 1, not this "
                 "rank's slice of vocab/2 (5): vocab_parallel_cross_entropy reads them as a slice and computes a wrong loss")
    assert diagnosis(templated, "zh").startswith("AssertionError: 可能的错误：rank 1 上的 logits 含有 10 个词表项中的 4 个")
    assert diagnosis("likely mistake: no such diagnosis — x", "zh") == "likely mistake: no such diagnosis — x"
    assert diagnosis("3 tests passed", "zh") == "3 个测试通过" and diagnosis("3 tests passed", "en") == "3 tests passed"


def test_columns():
    assert cols("中文ab") == 6 and pad("中文", 6) == "中文  " and pad("ab", 4, right=True) == "  ab"
    assert clip("中文中文中文", 7) == "中文中…" and cols(clip("中文中文中文", 7)) <= 7


def test_the_progress_bar_reads_as_it_is():
    from megalab.lab.progress import _bar

    assert _bar(0, 8) == "·" * 20 and _bar(8, 8) == "█" * 20
    assert _bar(1, 81).startswith("█") and _bar(80, 81).endswith("·")  # some done shows; not all done never full


def test_next_follows_the_reading_order():
    from megalab.lab.progress import summary

    chapter = next(r for r in summary(REPO) if r.chapter == "03_parallelism")
    assert chapter.todo[:3] == ["data_parallel.build_buckets", "data_parallel.grad_hook", "data_parallel.finish_grad_sync"]


def test_an_unknown_language_is_refused_with_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["workspace", str(tmp_path / "ws"), "--lang", "fr"])
    err = capsys.readouterr().err
    assert "no course language 'fr'" in err and "en (English), zh (简体中文)" in err and not (tmp_path / "ws").exists()


@pytest.mark.parametrize("how", ["LANG=zh make -n workspace", "make -n workspace LANG=zh"])
def test_lang_zh_in_either_position(how, tmp_path):
    import os
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items() if k != "LANG"}
    assigns, cmd = [w for w in how.split() if "=" in w and w.startswith("LANG")], how.split()
    if cmd[0].startswith("LANG="):
        env["LANG"], cmd = cmd[0].split("=")[1], cmd[1:]
    out = subprocess.run([*cmd, f"DIR={tmp_path}", "WORKSPACE=1", f"VENV={tmp_path}"], cwd=REPO, env=env,
                         capture_output=True, text=True).stdout
    assert assigns and f"megalab workspace {tmp_path} --lang zh" in out, out


def test_make_lab_has_no_news_pop_up():
    line = re.search(r"^lab: setup\n(?:.*\n)*?(?=\n)", (REPO / "Makefile").read_text(), re.MULTILINE)[0]
    assert "--LabApp.news_url=None" in line and "NeverCheckForUpdate" in line


# --------------------------------------------------------------------------- README and README.zh


def _readme(lang: str) -> str:
    return (REPO / ("README.md" if lang == "en" else "README.zh.md")).read_text(encoding="utf-8")


def _spans(text: str) -> set[str]:
    """Code spans outside code blocks, whitespace and <placeholders> normalised, the language flag left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    out = set()
    for span in re.findall(r"`([^`]+)`", text):
        span = re.sub(r"<[^>]*>", "<>", re.sub(r"\s+", " ", span).strip())
        out.add(span.replace(" --lang zh", "").replace(" LANG=zh", ""))
    return out


def _commands(text: str) -> set[str]:
    """The commands of the code blocks (a line's part before its comment), the language flag left out."""
    lines = [line.split("#")[0].strip() for block in re.findall(r"```\w*\n(.*?)```", text, re.DOTALL)
             for line in block.splitlines()]
    return {c.replace(" LANG=zh", "") for c in lines if re.match(r"(make|git|cd|megalab|pip|python|conda) ", c)}


def test_readme_numbers_are_the_course_s():
    """The exercise and notebook counts of both READMEs are the course's (never typed and left behind)."""
    from megalab import __version__
    from megalab.lab.exercises import load
    from megalab.lab.notebooks import find_notebooks

    exercises = len(load(REPO).exercises)
    notebooks = len([p for p in find_notebooks([str(REPO / "course")]) if not p.name.startswith(".")])
    en, zh = _readme("en"), _readme("zh")
    said = {"en exercises": re.findall(r"\d+ of (\d+) exercises implemented", en) + re.findall(
        r"\d+ notebooks, (\d+) exercises", en), "en notebooks": re.findall(r"(\d+) notebooks, \d+ exercises", en),
            "zh exercises": re.findall(r"已实现 \d+ / (\d+) 个练习", zh) + re.findall(r"\d+ 个 notebook、(\d+) 个练习", zh),
            "zh notebooks": re.findall(r"(\d+) 个 notebook、\d+ 个练习", zh)}
    for what, counts in said.items():
        expected = exercises if what.endswith("exercises") else notebooks
        assert counts and all(int(c) == expected for c in counts), f"README {what}: {counts}, the course has {expected}"
    assert f"megalab {__version__} · your workspace ~/" in en and f"megalab {__version__} · 你的工作区 ~/" in zh
    assert "about a second" not in en and "大约一秒" not in zh  # a timing typed once and never measured again


def test_readme_zh_has_every_fact_of_the_english():
    """README.zh says what README says: every number (counts, timings, sizes, versions), every command and code span."""
    en, zh = _readme("en"), _readme("zh")
    numbers = lambda text: set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", text))  # noqa: E731
    assert sorted(numbers(en) - numbers(zh)) == []
    assert sorted(_commands(en) - _commands(zh)) == []
    translated = {"megalab N.N.N · your workspace ~/megalab-workspace/megalab · N of N exercises implemented":
                  "megalab N.N.N · 你的工作区 ~/megalab-workspace/megalab · 已实现 N / N 个练习",
                  'raise NotImplementedError("exercise <>: ... — see <>")':
                  'raise NotImplementedError("exercise <>: <> — 见 <>")'}  # what the English says, in Chinese
    n = lambda spans: {re.sub(r"\d+", "N", s) for s in spans}  # noqa: E731  (numbers are compared above)
    missing = [s for s in n(_spans(en)) - n(_spans(zh)) if translated.get(s) not in n(_spans(zh))]
    assert missing == []


# --------------------------------------------------------------------------- the glossary: one word, fixed labels, first use


def test_the_glossary_says_one_idea_one_way():
    """AVOID renderings, LABELS (headings and the Stuck sentence) and FIRST (English on first use) are checked."""
    from megalab.lab.translate import Term, _first_use_problems, _label_problems, avoided, first_use, labels

    assert ("规约", "归约") in avoided(REPO, "zh") and ("query 头", "查询头") in avoided(REPO, "zh")
    fixed = labels(REPO, "zh")
    english = ("## Build: the buckets\n\nText.\n\n*Stuck?* `%hint a.b`, `%hint a.c` gives the idea, then the approach "
               "(never the code); `%grade a.b` names the likely mistake.")
    good = ("## 动手实现：桶\n\n正文。\n\n*卡住了？* `%hint a.b`、`%hint a.c` 先给出思路，再给出做法（从不给出代码）；"
            "`%grade a.b` 会指出最可能的错误。")
    assert _label_problems(fixed, english, good) == []
    bad = good.replace("## 动手实现：", "## 构建：").replace("先给出思路，再给出做法（从不给出代码）", "先给思路，再给做法（从不给代码）")
    assert len(_label_problems(fixed, english, bad)) == 2
    assert _label_problems(fixed, "## Build\n", "## 动手实现\n") == [] and _label_problems(fixed, "## Build 1\n", "## 搭建 1")

    first, terms = first_use(REPO, "zh"), [Term(["expert data parallel"], "专家数据并行")]
    english = "Data parallelism, then expert data parallel groups."
    assert _first_use_problems(first, english, ["数据并行（data parallelism）复制模型。", "数据并行。"], terms) == []
    assert _first_use_problems(first, english, ["数据并行复制模型。", "数据并行（data parallelism）。"], terms) == [
        "first '数据并行' -> 数据并行（data parallel）"]
    assert _first_use_problems(first, english, ["专家数据并行组；数据并行（data parallelism）。"], terms) == []


def test_a_diagram_whose_labels_stay_english_gets_a_gloss():
    from megalab.lab.translate import GLOSS, diagram_words, translated, with_glosses

    words = diagram_words(REPO, "zh")
    text = "图如下：\n\n```\nforward ──> backward   grads\n```\n\n正文。"
    assert with_glosses(text, words) == text.replace("```\n\n正文", f"```\n\n*{GLOSS}forward 前向 · backward 反向 · grads 梯度*"
                                                                    "\n\n正文")
    code = "```python\nloss.backward()\n```"
    assert with_glosses(code, words) == code  # code is not a diagram
    glossed = f"```\nforward\n```\n\n{GLOSS}forward 前向"
    assert with_glosses(glossed, words) == glossed  # the translation's own gloss is kept, never doubled
    nb = translated(REPO, "course/03_parallelism/01_data_parallel.ipynb", "zh")
    assert any(f"*{GLOSS}" in c.source and "bucket 桶" in c.source for c in nb.cells if c.cell_type == "markdown")


def test_the_rare_grade_details_are_said_in_chinese_too():
    from megalab.lab.i18n import diagnosis

    assert diagnosis("every test was skipped (3 tests): needs a CUDA GPU", "zh") == "所有测试都被跳过了（3 tests）：needs a CUDA GPU"
    said = diagnosis('no test ran: mark its tests @pytest.mark.exercise("x.y")', "zh")
    assert said == '没有测试运行：给它的测试加上 @pytest.mark.exercise("x.y")'
