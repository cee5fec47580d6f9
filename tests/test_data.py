import os
import textwrap

import pytest

from rift_ada.data import build_tasks, load_corpus, load_jsonl, save_jsonl
from rift_ada.data.corpus import split_of
from rift_ada.data.tasks import MARKERS


def n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_corpus_split_is_a_partition():
    train, evals = load_corpus(split="train"), load_corpus(split="eval")
    names_t, names_e = {f.name for f in train}, {f.name for f in evals}
    assert names_t and names_e and not names_t & names_e
    assert all(split_of(n) == "eval" for n in names_e)
    assert 0.05 < len(names_e) / (len(names_t) + len(names_e)) < 0.2


@pytest.mark.parametrize("family", ["low", "mixed", "high"])
@pytest.mark.parametrize("input_tokens", [1024, 2048, 4096])
def test_tasks_hit_length_and_family_contract(tokenizer, family, input_tokens):
    tasks = build_tasks(tokenizer, family, n=3, input_tokens=input_tokens, seed=1)
    for t in tasks:
        n = n_tokens(tokenizer, t.prompt)
        assert 0.9 * input_tokens <= n <= input_tokens
        assert n_tokens(tokenizer, t.reference) >= 256
        assert t.prompt.endswith("\n")
        # line-local tokenizer: prompt + reference tokenizes as the two parts concatenated
        whole = tokenizer(t.prompt + t.reference, add_special_tokens=False)["input_ids"]
        assert whole == tokenizer(t.prompt, add_special_tokens=False)["input_ids"] + \
            tokenizer(t.reference, add_special_tokens=False)["input_ids"]
        body = t.prompt[: t.prompt.rindex(MARKERS[family].format(name=t.target_file))]  # before the marker
        if family == "low":
            assert t.reference in body, "the copy target must be in the prompt"
            assert f"# copy of: {t.target_file}\n" in t.prompt
        else:
            assert t.reference not in body
        if family == "mixed":
            assert t.target_file in t.files, "mixed tasks hold the first part of the file"
        if family == "high":
            assert t.target_file not in t.files


def test_tasks_are_deterministic_and_seeded(tokenizer):
    a = build_tasks(tokenizer, "low", n=3, input_tokens=1024, seed=0)
    b = build_tasks(tokenizer, "low", n=2, input_tokens=1024, seed=0)
    c = build_tasks(tokenizer, "low", n=3, input_tokens=1024, seed=1)
    assert a[:2] == b
    assert [t.prompt for t in a] != [t.prompt for t in c]


def test_held_out_files_only(tokenizer):
    eval_names = {f.name for f in load_corpus(split="eval")}
    for t in build_tasks(tokenizer, "low", n=4, input_tokens=2048):
        assert t.target_file in eval_names and set(t.files) <= eval_names


def test_source_dir(tmp_path, tokenizer):
    for i in range(6):
        body = "\n".join(f"    value_{i}_{j} = compute_{j}(argument_{j}, {j} * {i})" for j in range(120))
        (tmp_path / f"mod{i}.py").write_text(f"def function_{i}():\n{body}\n    return value_{i}_0\n")
    tasks = build_tasks(tokenizer, "low", n=2, input_tokens=2048, source_dir=tmp_path)
    assert all(t.target_file.startswith("mod") for t in tasks)


def test_source_dir_inside_site_packages(tokenizer):
    import sklearn

    root = os.path.dirname(sklearn.__file__)
    assert "site-packages" in root
    files = load_corpus(root)
    assert len(files) > 100 and all("site-packages" not in f.name for f in files)
    # An installed package by name reads the same folder (every --source-dir takes `pip`, `sklearn`, ...).
    assert [f.name for f in load_corpus("sklearn")] == [f.name for f in files]
    with pytest.raises(FileNotFoundError, match="'no_such_package_xyz' does not exist"):
        load_corpus("no_such_package_xyz")


def test_bad_input_is_clear(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown task family 'medium'"):
        build_tasks(tokenizer, "medium")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_tasks(tokenizer, "low", source_dir=tmp_path / "nope")
    (tmp_path / "tiny.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="too few files long enough"):
        build_tasks(tokenizer, "low", n=1, source_dir=tmp_path)


def test_jsonl_roundtrip_and_errors(tmp_path, tokenizer):
    tasks = build_tasks(tokenizer, "high", n=2, input_tokens=1024)
    save_jsonl(tasks, tmp_path / "p.jsonl")
    back = load_jsonl(tmp_path / "p.jsonl", require_reference=True)
    assert [(t.prompt, t.reference) for t in back] == [(t.prompt, t.reference) for t in tasks]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: each line must be an object"):
        load_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "noref.jsonl").write_text(textwrap.dedent('{"prompt": "x"}\n'))
    with pytest.raises(ValueError, match="needs a 'reference'"):
        load_jsonl(tmp_path / "noref.jsonl", require_reference=True)


@pytest.mark.parametrize("input_tokens", [1024, 2048, 4096, 32768])  # 32K: the paper's setting (--preset paper)
def test_sort_tasks_reorder_labelled_passages(tokenizer, input_tokens):
    from rift_ada.data.tasks import ORDER_LINE, PASSAGE_HEADER

    for t in build_tasks(tokenizer, "sort", n=3, input_tokens=input_tokens, seed=2):
        n = n_tokens(tokenizer, t.prompt)
        assert 0.85 * input_tokens <= n <= input_tokens
        assert n_tokens(tokenizer, t.reference) >= 256
        body, order_line = t.prompt.rsplit("# order: ", 1)
        labels = [x.strip() for x in order_line.strip().split(",")]
        assert t.prompt.endswith(ORDER_LINE.format(order=", ".join(labels)))
        assert sorted(labels) == [chr(ord("A") + i) for i in range(len(t.files))]
        assert labels != sorted(labels), "the order must differ from the prompt's"
        passages = dict(zip(sorted(labels), body.split("# passage ")[1:]))
        # The continuation is the passages again, in the stated order (the last one cut at a line end).
        expected = "".join(PASSAGE_HEADER.format(label=lb) + passages[lb][2:] for lb in labels)
        assert expected.startswith(t.reference) and t.reference.startswith(PASSAGE_HEADER.format(label=labels[0]))
        whole = tokenizer(t.prompt + t.reference, add_special_tokens=False)["input_ids"]
        assert whole == tokenizer(t.prompt, add_special_tokens=False)["input_ids"] + \
            tokenizer(t.reference, add_special_tokens=False)["input_ids"]


def test_sort_tasks_deterministic_and_from_source_dir(tokenizer, tmp_path):
    assert build_tasks(tokenizer, "sort", n=2, input_tokens=1024, seed=5) == \
        build_tasks(tokenizer, "sort", n=2, input_tokens=1024, seed=5)
    for i in range(8):
        body = "\n".join(f"    v{j} = f_{i}(a_{j}, {j})" for j in range(12))
        (tmp_path / f"m{i}.py").write_text("".join(f"def fn_{i}_{k}():\n{body}\n    return v0\n\n\n" for k in range(4)))
    tasks = build_tasks(tokenizer, "sort", n=2, input_tokens=1024, source_dir=tmp_path)
    assert all(f.startswith("m") for t in tasks for f in t.files)
    (tmp_path / "m0.py").write_text("x = 1\n")
    for i in range(1, 8):
        (tmp_path / f"m{i}.py").unlink()
    with pytest.raises(ValueError, match="too few functions or classes"):
        build_tasks(tokenizer, "sort", n=1, input_tokens=1024, source_dir=tmp_path)
