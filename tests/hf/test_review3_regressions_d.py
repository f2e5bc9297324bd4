"""Regression review D of 6755d1e (plain JSON corpora re-read from the files, Parquet checked from
its schema) and 8caea32 (HF interop): corpora that loaded before these commits and must still load,
with the same documents."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from mnemo.data.corpus import load_corpus  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _needs_datasets():
    """Every test here skips without ``datasets`` (asked when the tests run, not when the file is
    collected: importing it, with pandas and pyarrow, cost each pytest process ~1.5 s)."""
    pytest.importorskip("datasets")


@pytest.mark.parametrize("text", ['["a b", "c"]', '[\n  "a b",\n  "c"\n]\n'], ids=["one-line", "indented"])
def test_a_jsonl_file_holding_an_array_of_strings_is_still_a_text_column(tmp_path, text):
    """datasets reads a file that is one JSON array of strings as the column ``"text"``, whatever
    its suffix; 6755d1e refused it in a ``.jsonl`` file ("a JSON list, expected one object per
    line") though it loaded before."""
    f = tmp_path / "a.jsonl"
    f.write_text(text, encoding="utf-8")
    assert load_corpus(str(f)).documents == ["a b", "c"]
    # an array mixing objects and other values is still refused in a .jsonl file
    f.write_text('[{"text": "a"}, "b"]', encoding="utf-8")
    with pytest.raises(ValueError, match=r"a\.jsonl line 1: a JSON list, expected one object per line"):
        load_corpus(str(f))


def test_a_dictionary_encoded_parquet_text_column_still_loads(tmp_path):
    """A dictionary-encoded string column (pandas' ``category``, pyarrow's ``dictionary_encode``)
    is text: datasets reads its values; 6755d1e's schema check refused it ("holds
    dictionary<values=string, ...>, not text") though it loaded before. A folder mixing it with a
    plain string file keeps the files' order."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for i, kind in enumerate((pa.string(), pa.large_string())):
        d = tmp_path / f"d{i}"
        d.mkdir()
        column = pa.array(["x", "y", "x", None], kind).dictionary_encode()
        pq.write_table(pa.table({"text": column, "n": [1, 2, 3, 4]}), d / "a.parquet")
        assert str(pq.read_schema(d / "a.parquet").field("text").type).startswith("dictionary<")
        assert load_corpus(str(d / "a.parquet")).documents == ["x", "y", "x"]
        pq.write_table(pa.table({"text": ["z"]}), d / "b.parquet")
        assert load_corpus(str(d)).documents == ["x", "y", "x", "z"]
