"""experiment=serving on vLLM's own scheduler: model shapes counted from configs (no weights), KV block budgets per
format, the scheduler's preemptions and recomputation under both admission policies, the analytic capacity against
the scheduler, the step-time model, the paper's stress test, and bad input refused before vLLM starts."""

import math

import pytest
from conftest import compose

from mla_quant.prepare import model_config
from mla_quant.serving.capacity import GPU, Deployment, StepTime, kv_blocks, weights_per_rank
from mla_quant.serving.shape import serving_shape

H200 = GPU("h200", 141, 4.8, 989, 1979)


def shape_of(model: str, *overrides):
    return serving_shape(model_config(compose([f"model={model}", *overrides]).model), model)


def test_shapes_of_the_real_configs():
    """Parameter counts of the shipped configs are the published ones; FP8 checkpoints store ~1 byte per weight."""
    v2 = shape_of("spec_deepseek_v2_lite")
    assert v2.params == pytest.approx(15.7e9, rel=0.01) and not v2.fp8
    assert v2.weight_bytes == 2 * v2.params and v2.layers == 27 and (v2.d_c, v2.d_r, v2.heads) == (512, 64, 16)
    assert v2.active_params() + v2.lm_head_params == pytest.approx(2.4e9, rel=0.05)  # "2.4B activated"
    v3 = shape_of("spec_deepseek_v3")
    assert v3.params == pytest.approx(671e9, rel=0.005) and v3.fp8 and v3.heads == 128
    assert v3.params < v3.weight_bytes < 1.01 * v3.params + v3.embedding_params + v3.lm_head_params
    assert v3.active_params() + v3.lm_head_params == pytest.approx(37e9, rel=0.05)  # "37B activated"
    k2 = shape_of("spec_kimi_k2")
    assert k2.params == pytest.approx(1.03e12, rel=0.02) and k2.experts == 384


def test_shape_counts_what_the_model_holds():
    """The meta-device count equals the parameters of the same config built for real (a tiny MoE model)."""
    from mla_quant.prepare import build_model

    cfg = compose(["model=tiny_deepseek_v3"])
    model = build_model(cfg.model)
    shape = serving_shape(model_config(cfg.model))
    assert shape.params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.expert_params == experts > 0
    assert shape.expert_fraction_read(1) == pytest.approx(shape.experts_per_token / shape.experts)
    assert shape.expert_fraction_read(10_000) == pytest.approx(1.0)


