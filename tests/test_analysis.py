"""analysis/ regenerates every table and figure from run records alone."""

import json
import shutil

import pandas as pd
import pytest
from conftest import compose

from analysis import figures, tables
from analysis.__main__ import main as analysis_main
from analysis.records import load_frame, newest_complete
from mla_quant import prepare, runner
from mla_quant.models import build
from mla_quant.stages import evaluate as evaluate_stage


def _run(root, monkeypatch, name, overrides):
    run_dir = root / name
    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: run_dir)
    runner.main(compose(["logger=none", *overrides]))
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("records") / "outputs"
    mp = pytest.MonkeyPatch()
    try:
        _run(root, mp, "bytes", ["experiment=cache_bytes", "task.contexts=[512,2048]", "task.chunk=256",
                                 "task.options=[bf16,fp8_ds_mla]"])
        _run(root, mp, "sens", ["experiment=sensitivity", "model=tiny_minicpm3", "task.seeds=1",
                                "task.sweep_nmse=[0.005,0.02]", "task.rope_pairs=false", "task.mechanism=false",
                                "task.probe.num_sequences=1", "task.probe.seq_len=32"])
        needles = ["eval.tasks=[toy_niah_single_1]", "eval.limit=2", "eval.data.niah_lengths=[256]",
                   "eval.data.niah_per_length=2"]
        loads = []  # every tokenizer the evaluate stage loads (it loads the model's once)
        for module in (evaluate_stage, prepare):
            mp.setattr(module, "load_tokenizer", lambda cfg, load=build.load_tokenizer: loads.append(1) or load(cfg))
        _run(root, mp, "eval", ["experiment=evaluate", "quant=int4_joint", "quant.content.group_size=32", *needles])
        (root / "eval" / "tokenizer_loads").write_text(str(len(loads)))
        _run(root, mp, "eval_quarot", ["experiment=evaluate", "quant=int4_joint", "quant.content.group_size=32",
                                       "transform=quarot", "eval.control_no_rope.enabled=false", *needles])
        _run(root, mp, "eval_bf16", ["experiment=evaluate", "quant=bf16", "eval.control_no_rope.enabled=false",
                                     *needles])
        placed = [*needles[:-1], "eval.data.niah_per_length=3", "eval.data.needle_outside=[4,128]",
                  "eval.control_no_rope.enabled=false"]
        _run(root, mp, "eval_placed", ["experiment=evaluate", "quant=int4_joint", "quant.content.group_size=32",
                                       *placed])
        _run(root, mp, "eval_placed_quarot", ["experiment=evaluate", "quant=int4_joint", "transform=quarot",
                                              "quant.content.group_size=32", *placed])
        _run(root, mp, "eval_mixed", ["experiment=evaluate", "quant=mixed", "quant.budget=int4_joint",
                                      "quant.allocation.sequences=2", "quant.allocation.seeds=1", "calib.samples=4",
                                      "calib.seq_len=128", f"quant.allocation.cache_dir={root.parent / 'alloc'}",
                                      "eval.control_no_rope.enabled=false", *needles])
    finally:
        mp.undo()
    return root


