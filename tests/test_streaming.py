"""Streamed models (model.streaming=true): one decoder layer resident at a time, read from the checkpoint's shards;
the streamed stages give what the in-memory stages give."""

import json
from pathlib import Path

import pytest
import torch
from conftest import compose, real_option

from mla_quant.models.build import streamed_model
from mla_quant.models.streaming import layer_arguments
from mla_quant.models.absorbed import decoder_layers, new_cache
from mla_quant.prepare import build_model, preflight
from mla_quant.stages import quality, sensitivity

# What differs between families for a stream, split between the tests below: fused experts converted on load and a
# BF16 checkpoint computed in float32 (V3), a top-k handed from layer to layer (GLM-5), a hybrid stack's per-type masks
# and recurrent states (Kimi-Linear), two MLA blocks per decoder layer (LongCat), an LM head tied to the embedding
# (MiniCPM3), a multimodal wrapper's text decoder (Hunyuan V4 VL).
FAMILIES = ["tiny_kimi_linear", "tiny_minicpm3", "tiny_hy_v4_vl"]


def _checkpoint(tiny: str, folder: Path, dtype: torch.dtype = torch.float32, **config) -> Path:
    overrides = [f"model={tiny}"] + [f"model.config.{k}={v}" for k, v in config.items()]
    model = build_model(compose(overrides).model, absorbed=False).to(dtype)
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder


def _quality_overrides(tiny: str, folder: Path, *extra: str) -> list[str]:
    return [f"model={real_option(tiny)}", f"model.path={folder}", "model.dtype=float32", "model.device_map=null",
            "model.tokenizer=null", "model.quant_group_size.wide=16", "model.quant_group_size.narrow=16",
            "quant=int4_joint", "quant.protected.n_sink=0", "quant.protected.recent=0", "device=cpu", "logger=none",
            *extra]


def _quality_cfg(tiny: str, folder: Path, *extra: str):
    return compose([*_quality_overrides(tiny, folder), "experiment=quality", "task.data.source=random",
                    "task.data.samples=3", "task.data.seq_len=40", "task.batch_size=2", *extra])


QUALITY = ("quality/ppl", "quality/ppl_unquantized", "quality/kl", "quality/kl_p99", "quality/kl_stderr",
           "quality/top1_agree", "quality/tokens", "cache/bytes_per_token_per_layer")


@pytest.mark.parametrize("tiny,stored", [(f, torch.float32) for f in FAMILIES]
                         + [("tiny_deepseek_v3", torch.bfloat16)])
def test_streamed_quality_equals_in_memory(tiny, stored, tmp_path):
    """float32 compute over a float32 checkpoint, and over a BF16 one (read as stored, cast after)."""
    folder = _checkpoint(tiny, tmp_path / "checkpoint", stored)
    runs = {}
    for streaming in (False, True):
        (tmp_path / str(streaming)).mkdir()
        runs[streaming] = quality.run(_quality_cfg(tiny, folder, f"model.streaming={streaming}"),
                                      tmp_path / str(streaming)).metrics
    assert runs[False]["quality/kl"] > 0  # the quantized cache changes the output: the comparison means something
    for key in QUALITY:
        a, b = runs[False][key], runs[True][key]
        assert b == pytest.approx(a, rel=1e-5, abs=1e-9), f"{tiny}: {key} in memory {a}, streamed {b}"
    shards = runs[True]
    assert shards["streaming/layers"] == len(decoder_layers(build_model(compose([f"model={tiny}"]).model)))
    # every tensor read once, the outer ones but the embedding twice (before the layers and for the logits)
    assert 1.0 <= shards["streaming/read_ratio"] <= 1.5


