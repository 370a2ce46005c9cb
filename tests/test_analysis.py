"""analysis/ builds its tables from run records alone."""

from conftest import compose

from analysis import tables
from mla_quant import pipeline


def _run(tmp_path, monkeypatch, name, overrides):
    run_dir = tmp_path / "outputs" / name
    monkeypatch.setattr(pipeline, "run_dir_of", lambda cfg: run_dir)
    pipeline.main(compose(["logger=none", *overrides]))


def test_tables_from_records(tmp_path, monkeypatch):
    _run(tmp_path, monkeypatch, "bytes", ["experiment=cache_bytes", "task.contexts=[512]", "task.chunk=256",
                                          "task.options=[bf16,fp8_ds_mla]"])
    _run(tmp_path, monkeypatch, "sens", ["experiment=sensitivity", "model=tiny_minicpm3", "task.seeds=1",
                                         "task.sweep_nmse=[]", "task.rope_pairs=false", "task.mechanism=false",
                                         "task.probe.num_sequences=1", "task.probe.seq_len=32"])
    out = tmp_path / "tables"
    tables.main([str(tmp_path / "outputs"), "--out", str(out)])
    assert "656" in (out / "cache_bytes.md").read_text()
    amp = (out / "amplification.md").read_text()
    assert "minicpm3" in amp and "gaussian" in amp
