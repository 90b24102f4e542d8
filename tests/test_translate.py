"""Translations (megalab/lab/translate.py): keyed by cell id and the English text's hash; a changed English
cell makes its translation stale; built notebooks keep code cells and outputs byte for byte."""

import nbformat
import pytest

from megalab.lab import cli
from megalab.lab.translate import TranslationError, build, en_hash, read_sections, source_of, status, stub, translated

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
    assert sections[en.cells[2].id].en == en_hash(en.cells[2].source) and "was:" in sections[en.cells[2].id].text


def test_bad_input_is_said(tree, capsys, monkeypatch):
    with pytest.raises(TranslationError, match="no translation 'fr'"):
        status(tree, "fr")
    path = source_of(tree, NB, "zh")
    path.parent.mkdir(parents=True)
    path.write_text("stray text\n<!-- cell abc · en 0123456789ab -->\nx\n")
    with pytest.raises(TranslationError, match="text before the first"):
        status(tree, "zh")
    monkeypatch.chdir(tree)
    assert cli.main(["translate", "status"]) == 2
    assert "megalab translate:" in capsys.readouterr().err
