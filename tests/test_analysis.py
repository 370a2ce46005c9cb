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
    _run(tmp_path, monkeypatch, "eval", ["experiment=evaluate", "quant=int4_joint", "quant.content.group_size=32",
                                         "eval.tasks=[toy_niah_single_1]", "eval.limit=2",
                                         "eval.data.niah_lengths=[256]", "eval.data.niah_per_length=2"])
    out = tmp_path / "tables"
    tables.main([str(tmp_path / "outputs"), "--out", str(out)])
    acc = (out / "accuracy.md").read_text()
    assert "int4_joint" in acc and "int4 g32" in acc and "int4 tok" in acc and "toy_niah_single_1" in acc
    assert "rope=0" in acc  # the positional control's row
    assert "656" in (out / "cache_bytes.md").read_text()
    amp = (out / "amplification.md").read_text()
    assert "minicpm3" in amp and "gaussian" in amp