@pytest.mark.parametrize("tiny", ["tiny_glm_moe_dsa", "tiny_longcat_flash"])
def test_streamed_sensitivity_equals_in_memory(tiny, tmp_path):
    """Every metric of the study (amplification over seeds, per layer, predicted, mechanism split, per RoPE pair),
    with every injection's stream beside the clean one through each resident layer."""
    folder = _checkpoint(tiny, tmp_path / "checkpoint")
    runs = {}
    for streaming in (False, True):
        cfg = compose([f"model={real_option(tiny)}", f"model.path={folder}", "model.dtype=float32",
                       "model.device_map=null", "model.tokenizer=null", "experiment=sensitivity",
                       "task.probe.source=random", "task.probe.num_sequences=2", "task.probe.seq_len=32",
                       "task.seeds=2", "task.sweep_nmse=[0.01]", "device=cpu", "logger=none",
                       f"model.streaming={streaming}"])
        (tmp_path / str(streaming)).mkdir()
        runs[streaming] = sensitivity.run(cfg, tmp_path / str(streaming)).metrics
    compared = [k for k, v in runs[False].items() if isinstance(v, float) and not k.startswith("plan/")]
    assert any("/layer1/amplification" in k for k in compared) and any("rope_pair" in k for k in compared)
    for key in compared:
        assert runs[True][key] == pytest.approx(runs[False][key], rel=1e-5, abs=1e-12), key
    assert runs[True]["streaming/layers"] >= 2


@pytest.mark.parametrize("tiny", ["tiny_longcat_flash"])
def test_streamed_calibration_equals_in_memory(tiny, tmp_path):
    """QuantMLA fitted through the streamed sweep gives the in-memory fit's transforms and report; a streamed quality
    run folds them into each layer as it is read and equals the in-memory run with them folded; the fingerprint of
    the weights is the same streamed or not, so each finds the other's stored transforms."""
    from safetensors.torch import load_file

    from mla_quant.stages import calibrate

    folder = _checkpoint(tiny, tmp_path / "checkpoint")
    fit = ["transform=quantmla", "transform.fit.steps=3", "transform.fit.eval_every=1", "calib.source=random",
           "calib.samples=4", "calib.seq_len=24", "calib.batch_size=2"]
    runs, files = {}, {}
    for streaming in (False, True):
        store = tmp_path / f"calibration_{streaming}"
        (tmp_path / f"c{streaming}").mkdir()
        own = [f"model.streaming={streaming}", *fit, f"transform.fit.cache_dir={store}"]
        cal = calibrate.run(compose([*_quality_overrides(tiny, folder, *own), "experiment=calibrate"]),
                            tmp_path / f"c{streaming}")
        assert cal.metrics["calib/reused"] == 0
        files[streaming] = load_file(cal.metrics["calib/file"])
        (tmp_path / f"q{streaming}").mkdir()
        runs[streaming] = quality.run(_quality_cfg(tiny, folder, *own), tmp_path / f"q{streaming}").metrics
        assert runs[streaming]["calib/reused"] == 1  # the quality run found the calibration's transforms
    assert files[True].keys() == files[False].keys() and files[True]
    for key in files[False]:
        torch.testing.assert_close(files[True][key], files[False][key], rtol=1e-5, atol=1e-7, msg=key)
    for key in QUALITY:
        assert runs[True][key] == pytest.approx(runs[False][key], rel=1e-5, abs=1e-9), key
    assert runs[True]["calib/file"].rsplit("/", 1)[1] == runs[False]["calib/file"].rsplit("/", 1)[1]


@pytest.mark.parametrize("fp8", [False, True])
def test_streamed_export_equals_in_memory(fp8, tmp_path):
    """experiment=export streamed (QuantMLA folded into each layer as it is read, each layer written as it is done)
    writes the same tensors and config as the in-memory export, and transformers loads the folder with the same
    logits; from a block-FP8 checkpoint dequantized on load, both write full precision without its
    quantization_config."""
    from safetensors.torch import load_file

    from mla_quant.models.families import get_family
    from mla_quant.stages import export

    folder = (_fp8_checkpoint(tmp_path / "checkpoint", [8, 8]) if fp8
              else _checkpoint("tiny_deepseek_v3", tmp_path / "checkpoint"))
    fit = ["transform=quantmla", "transform.fit.steps=3", "calib.source=random", "calib.samples=4", "calib.seq_len=24",
           "calib.batch_size=2", f"transform.fit.cache_dir={tmp_path / 'calibration'}"]
    tensors, files, models = {}, {}, {}
    for streaming in (False, True):
        (tmp_path / str(streaming)).mkdir()
        cfg = compose([*_quality_overrides("tiny_deepseek_v3", folder, f"model.streaming={streaming}", *fit),
                       "experiment=export", "task.shard_mb=0.2"])
        result = export.run(cfg, tmp_path / str(streaming))
        assert result.ok and result.metrics["export/logits_rel_err"] < 1e-5
        out = tmp_path / str(streaming) / "checkpoint"
        files[streaming] = sorted(p.name for p in out.iterdir())
        tensors[streaming] = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
        models[streaming] = get_family("deepseek_v3").model_class.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager").eval()
    assert files[True] == files[False] and len([f for f in files[True] if f.endswith(".safetensors")]) > 1
    configs = [json.loads((tmp_path / str(s) / "checkpoint" / "config.json").read_text()) for s in (False, True)]
    assert "quantization_config" not in configs[0] and "quantization_config" not in configs[1]
    assert tensors[True].keys() == tensors[False].keys()
    for key, value in tensors[False].items():
        assert torch.equal(tensors[True][key], value), key
    ids = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(models[True](ids).logits, models[False](ids).logits)


