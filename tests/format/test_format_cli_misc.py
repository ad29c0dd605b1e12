"""CLI (info/validate/export), tokenizer fingerprint, and the no-torch-at-import promise."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheWriter, tokenizer_fingerprint
from logitcache.cache_format.spec import layout_named
from logitcache.client.cli import app
from typer.testing import CliRunner


def test_cli_info_validate_export(tmp_path):
    url = tmp_path / "c"
    recs = make_records(10, seed=9)
    with CacheWriter.open(url, make_manifest()) as w:
        w.append(recs)
    runner = CliRunner()
    res = runner.invoke(app, ["info", str(url), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["manifest"]["num_sequences"] == 10
    assert doc["raw_bytes_per_position"] == 8 * 6 and doc["bytes_per_position"] > 0
    assert doc["layout"] == "default"
    res = runner.invoke(app, ["info", str(url)])
    assert "compression ratio" in res.output and "tiny-teacher" in res.output
    ra = tmp_path / "ra"
    with CacheWriter.open(ra, make_manifest(), layout=layout_named("random_access")) as w:
        w.append(recs[:2])
    res = runner.invoke(app, ["info", str(ra)])
    assert res.exit_code == 0, res.output
    assert any(
        line.split() == ["layout", "preset", "random_access"] for line in res.output.splitlines()
    )
    assert runner.invoke(app, ["validate", str(url)]).exit_code == 0
    out = tmp_path / "x.jsonl"
    res = runner.invoke(app, ["export", str(url), str(out), "--limit", "4"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["key"] for x in lines] == ["s0", "s1", "s2", "s3"]
    assert lines[2]["topk_ids"] == recs[2].topk_ids.tolist()
    (url / "seq_lengths" / "zarr.json").unlink()
    assert runner.invoke(app, ["validate", str(url)]).exit_code == 1


class _Tok:
    """Duck-typed tokenizer: what tokenizer_fingerprint reads from a HF tokenizer."""

    def __init__(self, vocab, eos="</s>"):
        self._vocab = vocab
        self.eos_token = eos
        self.eos_token_id = vocab.get(eos)

    def get_vocab(self):
        return dict(self._vocab)


def test_fingerprint_duck_typed_and_sensitive():
    v = {"a": 0, "b": 1, "</s>": 2}
    f = tokenizer_fingerprint(_Tok(v))
    assert f.startswith("sha256:") and f == tokenizer_fingerprint(_Tok(dict(reversed(v.items()))))
    assert f != tokenizer_fingerprint(_Tok({"a": 1, "b": 0, "</s>": 2}))
    assert f != tokenizer_fingerprint(_Tok(v, eos="a"))


def test_fingerprint_real_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"x": 0, "y": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    f1 = tokenizer_fingerprint(tok)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert tokenizers and f1 != tokenizer_fingerprint(tok)  # backend pipeline matters


@pytest.mark.subprocess
def test_import_does_not_import_torch():
    code = "import sys, logitcache.cache_format as c; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert np  # keep numpy import used


def test_cli_wrong_path_is_one_line_with_nearest_stores(tmp_path):
    """issue #15: info/validate/export on a wrong path print one line (no traceback) naming the
    nearest existing stores, exit status 2."""
    for name in ("train_cache", "eval_cache"):
        with CacheWriter.open(tmp_path / name, make_manifest(), fsync=False) as w:
            w.append(make_records(2))
    (tmp_path / "not_a_store").mkdir()
    runner = CliRunner()
    for args in (
        ["info", str(tmp_path / "train_cach")],
        ["validate", str(tmp_path / "train_cach")],
        ["export", str(tmp_path / "train_cach"), str(tmp_path / "x.jsonl")],
        ["info", str(tmp_path / "missing_dir" / "train_cache")],
        ["info", str(tmp_path / "not_a_store")],
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        err = res.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in res.output, err
        assert err.startswith("error: no logitcache store at")
        assert f"nearest stores: {tmp_path / 'train_cache'}" in err or "eval_cache" in err
    res = runner.invoke(app, ["info", str(tmp_path / "train_cach")])
    assert res.stderr.split("nearest stores: ")[1].split(", ")[0] == str(tmp_path / "train_cache")