def test_kv_blocks_and_what_does_not_fit():
    v3 = shape_of("spec_deepseek_v3")
    dep = Deployment(H200, num_gpus=8)
    left = 141e9 * 0.9 - v3.weight_bytes / 8 - 4e9
    assert kv_blocks(v3, dep, 1152, 64) == int(left // (64 * 1152 * 61))
    assert kv_blocks(v3, dep, 309, 64) > 3.5 * kv_blocks(v3, dep, 1152, 64)
    dp = Deployment(H200, num_gpus=8, parallel="dp_attention")
    assert weights_per_rank(v3, dp) > weights_per_rank(v3, dep)  # attention and dense weights on every rank
    with pytest.raises(ValueError, match=r"does not fit: .* per GPU .*task.num_gpus=1"):
        kv_blocks(v3, Deployment(H200, num_gpus=1), 1152, 64)
    with pytest.raises(ValueError, match="task.parallel='pp'"):
        Deployment(H200, parallel="pp")


def test_step_time_model():
    """Decode is bandwidth-bound and reads the format's bytes: a 4-bit cache makes a long-context decode step cheaper;
    a prefill chunk is compute-bound; tensor parallelism splits the compute."""
    v3 = shape_of("spec_deepseek_v3")
    dep = Deployment(H200, num_gpus=8)
    bf16 = StepTime(v3, dep, lambda c: 1152.0)
    int4 = StepTime(v3, dep, lambda c: 309.0)
    decode = [(1, 128_000)] * 4
    assert bf16.parts(decode)["memory_s"] > bf16.parts(decode)["compute_s"]
    assert int4(decode) < bf16(decode)
    kv = 4 * 128_001 * 61 * (1152 - 309) / (4.8e12 * 0.8)
    assert bf16(decode) - int4(decode) == pytest.approx(kv, rel=1e-6)  # exactly the bytes the format saves
    prefill = [(8192, 64_000)]
    assert bf16.parts(prefill)["compute_s"] > bf16.parts(prefill)["memory_s"]
    one = StepTime(v3, Deployment(H200, num_gpus=16), lambda c: 1152.0)
    assert one.parts(prefill)["compute_s"] == pytest.approx(bf16.parts(prefill)["compute_s"] / 2)


# ------------------------------------------------------------------------------------------------ vLLM's scheduler


def _schedule(n, inp, out, blocks, reserve):
    from mla_quant.serving.engine import TraceRequest, schedule_trace

    return schedule_trace([TraceRequest(inp, out)] * n, blocks, 16, reserve, lambda plan: 1e-3,
                          max_num_batched_tokens=512)


def test_the_scheduler_preempts_and_recomputes_when_blocks_run_out():
    need = math.ceil((2000 + 64) / 16)  # blocks per request
    ample = _schedule(4, 2000, 64, 4 * need + 1, reserve=False)  # vLLM keeps one block as its null block
    assert ample.preemptions == 0 and ample.recomputed_tokens == 0 and ample.max_running == 4
    assert ample.scheduled_tokens == 4 * (2000 + 64 - 1)  # every prompt token once, every output token but the last
    tight = _schedule(4, 2000, 64, int(2.5 * need), reserve=False)
    assert tight.preemptions > 0 and tight.recomputed_tokens > 0
    waits = _schedule(4, 2000, 64, int(2.5 * need), reserve=True)  # admitted only when the whole prompt fits
    assert waits.preemptions == 0 and waits.steps > ample.steps and waits.max_running < 4
    assert len(tight.ttft_s) == 4 and all(t > 0 for t in tight.ttft_s)


def test_the_scheduler_finds_shared_prompt_blocks_with_prefix_caching():
    """With prefix caching over the requests' prompts (a shared 40-token prefix, then tokens of their own), one
    request at a time: each after the first finds the prefix's 2 whole blocks cached (vLLM's hit count) and schedules
    that many tokens fewer, none recomputed; without it, or without the prompts' ids, nothing is found."""
    from mla_quant.serving.engine import TraceRequest, schedule_trace

    prompts = [tuple([5] * 40 + [100 + i] * (10 + i)) for i in range(4)]

    def run(prefix_caching, with_ids=True):
        requests = [TraceRequest(len(p), 8, prompt=p if with_ids else None) for p in prompts]
        return schedule_trace(requests, 64, 16, False, lambda plan: 1e-3, max_num_batched_tokens=512, max_num_seqs=1,
                              prefix_caching=prefix_caching)

    cached, plain, anonymous = run(True), run(False), run(True, with_ids=False)
    assert cached.prefix_hit_tokens == cached.cached_tokens == 3 * 32
    assert plain.prefix_hit_tokens == anonymous.prefix_hit_tokens == 0
    assert cached.scheduled_tokens == plain.scheduled_tokens - 3 * 32
    assert cached.recomputed_tokens == plain.recomputed_tokens == 0


def _cfg(*overrides):
    return compose(["experiment=serving", "logger=none", "task.sweep.concurrency=[]", "task.sweep.kv_budget_gb=[]",
                    *overrides])


def test_paper_case_under_both_policies(tmp_path):
    """The paper's shape (8 x H200 serving DeepSeek-V3, 5 x 128K): with chunked admission BF16 preempts and INT4 joint
    does not; with full-prompt admission neither preempts and BF16 takes longer; the capacity ratio to BF16 follows
    the byte ratio."""
    from mla_quant.stages.serving import run

    result = run(_cfg("task.formats=[bf16,int4_joint]", "task.capacity_requests=[1,5]", "task.sweep.kv_budget_gb=[20,60]"),
                 tmp_path)
    m = result.metrics
    assert m["serving/bf16/chunked_admission/preemptions"] > 0
    assert m["serving/int4_joint/chunked_admission/preemptions"] == 0
    assert m["serving/bf16/reserve_full_prompt/preemptions"] == 0
    assert m["serving/int4_joint/reserve_full_prompt/preemptions"] == 0
    assert m["serving/bf16/reserve_full_prompt/makespan_s"] > m["serving/int4_joint/reserve_full_prompt/makespan_s"]
    assert m["serving/int4_joint/chunked_admission/output_tok_s_vs_bf16"] > 1.5
    ratio = m["serving/int4_joint/capacity_vs_bf16"] / m["serving/int4_joint/byte_ratio_vs_bf16"]
    assert 0.95 <= ratio <= 1.05, ratio
    for name in ("serving.csv", "serving.md", "serving_capacity.csv", "serving_capacity.png", "serving_budget.png"):
        assert (tmp_path / name).is_file(), name
    budget = result.tables["serving_budget"].set_index(["format", "policy", "kv_budget_gb"])["preemptions"]
    assert budget["bf16", "chunked_admission", 20] > 0 and budget["bf16", "chunked_admission", 60] == 0  # room
    assert "paper: bf16 preemptions = 32" in (tmp_path / "serving.md").read_text()  # the paper's figures beside ours


def test_capacity_agrees_with_the_scheduler(tmp_path):
    """The analytic number of concurrent requests served without preemption is where vLLM starts preempting."""
    from mla_quant.stages.serving import blocks_for, deployment, validate

    cfg = _cfg("model=spec_deepseek_v2_lite", "task.num_gpus=1", "task.kv_budget_gb=0.2", "task.formats=[int4_joint]",
               "task.requests.input=4032", "task.requests.output=64", "task.block_size=16")
    shape, dep, fmts, _ = validate(cfg)
    blocks, _ = blocks_for(cfg.task, shape, deployment(cfg.task), fmts["int4_joint"], 4096)
    n = (blocks - 1) // (4096 // 16)  # vLLM keeps one block as its null block
    assert 2 <= n <= 40, n
    assert _schedule(n, 4032, 64, blocks, reserve=False).preemptions == 0
    assert _schedule(n + 1, 4032, 64, blocks, reserve=False).preemptions > 0


@pytest.mark.parametrize("override,message", [
    (["model=spec_kimi_k2", "task.num_gpus=1"], "does not fit"),
    (["task.formats=[int3_joint]"], "unknown quant option 'int3_joint'"),
    (["task.gpu=b300"], "task.gpu='b300'"),
    (["task.requests.input=0"], "task.requests.input=0"),
    (["task.requests.input=200000"], "exceed the model's limit of 163840"),
    (["task.policies=[fifo]"], r"task.policies=\['fifo'\]; allowed"),
    (["task.kernel_csv=/nonexistent.csv"], "task.kernel_csv"),
])
def test_bad_input_is_refused_before_vllm_starts(override, message, tmp_path, monkeypatch):
    import mla_quant.stages.serving as serving

    monkeypatch.setattr(serving, "import_vllm", lambda: pytest.fail("vLLM was started"))
    with pytest.raises(ValueError, match=message):
        serving.run(_cfg(*override), tmp_path)


def test_decode_attention_from_a_kernel_csv(tmp_path):
    """With a bench_kernel CSV the decode attention takes its measured times (the record says so)."""
    import pandas as pd

    from mla_quant.serving.capacity import kernel_lookup

    rows = [{"mode": "throughput", "heads": 16, "batch": 4, "context": c, "format": f, "kernel_us": us}
            for f, scale in (("bf16", 4.0), ("int4_joint", 1.0)) for c, us in ((4096, 40 * scale), (32768, 320 * scale))]
    path = tmp_path / "bench_kernel.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    lookup = kernel_lookup(str(path), "bf16")
    assert lookup(16, 4096) == pytest.approx(40e-6) and lookup(16, 18432) == pytest.approx(180e-6)  # per query
    assert lookup(32, 65536) == pytest.approx(4 * 320e-6)  # proportional in heads and beyond the last context
    assert kernel_lookup(str(path), "int2_joint") is None
    from mla_quant.stages.serving import run

    out = run(_cfg("model=spec_deepseek_v2_lite", "task.num_gpus=1", "task.formats=[bf16,int4_joint]",
                   "task.policies=[reserve_full_prompt]", "task.requests.count=2", "task.requests.input=8192",
                   "task.requests.output=16", "task.capacity_requests=[]", f"task.kernel_csv={path}"),
              tmp_path / "run")
    table = out.tables["serving"]
    assert set(table["timing"]) == {f"bench_kernel:{path}"}


def test_data_parallel_attention_splits_the_requests(tmp_path):
    """task.parallel=dp_attention: one scheduler per GPU over a round-robin share of the requests, each with the
    blocks its GPU's memory leaves after the attention and dense weights and its share of the experts."""
    from mla_quant.stages.serving import run

    common = ["model=spec_deepseek_v2_lite", "task.gpu=h100", "task.formats=[bf16]", "task.policies=[chunked_admission]",
              "task.requests.count=4", "task.requests.input=16384", "task.requests.output=16", "task.capacity_requests=[]"]
    tp = run(_cfg(*common, "task.num_gpus=2", "task.parallel=tp"), tmp_path / "tp").tables["serving"].iloc[0]
    dp = run(_cfg(*common, "task.num_gpus=2", "task.parallel=dp_attention"), tmp_path / "dp").tables["serving"].iloc[0]
    shape = shape_of("spec_deepseek_v2_lite")
    dep = Deployment(GPU("h100", 80, 3.35, 989, 1979), num_gpus=2, parallel="dp_attention")
    assert dp["kv_blocks"] == kv_blocks(shape, dep, 1152, 64) < tp["kv_blocks"]  # more weights per GPU
    assert dp["max_running"] == 4 and dp["preemptions"] == 0  # two requests on each rank