def test_one_layer_resident_and_hidden_states_spilled(tmp_path):
    """A deeper stack: while layer j runs no other decoder layer holds a weight, each tensor of the layers is read
    exactly once, and with no host budget every hidden state goes through the scratch folder, results unchanged."""
    folder = _checkpoint("tiny_deepseek_v3", tmp_path / "checkpoint", num_hidden_layers=6)
    cfg = _quality_cfg("tiny_deepseek_v3", folder, "model.streaming=true")
    stream = streamed_model(cfg.model, "cpu")
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    stream.load_outer()
    hidden, arguments = layer_arguments(stream.model, ids, new_cache(stream.model))
    stream.release_outer()
    layers = decoder_layers(stream.model)
    seen = []
    for j, layer in stream.layers():
        resident = [i for i, other in enumerate(layers) if any(p.device.type != "meta" for p in other.parameters())]
        seen.append(resident)
        hidden = layer(hidden, **arguments[j])
    stream.close()
    assert seen == [[j] for j in range(6)]
    assert all(p.device.type == "meta" for layer in layers for p in layer.parameters())
    layer_bytes = sum(stream.shards.nbytes[k] for j in range(6) for k in stream.groups[j])
    outer_bytes = sum(stream.shards.nbytes[k] for k in stream.groups[None])
    assert stream.shards.bytes_read == layer_bytes + outer_bytes  # each read once (load_outer once here)
    figures = stream.figures()
    assert 0.0 <= figures["streaming/read_hidden_share"] <= 1.0 and figures["streaming/layers"] == 6

    runs = {}
    for budget in (8, 0):
        (tmp_path / f"b{budget}").mkdir()
        runs[budget] = quality.run(_quality_cfg("tiny_deepseek_v3", folder, "model.streaming=true",
                                                f"model.streaming_host_gb={budget}"), tmp_path / f"b{budget}").metrics
    assert runs[8]["streaming/spilled_gb"] == 0 and runs[0]["streaming/spilled_gb"] > 0
    assert runs[0]["streaming/host_peak_hidden_gb"] == 0
    assert runs[0]["quality/kl"] == runs[8]["quality/kl"] and runs[0]["quality/ppl"] == runs[8]["quality/ppl"]
    assert not any(p.name.startswith("mla_quant_stream_") for p in (tmp_path / "b0").iterdir())  # scratch removed


def test_a_folder_larger_than_the_memory_it_is_run_in(tmp_path):
    """`python run.py experiment=quality ... model.streaming=true` over a 16-layer folder: the run's peak of
    allocated memory above its start (its record's memory.peak_added_allocated_gb: the C allocator's bytes in use,
    exact) stays within two decoder layers in float32 (one resident, the next being read) and 64 MB, a fraction of
    the folder."""
    import subprocess
    import sys

    layers = 16
    folder = _checkpoint("tiny_deepseek_v3", tmp_path / "checkpoint", num_hidden_layers=layers, hidden_size=1024,
                         intermediate_size=2048, first_k_dense_replace=layers)
    folder_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "run.py", *_quality_overrides("tiny_deepseek_v3", folder),
                          "experiment=quality", "model.streaming=true", "task.data.source=random",
                          "task.data.samples=2", "task.data.seq_len=64", f"hydra.run.dir={run}"],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    record = json.loads((run / "record.json").read_text())
    layer_bytes = (folder_bytes - 2 * 1024 * 512 * 4) / layers  # the embedding and LM head (512 x 1024) aside
    added = record["memory"]["peak_added_allocated_gb"] * 1e9
    assert folder_bytes > 350e6 and record["metrics"]["streaming/read_ratio"] <= 1.1
    assert added <= 2 * layer_bytes + 64e6, (added / 1e6, layer_bytes / 1e6, folder_bytes / 1e6)