def test_every_table_and_figure_from_records(runs, tmp_path):
    out = tmp_path / "out"
    analysis_main([str(runs), "--out", str(out)])
    acc = (out / "accuracy.md").read_text()
    assert "int4_joint" in acc and "int4 g32" in acc and "int4 tok" in acc and "toy_niah_single_1" in acc
    assert "rope=0" in acc and "±" in acc  # the positional control's row; standard errors beside the scores
    assert str(runs / "eval" / "record.json") in acc  # the records each artifact came from
    assert "656" in (out / "memory.md").read_text()
    amp = (out / "amplification.md").read_text()
    assert "tiny_minicpm3" in amp and "gaussian" in amp
    for name in ("accuracy", "memory", "amplification", "ruler"):
        assert (out / f"{name}.tex").read_text().count("\\begin{tabular}") == 1
        assert (out / f"{name}.csv").stat().st_size > 0
    for name in ("amplification_by_model", "amplification_per_layer_tiny_minicpm3_gaussian",
                 "output_vs_injected_nmse", "memory_bytes_vs_context", "ruler_accuracy_vs_length_toy_mla",
                 "accuracy_vs_bytes"):
        assert (out / f"{name}.png").stat().st_size > 1000 and (out / f"{name}.pdf").stat().st_size > 1000
        assert "record.json" in (out / f"{name}.sources.txt").read_text()
    ruler = pd.read_csv(out / "ruler.csv")
    assert set(ruler["length"]) == {256} and set(ruler["task"]) == {"toy_niah_single_1"}
    assert sorted(ruler["method"]) == ["none"] * 4 + ["quarot"] * 2  # RTN, BF16, mixed, placed; QuaRot, placed
    assert "mixed sensitivity @int4_joint" in (out / "mixed.md").read_text()
    assert "quarot" in (out / "paired.md").read_text() and "paired" in (out / "index.md").read_text()
    assert "accuracy" in (out / "index.md").read_text()


def test_samples_beside_the_record_reproduce_its_scores(runs):
    """eval.log_samples: per-example scores in <run>/samples/<task>.jsonl, whose mean is the recorded score."""
    rec = json.loads((runs / "eval" / "record.json").read_text())
    for folder, prefix in ((runs / "eval" / "samples", "eval"),
                           (runs / "eval" / "samples" / "control_no_rope", "eval/control_no_rope")):
        rows = [json.loads(line) for line in (folder / "toy_niah_single_1.jsonl").read_text().splitlines()]
        scores = [r["metrics"]["exact_match"] for r in rows if r["filter"] == "none"]
        assert len(scores) == 2 and {"doc_id", "doc_hash", "target", "response"} <= set(rows[0])
        assert sum(scores) / len(scores) == pytest.approx(rec["metrics"][f"{prefix}/toy_niah_single_1/exact_match"])


def test_paired_comparison_uses_the_same_examples(runs, tmp_path):
    t = tables.paired(load_frame([runs]))
    row = t.long[(t.long["method"] == "quarot") & (t.long["task"] == "toy_niah_single_1")
                 & (t.long["eval set"] == "test")].iloc[0]
    assert row["examples"] == 2 and row["won"] + row["lost"] <= 2
    score = json.loads((runs / "eval_quarot" / "record.json").read_text())["metrics"]
    rtn = json.loads((runs / "eval" / "record.json").read_text())["metrics"]
    assert row["score"] == pytest.approx(score["eval/toy_niah_single_1/exact_match"])
    assert row["delta"] == pytest.approx(score["eval/toy_niah_single_1/exact_match"]
                                         - rtn["eval/toy_niah_single_1/exact_match"])
    bf16 = json.loads((runs / "eval_bf16" / "record.json").read_text())["metrics"]
    assert row["BF16"] == pytest.approx(bf16["eval/toy_niah_single_1/exact_match"])
    assert set(t.sources) == {str(runs / n / "record.json") for n in ("eval", "eval_quarot", "eval_placed",
                                                                       "eval_placed_quarot")}
    # a run without samples (eval.log_samples=false) is left out rather than guessed
    copy = tmp_path / "copy"
    shutil.copytree(runs, copy)
    shutil.rmtree(copy / "eval_quarot" / "samples")
    assert set(tables.paired(load_frame([copy])).long["eval set"]) == {"test needle outside 4+128"}


