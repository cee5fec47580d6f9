import json

import pytest

from rift_ada.data import load_speedbench


def row(i, category, text, **kw):
    r = {"question_id": f"q{i}", "category": category, "sub_category": "sorting", "turns": [text],
         "source": "AdaLEval/textsort", "src_id": str(i), "difficulty": "", "multiturn": False}
    r.update(kw)
    return r


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_filters_and_fields(tmp_path, tokenizer):
    rows = [row(0, "low_entropy", "sort these: " + "b a " * 50), row(1, "high_entropy", "write a poem"),
            row(2, "mixed", "summarise " + "words " * 400)]
    path = write_jsonl(tmp_path / "sb.jsonl", rows)
    assert [t.task_id for t in load_speedbench(path)] == ["q0", "q1", "q2"]
    assert [t.task_id for t in load_speedbench(path, category="low")] == ["q0"]
    assert [t.family for t in load_speedbench(path, category="high_entropy")] == ["high_entropy"]
    short = load_speedbench(path, tokenizer, max_tokens=200)
    assert [t.task_id for t in short] == ["q0", "q1"]
    assert [t.task_id for t in load_speedbench(path, tokenizer, min_tokens=200)] == ["q2"]


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [row(0, "low_entropy", "abc"), row(1, "mixed", "def")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sb.parquet")
    assert [t.prompt for t in load_speedbench(tmp_path / "sb.parquet")] == ["abc", "def"]


def test_chat_template_applied(tmp_path, tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
                        "{% if add_generation_prompt %}<assistant>{% endif %}"
    path = write_jsonl(tmp_path / "sb.jsonl", [row(0, "mixed", "hello")])
    assert load_speedbench(path, tok)[0].prompt == "<user>hello<assistant>"
    assert load_speedbench(path, tok, chat_template=False)[0].prompt == "hello"


def test_errors_name_the_row(tmp_path):
    ph = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
    path = write_jsonl(tmp_path / "ph.jsonl", [row(0, "mixed", "ok"), row(1, "mixed", ph)])
    with pytest.raises(ValueError, match=r"row 1 \(question_id 'q1'\).*placeholder"):
        load_speedbench(path)
    bad = dict(row(0, "mixed", "x"))
    del bad["turns"]
    with pytest.raises(ValueError, match="missing field"):
        load_speedbench(write_jsonl(tmp_path / "bad.jsonl", [bad]))
    with pytest.raises(ValueError, match="'turns' must be"):
        load_speedbench(write_jsonl(tmp_path / "bad2.jsonl", [row(0, "mixed", "x", turns="x")]))
    with pytest.raises(FileNotFoundError):
        load_speedbench(tmp_path / "missing.jsonl")