@pytest.mark.parametrize("extra,match", [
    (["transform=quantmla", "objective.rope.kind=next_token_kl"], "objective.rope.kind=next_token_kl reruns"),
    (["task.chunk=8"], "task.chunk=8 is not streamed"),
    (["model.path=null"], "set model.path"),
    (["model.streaming_host_gb=-1"], "model.streaming_host_gb=-1"),
    (["model.device_map=cuda:0"], "model.device_map='cuda:0'"),
])
def test_streaming_refusals_name_the_setting(extra, match, tmp_path):
    folder = _checkpoint("tiny_deepseek_v3", tmp_path / "checkpoint")
    cfg = _quality_cfg("tiny_deepseek_v3", folder, "model.streaming=true", *extra)
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        quality.run(cfg, tmp_path)


@pytest.mark.parametrize("experiment", ["evaluate", "verify", "serving", "pipeline"])
def test_stages_that_load_the_whole_model_refuse_streaming(experiment, tmp_path):
    """Refused by the runner, before the stage starts, for every experiment that does not stream."""
    from mla_quant import runner

    cfg = compose([f"model={real_option('tiny_deepseek_v3')}", f"model.path={tmp_path}", "model.streaming=true",
                   f"experiment={experiment}", "model.quant_group_size.wide=16", "model.quant_group_size.narrow=16",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=f"experiment={experiment} loads the whole model"):
        runner.main(cfg, tmp_path / "run")
    if experiment == "evaluate":
        with pytest.raises(ValueError, match="experiment=evaluate loads the whole model"):
            preflight(cfg)


def test_streamed_sensitivity_refuses_an_end_to_end_objective(tmp_path):
    cfg = compose([f"model={real_option('tiny_deepseek_v3')}", f"model.path={tmp_path}", "model.streaming=true",
                   "experiment=sensitivity", "transform=quantmla", "objective.content.kind=next_token_kl",
                   "model.quant_group_size.wide=16", "model.quant_group_size.narrow=16"])
    with pytest.raises(ValueError, match="objective.content.kind=next_token_kl reruns the whole model"):
        sensitivity.run(cfg, tmp_path)


def test_tiny_model_streaming_refused():
    cfg = compose(["model=tiny_deepseek_v3", "experiment=quality", "+model.streaming=true"])
    with pytest.raises(ValueError, match="streams a checkpoint's safetensors shards"):
        preflight(cfg)


def _leaves(value) -> list[float]:
    """The numbers of a nested JSON value, in order."""
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _leaves(value[k])]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [float(value)]


@pytest.mark.parametrize("quant", [["quant=mixed", "quant.allocation.sequences=2"],
                                   ["quant=int4_joint", "quant.content.quantizer=lloyd", "quant.rope.quantizer=lloyd"]])
def test_streamed_allocation_and_codebooks_equal_in_memory(quant, tmp_path):
    """quant=mixed (cache NMSE per choice, then the measured one-layer sensitivity: every injection's stream beside
    the clean one) and lloyd codebooks, each fitted through streamed passes over the layers with a transform folded
    as they are read: the same allocation or codebooks, and the same quality, as in memory; the fingerprint of the
    transformed weights is the same, so both are stored under one name."""
    folder = _checkpoint("tiny_deepseek_v3", tmp_path / "checkpoint")
    mixed = quant[0] == "quant=mixed"
    key = "alloc/file" if mixed else "cache/codebooks"
    runs, stored = {}, {}
    for streaming in (False, True):
        (tmp_path / str(streaming)).mkdir()
        own = [f"model.streaming={streaming}", *quant, "transform=quarot", "calib.source=random", "calib.samples=4",
               "calib.seq_len=24", "calib.batch_size=2", f"transform.fit.cache_dir={tmp_path / 'store'}",
               *([f"quant.allocation.cache_dir={tmp_path / 'store'}", "quant.allocation.reuse=false"] if mixed else [])]
        runs[streaming] = quality.run(_quality_cfg("tiny_deepseek_v3", folder, *own), tmp_path / str(streaming)).metrics
        assert runs[streaming]["alloc/reused" if mixed else "cache/codebooks_reused"] == 0
        path = Path(runs[streaming][key])
        stored[streaming] = json.loads(path.read_text())
        path.unlink()  # measured again by the other run (the same name: the same identity)
    assert runs[True][key] == runs[False][key]
    # one pass over the layers per fit (mixed: the cache NMSE, then the injections), then the quality run's own
    assert runs[True]["streaming/passes"] == (3 if mixed else 2)
    if mixed:
        assert stored[True]["picks"] == stored[False]["picks"]
        for part in ("weights", "nmse"):
            a, b = (torch.tensor(_leaves(stored[s][part]), dtype=torch.float64) for s in (False, True))
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-12, msg=part)
        assert len({b["content"] for b in stored[True]["bits"]} | {b["rope"] for b in stored[True]["bits"]}) > 1
    else:
        levels = [torch.tensor(lv) for _, _, lv in stored[False]["levels"]]
        assert len(levels) == 2 * 2  # 2 cache layers, both paths
        for (i, p, a), (_, _, b) in zip(stored[False]["levels"], stored[True]["levels"]):
            torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6, msg=f"{i} {p}")
    for k in QUALITY:
        assert runs[True][k] == pytest.approx(runs[False][k], rel=1e-5, abs=1e-9), k