def test_mixed_runs_pair_with_the_uniform_option_on_the_same_examples(runs):
    t = tables.mixed(load_frame([runs]))
    (row,) = t.long[t.long["task"] == "toy_niah_single_1"].to_dict("records")
    mixed = json.loads((runs / "eval_mixed" / "record.json").read_text())["metrics"]
    uniform = json.loads((runs / "eval" / "record.json").read_text())["metrics"]
    assert row["cache"] == "mixed sensitivity @int4_joint" and row["uniform"] == "int4_joint" and row["examples"] == 2
    assert row["score"] == pytest.approx(mixed["eval/toy_niah_single_1/exact_match"])
    assert row["uniform score"] == pytest.approx(uniform["eval/toy_niah_single_1/exact_match"])
    assert row["B quantized"] == mixed["cache/bytes_per_token_per_layer"] <= mixed["alloc/budget"] == 72
    assert row["B held"] == mixed["cache/bf16_B_per_token_per_layer"] > row["B quantized"]  # its protected region
    assert set(t.sources) == {str(runs / n / "record.json") for n in ("eval_mixed", "eval")}


def test_a_mixed_run_pairs_with_its_methods_run_else_the_untransformed_one():
    """An engine format (no transform is fitted for it) is taken as the engine ships it, method none; an option with a
    run of the mixed run's own method is taken with that method; another option's bytes never match."""
    def row(cache, method, nbytes, **extra):
        return {"cache": cache, "model": "toy_mla", "method": method, "protected": "0+0", "B quantized": nbytes,
                **extra}

    frame = pd.DataFrame([row("int4_joint", "none", 72), row("int4_joint", "quantmla", 72),
                          row("nvfp4_ds_mla", "none", 70), row("nvfp4_ds_mla", "none", 80)])
    everything = pd.Series(True, index=frame.index)
    for budget, nbytes, method, want in (("int4_joint", 72, "quantmla", 1), ("int4_joint", 72, "quarot", 0),
                                         ("nvfp4_ds_mla", 70, "quantmla", 2)):
        mixed = row("mixed", method, nbytes, budget=budget, **{"budget B": nbytes})
        assert list(tables._uniform(frame, mixed, everything).index) == [want], (budget, method)
    assert tables._uniform(frame, row("mixed", "none", 70, budget="int4_joint", **{"budget B": 72}),
                           everything & (frame["protected"] == "4+128")).empty


