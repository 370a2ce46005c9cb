"""Write a Hugging Face checkpoint folder of a real family's exact attention shape with random weights, for
rehearsing the real-checkpoint path (`model=<real> model.path=<folder>`) on a machine without the real weights.

    python run.py experiment=write_checkpoint task.like=deepseek_v2_lite task.layers=2
    python run.py experiment=write_checkpoint task.like=deepseek_v3 task.out=/tmp/v3_shaped
    python run.py experiment=quality model=deepseek_v2_lite model.path=<folder> model.dtype=float32 \\
        model.device_map=null task.data.source=random

`task.like` picks one of `task.shapes` (model YAMLs holding the family's exact attention config: heads, d_c, d_r,
d_nope, d_v, q LoRA, YaRN; `deepseek_v2_lite_full` and `deepseek_v3_full`: the model's whole config); `task.layers`
and `task.experts` shrink the depth and the experts (null: the shape's own); the weights are random (seeded per layer,
drawn by the model's own initialisation), written one decoder layer at a time (`write_random_checkpoint`: a folder
larger than memory is written within one layer's memory) as safetensors shards of at most `task.shard_mb` MB in the
checkpoint layout save_pretrained writes, with config.json and the shipped toy tokenizer beside them (its 1024-token
vocabulary is the folder's vocab_size). `task.fp8_block=[128,128]` stores every decoder layer's linear weight as
block-FP8 codes and scales, the layout of DeepSeek-V3's and Kimi-K2's checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from mla_quant.checks import int_setting
from mla_quant.record import write_json_atomic, write_text_atomic
from mla_quant.stages import StageResult


def write_gsm8k_format(folder: Path, n: int, seed: int) -> dict[str, str]:
    """GSM8K-format problems (question, worked answer ending in `#### N`) from the project's arithmetic generator:
    `n` held-out test problems and 8 train problems (the few-shot pool), for lm-eval's own gsm8k task through
    eval.data_files. -> {split: path}."""
    import random

    from mla_quant.tasks.arithmetic import make_problem, test_set

    rng = random.Random(f"gsm8k-format-train:{seed}")
    splits = {"train": [make_problem(rng, "train") for _ in range(8)], "test": test_set(n, seed)}
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        lines = [json.dumps({"question": r["question"], "answer": r["answer"]}) for r in rows]
        write_text_atomic(folder / f"{split}.jsonl", "".join(f"{line}\n" for line in lines))
        paths[split] = str(folder / f"{split}.jsonl")
    return paths


def write_text_files(folder: Path, seed: int, docs: int = 400) -> dict[str, str]:
    """Plain text as JSON lines ({"text": ...}) for calibration (train) and held-out quality (test), from the
    project's arithmetic generator (GSM8K-format worked problems), through `calib.data_files` /
    `task.data.data_files` where WikiText-2 cannot be had. -> {split: path}."""
    import random

    from mla_quant.tasks.arithmetic import make_problem

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        rng = random.Random(f"text-{split}:{seed}")
        rows = [make_problem(rng, split) for _ in range(docs)]
        lines = [json.dumps({"text": f"{r['question']}\n{r['answer']}"}) for r in rows]
        write_text_atomic(folder / f"{split}.jsonl", "".join(f"{line}\n" for line in lines))
        paths[split] = str(folder / f"{split}.jsonl")
    return paths


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    if task.like not in task.shapes:
        raise ValueError(f"task.like={task.like!r}: no such shape; allowed: {sorted(task.shapes)}")
    if task.layers is not None:
        int_setting(task.layers, "task.layers", allowed="a positive integer, or null (the shape's own depth)")
    if task.experts is not None:
        int_setting(task.experts, "task.experts", allowed="a positive integer, or null (the shape's own experts)")
    int_setting(task.gsm8k_problems, "task.gsm8k_problems", allowed="a positive integer")
    if isinstance(task.shard_mb, bool) or not isinstance(task.shard_mb, (int, float)) or task.shard_mb <= 0:
        raise ValueError(f"task.shard_mb={task.shard_mb!r}: a positive size in MB")
    fp8_block = None
    if task.get("fp8_block") is not None:
        from mla_quant.models.fp8 import check_block_size

        fp8_block = check_block_size("task.fp8_block", OmegaConf.to_container(task.fp8_block)
                                     if OmegaConf.is_config(task.fp8_block) else task.fp8_block)
    from mla_quant.models.build import torch_dtype
    from mla_quant.models.families import get_family
    from mla_quant.models.streaming import write_random_checkpoint
    from mla_quant.prepare import model_config
    from mla_quant.toy.model import load_toy_tokenizer

    dtype = torch_dtype(task.dtype)
    tokenizer = load_toy_tokenizer()
    run_as = task.run_as[task.like]
    source = task.shapes[task.like].copy()
    with open_dict(source):
        source.config.vocab_size = len(tokenizer)
        if task.layers is not None:
            source.config.num_hidden_layers = int(task.layers)
        if task.experts is not None and "n_routed_experts" in source.config:
            experts = int(task.experts)
            source.config.n_routed_experts = experts
            per_token = min(int(source.config.num_experts_per_tok), experts)
            if "n_group" in source.config:  # grouped routing (V3): the top-2 of each group needs 2 experts in it
                groups = max([g for g in range(1, int(source.config.n_group) + 1)
                              if experts % g == 0 and experts // g >= 2] or [1])
                source.config.n_group = groups
                source.config.topk_group = min(int(source.config.topk_group), groups)
                per_token = min(per_token, source.config.topk_group * experts // groups)
            source.config.num_experts_per_tok = per_token
    config = model_config(source)
    config.dtype = dtype
    if getattr(config, "quantization_config", None) is not None:  # the shape's own (DeepSeek-V3's block FP8): the
        del config.quantization_config                             # folder's is what task.fp8_block writes
    out = Path(task.out) if task.out else run_dir / "checkpoint"
    # one decoder layer in memory at a time, whatever the folder's size (a full-size shape is larger than memory)
    written = write_random_checkpoint(get_family(source.family).model_class, config, out, dtype,
                                      int(task.shard_mb * 1e6), int(cfg.seed), fp8_block)
    tokenizer.save_pretrained(out)
    data = write_gsm8k_format(out / "data" / "gsm8k", int(task.gsm8k_problems), int(cfg.seed))
    text_files = write_text_files(out / "data" / "text", int(cfg.seed))
    shards = written["shards"]
    params = written["parameters"]
    text = config.get_text_config(decoder=True)
    description = {"like": task.like, "run_as": run_as, "family": source.family,
                   "layers": int(text.num_hidden_layers), "bytes": written["total_bytes"],
                   "random_weights_seed": int(cfg.seed), "dtype": task.dtype, "parameters": params, "shards": shards,
                   "fp8_block": list(fp8_block) if fp8_block else None,
                   "attention": {k: getattr(text, k, None) for k in (
                       "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                       "q_lora_rank", "hidden_size", "max_position_embeddings")},
                   "data_files": {"gsm8k": data, "text": text_files},
                   "rope_parameters": OmegaConf.to_container(source.config.get("rope_parameters"))
                   if source.config.get("rope_parameters") is not None else None}
    write_json_atomic(out / "mla_quant_rehearsal.json", description)
    print(f"[write_checkpoint] {out}: {task.like}-shaped {source.family}, {description['layers']} layers, "
          f"{params / 1e6:.1f}M random parameters ({task.dtype}{', block FP8 linears' if fp8_block else ''}, "
          f"{written['total_bytes'] / 1e9:.2f} GB) in "
          f"{len(shards)} shard(s); attention {json.dumps(description['attention'])}")
    print(f"  run it as a real checkpoint: python run.py model={run_as} model.path={out} model.dtype=float32 "
          f"model.device_map=null ...")
    print(f"  GSM8K-format data for lm-eval's gsm8k task: 'eval.data_files={{gsm8k:{{train:{data['train']},"
          f"test:{data['test']}}}}}'")
    print(f"  text for calibration and quality: 'calib.data_files={{train:{text_files['train']}}}' "
          f"'task.data.data_files={{test:{text_files['test']}}}'")
    return StageResult(metrics={"checkpoint/path": str(out), "checkpoint/parameters": params,
                                "checkpoint/shards": len(shards), "checkpoint/like": task.like})