def _fp8_checkpoint(folder: Path, block: list[int]) -> Path:
    """A tiny DeepSeek-V3 in DeepSeek-V3's layout: every decoder layer's linear in block FP8, the rest in BF16
    (experiment=write_checkpoint task.fp8_block)."""
    from mla_quant.stages import write_checkpoint

    cfg = compose(["experiment=write_checkpoint", "task.like=small_deepseek_v3", "task.dtype=bfloat16",
                   f"task.fp8_block=[{block[0]},{block[1]}]", f"task.out={folder}", "task.gsm8k_problems=1",
                   "logger=none"])
    write_checkpoint.run(cfg, folder.parent)
    return folder


def test_streamed_block_fp8_equals_in_memory(tmp_path):
    """A block-FP8 checkpoint streams with each layer's (codes, scales) pairs dequantized into the compute dtype as
    they are read: the same quality as transformers' own loading in memory (which dequantizes the same way on the
    CPU), bit for bit."""
    from safetensors import safe_open

    folder = _fp8_checkpoint(tmp_path / "checkpoint", [8, 8])
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"] == [8, 8]
    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == "F8_E4M3"
    assert stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == "F32"
    assert stored["model.layers.0.input_layernorm.weight"] == "BF16"
    runs = {}
    for streaming in (False, True):
        (tmp_path / str(streaming)).mkdir()
        runs[streaming] = quality.run(_quality_cfg("tiny_deepseek_v3", folder, f"model.streaming={streaming}"),
                                      tmp_path / str(streaming)).metrics
    assert runs[False]["quality/kl"] > 0
    for key in QUALITY:
        assert runs[True][key] == runs[False][key], key


def test_partial_fp8_blocks_are_read_by_the_projects_own_accessor(tmp_path, monkeypatch):
    """DeepSeek-V3's kv_a_proj_with_mqa is 576 rows in blocks of 128: a partial last block, which transformers'
    dequantizer refuses. Where transformers would dequantize (here the CPU), the in-memory model is read one layer at
    a time through the streamed loading instead, and both it and the streamed run equal the same weights dequantized
    (codes x their block's scale) into a float32 folder that transformers loads. model.device_map=auto on a GPU that
    does not run FP8 (an A100's answers simulated) is refused by name before any weight is read."""
    from safetensors.torch import load_file, save_file

    from mla_quant.models.fp8 import dequantize_blocks

    folder = _fp8_checkpoint(tmp_path / "checkpoint", [16, 16])  # kv_a_proj_with_mqa: 40 rows
    plain = tmp_path / "dequantized"
    plain.mkdir()
    for file in folder.iterdir():
        if file.suffix == ".safetensors":
            state = load_file(file)
            for key in [k for k in state if k.endswith("_scale_inv")]:
                weight = key.removesuffix("_scale_inv")
                state[weight] = dequantize_blocks(state[weight], state.pop(key), (16, 16), torch.float32)
            save_file({k: v.float() for k, v in state.items()}, plain / file.name)
        elif file.is_file():
            (plain / file.name).write_bytes(file.read_bytes())
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    runs = {}
    for name, path, extra in (("plain", plain, []), ("memory", folder, []),
                              ("streamed", folder, ["model.streaming=true"])):
        (tmp_path / name).mkdir()
        runs[name] = quality.run(_quality_cfg("tiny_deepseek_v3", path, *extra), tmp_path / name).metrics
    for key in QUALITY:
        assert runs["memory"][key] == pytest.approx(runs["plain"][key], rel=1e-6, abs=1e-9), key
        assert runs["streamed"][key] == pytest.approx(runs["plain"][key], rel=1e-6, abs=1e-9), key
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa\.weight is 40 x 64, not whole blocks of \[16, 16\].*"
                                         r"model\.device_map=cuda:0"):
        build_model(compose(_quality_overrides("tiny_deepseek_v3", folder, "model.device_map=auto")).model)