def test_newest_complete_record_wins_by_time_and_bad_records_are_skipped(runs, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(runs / "eval", root / "b_old")
    shutil.copytree(runs / "eval", root / "a_new")  # sorts first by path, but is the newer record
    rec = json.loads((root / "a_new" / "record.json").read_text())
    rec["finished"] = "2099-01-01T00:00:00+0000"
    rec["metrics"]["eval/toy_niah_single_1/exact_match"] = 0.123
    (root / "a_new" / "record.json").write_text(json.dumps(rec))
    rec["status"], rec["finished"] = "interrupted", "2100-01-01T00:00:00+0000"  # newer but not complete
    rec["metrics"]["eval/toy_niah_single_1/exact_match"] = 0.5
    (root / "c_partial").mkdir()
    (root / "c_partial" / "record.json").write_text(json.dumps(rec))
    shutil.copytree(runs / "eval", root / "a_new" / "wandb" / "files")  # W&B's copy is not a record
    (root / "d_corrupt").mkdir()
    (root / "d_corrupt" / "record.json").write_text('{"config": {"task": ')
    (root / "e_partial").mkdir()
    (root / "e_partial" / "record.json").write_text(json.dumps({"config": {}, "status": "ok"}))
    with pytest.warns(UserWarning) as caught:
        df = load_frame([root])
    warned = " ".join(str(w.message) for w in caught)
    assert "d_corrupt" in warned and "e_partial" in warned
    assert len(df) == 3  # b_old, a_new, c_partial; not the wandb copy
    latest = newest_complete(df, "evaluate")
    assert len(latest) == 1 and latest.iloc[0]["source"].endswith("a_new/record.json")
    acc = tables.accuracy(df).long
    assert acc[acc["run as"] == "model"]["score"].tolist() == [0.123]


def test_missing_cells_stay_empty_and_log_scale_when_values_span_decades(runs, tmp_path):
    shutil.copytree(runs / "eval", tmp_path / "other")  # a second method that ran a different task
    rec = json.loads((tmp_path / "other" / "record.json").read_text())
    rec["metrics"] = {k.replace("toy_niah_single_1", "toy_gsm8k"): v for k, v in rec["metrics"].items()}
    rec["config"]["transform"]["name"], rec["identity"] = "smoothquant", "other"
    (tmp_path / "other" / "record.json").write_text(json.dumps(rec))
    acc = tables.accuracy(load_frame([runs, tmp_path])).rows
    rows = acc[(acc["run as"] == "model") & (acc["cache"] == "int4_joint") & (acc["eval set"] == "test")]
    rows = rows.set_index("method")
    assert rows.loc["smoothquant", "toy_niah_single_1"] == "" and rows.loc["none", "toy_gsm8k"] == ""
    assert rows.loc["none", "toy_niah_single_1"] != "" and rows.loc["smoothquant", "toy_gsm8k"] != ""
    df = load_frame([runs])
    amp = tables.amplification(df)
    layer = amp.per_layer.copy()
    layer["predicted"] = [1000.0 * (i + 1) for i in range(len(layer))]
    layer["measured"] = [3.0] * len(layer)
    amp.per_layer = layer
    figs = figures.amplification_figures(amp)
    fig, _ = figs["amplification_per_layer_tiny_minicpm3_gaussian"]
    assert fig.axes[0].get_yscale() == "log"
    layer["predicted"] = [2.0] * len(layer)
    figs = figures.amplification_figures(amp)
    assert figs["amplification_per_layer_tiny_minicpm3_gaussian"][0].axes[0].get_yscale() == "linear"


def test_wandb_export_reads_into_the_same_frame(runs, tmp_path):
    rec = json.loads((runs / "eval" / "record.json").read_text())
    flat = pd.json_normalize(rec["config"], sep=".").iloc[0].to_dict()
    row = {"Name": "toy_mla/int4_joint/none", "State": "finished", "Created": "2026-01-01T00:00:00Z",
           **{k: v for k, v in flat.items() if not isinstance(v, (list, dict))},
           **{k: v for k, v in rec["metrics"].items()}}
    pd.DataFrame([row]).to_csv(tmp_path / "export.csv", index=False)
    df = load_frame([], wandb_exports=[tmp_path / "export.csv"])
    assert len(df) == 1 and df.iloc[0]["status"] == "ok" and df.iloc[0]["experiment"] == "evaluate"
    ours = tables.accuracy(load_frame([runs])).long
    ours = ours[ours["source"] == str(runs / "eval" / "record.json")]
    theirs = tables.accuracy(df).long
    assert theirs["score"].tolist() == ours["score"].tolist() and set(theirs["cache"]) == {"int4_joint"}
    runs_json = [{"name": row["Name"], "state": "finished", "created_at": row["Created"], "config": rec["config"],
                  "summary": rec["metrics"]}]  # as wandb.Api().runs() gives them
    (tmp_path / "export.json").write_text(json.dumps(runs_json))
    from_json = tables.accuracy(load_frame([], wandb_exports=[tmp_path / "export.json"])).long
    assert from_json["score"].tolist() == ours["score"].tolist()


def test_needle_regions_split_the_scores_and_the_placement_quantizes_every_needle(runs, tmp_path):
    """Each example's region is in its samples; the record splits exact_match by region; with
    eval.data.needle_outside every asked needle is stored quantized, and the tables say so: the needles table per
    run, paired rows over the needles both caches quantized, the eval set in every row, bytes held beside bytes per
    quantized token."""
    rows = [json.loads(line) for line in (runs / "eval_placed" / "samples" / "toy_niah_single_1.jsonl").read_text()
            .splitlines()]
    assert {r["needle"] for r in rows} == {"quantized"}
    placed = json.loads((runs / "eval_placed" / "record.json").read_text())["metrics"]
    assert placed["eval/toy_niah_single_1/needle_quantized/examples"] == 2  # eval.limit=2
    assert placed["eval/toy_niah_single_1/needle_quantized/exact_match"] == placed["eval/toy_niah_single_1/exact_match"]
    bf16 = json.loads((runs / "eval_bf16" / "record.json").read_text())["metrics"]
    assert bf16["eval/toy_niah_single_1/needle_unquantized/examples"] == 2
    first = json.loads((runs / "eval" / "record.json").read_text())["metrics"]  # its no-RoPE control ran after
    for name in ("held_B_per_token_per_layer", "bf16_B_per_token_per_layer", "token_layers"):
        assert first[f"cache/{name}"] == pytest.approx(first[f"eval/toy_niah_single_1/cache/{name}"])  # one task
    assert first["eval/control_no_rope/toy_niah_single_1/exact_match"] is not None
    assert (runs / "eval" / "tokenizer_loads").read_text() == "1"
    assert bf16["cache/bf16_B_per_token_per_layer"] == pytest.approx((96 + 16) * 2)
    assert bf16["cache/held_B_per_token_per_layer"] == pytest.approx((96 + 16) * 4)  # the toy runs in float32
    frame = load_frame([runs])
    t = tables.needles(frame)
    by_set = {(r["method"], r["eval set"]): r for r in t.long.to_dict("records") if r["cache"] == "int4_joint"}
    assert by_set["none", "test needle outside 4+128"]["quantized n"] == 2
    assert by_set["none", "test"]["quantized n"] + by_set["none", "test"]["protected n"] \
        + by_set["none", "test"]["straddling n"] == 2
    p = tables.paired(frame)
    assert set(p.long["eval set"]) == {"test", "test needle outside 4+128"}
    placed_rows = p.long[p.long["eval set"] == "test needle outside 4+128"]
    assert list(placed_rows["task"]) == ["toy_niah_single_1"]  # every needle quantized: no subset row to add
    quarot = json.loads((runs / "eval_placed_quarot" / "record.json").read_text())["metrics"]
    assert placed_rows["B held"].iloc[0] == pytest.approx(quarot["cache/bf16_B_per_token_per_layer"])
    acc = tables.accuracy(frame).rows
    assert {"B quantized", "B held", "eval set"} <= set(acc.columns)


def test_needle_quantized_keeps_the_examples_every_quantizing_cache_quantized():
    index = pd.MultiIndex.from_tuples([(i, f"h{i}") for i in range(4)], names=["doc_id", "doc_hash"])
    scores = pd.Series([1.0, 0.0, 1.0, 1.0], index=index)
    ours = pd.Series(["quantized", "protected", "straddling", "quantized"], index=index)
    peer = pd.Series(["quantized"] * 4, index=index)
    bf16 = pd.Series(["unquantized"] * 4, index=index)
    assert list(tables.needle_quantized(scores, ours, peer).index.get_level_values(0)) == [0, 3]
    assert len(tables.needle_quantized(scores, peer, bf16)) == 4
    assert tables.needle_quantized(scores, ours, None).empty  # a run without regions cannot vouch for its needles


def test_accuracy_vs_bytes_plots_the_reported_sets_only():
    """A development split's runs are the choices' sweeps: the figure of results leaves them out."""
    row = {"model": "toy_mla", "method": "none", "cache": "int2_joint", "protected": "4+128", "run as": "model",
           "task": "toy_niah_single_1", "score": 0.5, "B held": 76.0}
    long = pd.DataFrame([{**row, "eval set": "test needle outside 4+128", "source": "test/record.json"},
                         {**row, "eval set": "dev needle outside 4+128", "source": "dev/record.json", "score": 0.9}])
    out = figures.accuracy_vs_bytes(tables.Table("accuracy", "", long.drop(columns="source"), long))
    fig, sources = out["accuracy_vs_bytes"]
    assert sources == ["test/record.json"]
    figures.plt.close(fig)
