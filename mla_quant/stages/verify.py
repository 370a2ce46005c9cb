"""Stage: the invariance check. With the cache unquantized, folding a transform leaves the model's function unchanged.

    python run.py experiment=verify model=tiny_minicpm3                 # the configured model (model.config.* honoured)
    python run.py experiment=verify task.families=all                   # every family's tiny model

For each model and each transform option of `task.transforms` (conf/transform/<name>.yaml gives its kinds), a random
member of that transform space (random orthogonal rotations, log-normal scales, random pair angles: a harder test
than any fitted value) is folded into the weights; the float32 logits of a prompt must match the untransformed
model's within `task.tolerance` (relative Frobenius error) and greedy decoding must give the same tokens.
Metrics: verify/<family>/<transform>/logits_rel_err, verify/<family>/<transform>/greedy_equal.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from mla_quant.models.absorbed import attention_modules
from mla_quant.calibration.options import check_family_transform
from mla_quant.models.families import family_for_config
from mla_quant.prepare import build_model
from mla_quant.record import write_text_atomic
from mla_quant.stages import StageResult, stage_models
from mla_quant.transforms import TransformSet, apply_transforms, sample_layer_transform

CONF = Path(__file__).resolve().parents[1] / "conf"


def transform_kinds(name: str) -> tuple[str, str]:
    path = CONF / "transform" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"task.transforms: unknown transform {name!r}; allowed: "
                         f"{sorted(p.stem for p in (CONF / 'transform').glob('*.yaml'))}")
    node = OmegaConf.load(path)
    return node.content.kind, node.rope.kind


def random_transform_set(model, content: str, rope: str, seed: int) -> TransformSet:
    g = torch.Generator().manual_seed(seed)
    mods = attention_modules(model)
    return TransformSet([sample_layer_transform(content, rope, m.kv_lora_rank, m.qk_rope_head_dim, g) for m in mods])


@torch.no_grad()
def outputs(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids).logits.float()
    tokens = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                            pad_token_id=0)[:, ids.shape[1]:]
    return logits, tokens


def check_model(model_cfg, transforms: list[str], task, label: str | None = None) -> list[dict]:
    """Rows (model label, transform, kinds, logits_rel_err, greedy_equal); label defaults to the model's family."""
    rows = []
    model = build_model(model_cfg, absorbed=False, dtype="float32")
    family = label or family_for_config(model.config).name
    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(int(task.seed))
    device = next(model.parameters()).device
    ids = torch.randint(3, vocab, (2, int(task.prompt_tokens)), generator=g).to(device)
    ref_logits, ref_tokens = outputs(model, ids, int(task.decode_steps))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    for name in transforms:
        content, rope = transform_kinds(name)
        try:  # a kind the family cannot fold is refused by name (dots.3 Note's normed RoPE key: no pair rotation)
            check_family_transform(family_for_config(model.config), {"name": name, "rope": {"kind": rope}})
        except ValueError as err:
            rows.append({"family": family, "transform": name, "content": content, "rope": rope,
                         "logits_rel_err": float("nan"), "greedy_equal": False, "refused": str(err)})
            continue
        model.load_state_dict(original)
        apply_transforms(model, random_transform_set(model, content, rope, int(task.seed)))
        logits, tokens = outputs(model, ids, int(task.decode_steps))
        rel = float((logits - ref_logits).norm() / ref_logits.norm())
        rows.append({"family": family, "transform": name, "content": content, "rope": rope, "logits_rel_err": rel,
                     "greedy_equal": bool(torch.equal(tokens, ref_tokens))})
    return rows


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    transforms = list(task.transforms)
    for name in transforms:
        transform_kinds(name)  # unknown names fail before any model work
    if task.families == "configured":
        if task.get("models", "registry") != "registry":
            raise ValueError("task.models is read with task.families=all only; with task.families=configured the "
                             "configured model runs: drop task.models, or set task.families=all")
        models = {"configured": cfg.model}
    elif task.families == "all":
        models = stage_models(cfg)
    else:
        raise ValueError(f"task.families={task.families!r}; allowed: configured, all")
    rows = []
    for key, model_cfg in models.items():
        rows += check_model(model_cfg, transforms, task, None if key == "configured" else key)
    df = pd.DataFrame(rows)
    tol = float(task.tolerance)
    reasons = df.pop("refused") if "refused" in df else pd.Series([None] * len(df), index=df.index)
    refused = reasons.notna()  # a kind the family cannot fold: refused by name, not run (and not a failure)
    df["ok"] = refused | ((df.logits_rel_err <= tol) & df.greedy_equal)
    metrics = {}
    for r, no in zip(df.itertuples(), refused):
        if no:
            metrics[f"verify/{r.family}/{r.transform}/refused"] = 1.0
            continue
        metrics[f"verify/{r.family}/{r.transform}/logits_rel_err"] = r.logits_rel_err
        metrics[f"verify/{r.family}/{r.transform}/greedy_equal"] = float(r.greedy_equal)
    shown = df.assign(logits_rel_err=df.logits_rel_err.where(~refused),
                      greedy_equal=df.greedy_equal.astype(object).where(~refused, "refused"))
    text = shown.to_markdown(index=False, floatfmt=".2e")
    notes = "".join(f"\n- {df.loc[i, 'family']} x {df.loc[i, 'transform']} refused: {reasons[i]}"
                    for i in df.index[refused])
    text += f"\n{notes}" if notes else ""
    write_text_atomic(run_dir / "verify.md", f"tolerance {tol:g} (relative, float32 logits)\n\n{text}\n")
    print(text)
    bad = df[~df.ok]
    if len(bad):
        return StageResult(metrics=metrics, ok=False,
                           message=f"{len(bad)} family x transform case(s) change the function: "
                                   f"{bad[['family', 'transform', 'logits_rel_err', 'greedy_equal']].to_dict('records')}")
    return StageResult(metrics=metrics)