def test_fp8_kept_where_the_device_runs_it(tmp_path, monkeypatch):
    """Where FP8 runs (a GPU of compute capability >= 8.9; its answers to transformers simulated here, the layers
    placed on the CPU), a streamed layer keeps the checkpoint's codes and block scales bit for bit (transformers'
    FP8Linear and FP8 experts), as from_pretrained does there; a folded transform makes the projections it rewrites
    full precision first (the same weights as where FP8 is dequantized), in every pass, and names them for export,
    which keeps the rest in FP8: transformers loads it with the logits of the export written where FP8 does not run."""
    from safetensors.torch import load_file

    from mla_quant.models import fp8
    from mla_quant.prepare import prepare_streamed

    folder = _fp8_checkpoint(tmp_path / "checkpoint", [8, 8])
    stored = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    cfg = compose([*_quality_overrides("tiny_deepseek_v3", folder, "model.streaming=true", "transform=quarot",
                                       f"transform.fit.cache_dir={tmp_path / 'store'}"), "experiment=quality"])
    folded = {}
    for kept in (False, True):
        with monkeypatch.context() as m:
            if kept:
                m.setattr(torch.cuda, "is_available", lambda: True)
                m.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
            stream, _ = prepare_streamed(cfg, tokenizer=False)
        assert stream.fp8 == ("kept" if kept else "dequantized")
        for _ in range(2):  # a later pass reads the rewritten projections into full-precision linears again
            for j, layer in stream.layers():
                attn, name = layer.self_attn, f"model.layers.{j}.self_attn"
                for proj in ("kv_a_proj_with_mqa", "kv_b_proj"):  # rewritten by the rotation
                    w = getattr(attn, proj)
                    assert not fp8.is_fp8(w) and w.weight.dtype == torch.float32
                    if kept:
                        torch.testing.assert_close(w.weight, folded[j, proj], rtol=0, atol=0)
                    else:
                        folded[j, proj] = w.weight.detach().clone()
                assert fp8.is_fp8(attn.o_proj) == kept  # untouched by the fold
                if kept:
                    assert torch.equal(attn.o_proj.weight.view(torch.uint8),
                                       stored[f"{name}.o_proj.weight"].view(torch.uint8))
                    assert torch.equal(attn.o_proj.weight_scale_inv, stored[f"{name}.o_proj.weight_scale_inv"])
                    codes = [p for p in layer.mlp.parameters() if p.dtype in fp8.FP8_DTYPES]
                    assert codes and all(p.device.type == "cpu" for p in codes)
        if kept:
            assert sorted(stream.model.mla_dequantized) == [f"model.layers.{j}.self_attn.{p}" for j in range(2)
                                                            for p in ("kv_a_proj_with_mqa", "kv_b_proj")]
        stream.export(tmp_path / f"export_{kept}", 200_000)
        stream.close()
    # exported: what the fold left untouched keeps the checkpoint's codes (FP8 kept) and the rewritten projections are
    # full precision, listed as not converted; transformers loads both exports with the same logits
    written = {k: v for f in (tmp_path / "export_True").glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(written["model.layers.1.mlp.experts.3.up_proj.weight"].view(torch.uint8),
                       stored["model.layers.1.mlp.experts.3.up_proj.weight"].view(torch.uint8))
    assert written["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float32
    assert "model.layers.1.self_attn.kv_b_proj.weight_scale_inv" not in written
    qc = json.loads((tmp_path / "export_True" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in qc["modules_to_not_convert"]
    from mla_quant.models.families import get_family

    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [get_family("deepseek_v3").model_class.from_pretrained(tmp_path / f"export_{kept}",
                                                                        dtype=torch.float32)(ids).logits
                  for kept in (False, True)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-6, atol=1e-6)
