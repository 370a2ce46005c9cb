"""Training loop of the toy MLA model on the synthetic task mix (loss on answer tokens only).

Every step's batch is a pure function of (seed, step): rows of `row_length` tokens packed with whole documents
(prompt + answer + EOS) drawn from the task mix, so a resumed run sees exactly the data an uninterrupted one would.
Curriculum: the row length (and with it the needle documents' length) grows through `curriculum`.
AdamW with linear warm-up, cosine decay and gradient clipping (without warm-up and clipping the retrieval circuit
of a model this small does not form, or forms and collapses).

    python run.py experiment=train_toy                          # via mla_quant.stages.train_toy
    python run.py experiment=train_toy task.resume=outputs/train_toy/<run>   # continue an interrupted run
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mla_quant.tasks import arithmetic, code, niah

IGNORE = -100
CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainOptions:
    steps: int = 2000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 150
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # [fraction of steps at which the phase starts, row length in tokens, rows per step]; needle documents fill
    # up to the row length, so they grow with it; rows x length stays 4096 tokens per step.
    curriculum: list = field(default_factory=lambda: [[0.0, 256, 16], [0.45, 512, 8], [0.8, 1024, 4]])
    # probability of each document kind
    mix: dict = field(default_factory=lambda: {"niah": 0.45, "arithmetic": 0.45, "code": 0.1})
    # probability of each needle variant among needle documents
    niah_variants: dict = field(default_factory=lambda: {"single_1": 0.15, "single_2": 0.2, "single_3": 0.3,
                                                         "multikey_1": 0.35})
    # training needle documents over varied text hold 1..max_needles needles (multikey_1 always its 4), and every
    # needle is asked in turn, so each long document teaches key matching several times
    max_needles: int = 4
    niah_min_length: int = 160  # tokens; shortest needle document
    checkpoint_every: int = 100
    eval_every: int = 250
    eval_docs: int = 24  # held-out docs per kind for the teacher-forced progress metric
    seed: int = 0
    threads: int = 2
    stop_at: int | None = None  # stop after this step as if interrupted (checkpoint written); for tests/time boxes


def phase(opts: TrainOptions, step: int) -> tuple[int, int]:
    """(row length, rows) of the curriculum phase that `step` is in."""
    length, rows = opts.curriculum[0][1:]
    for start, phase_length, phase_rows in opts.curriculum:
        if step >= start * opts.steps:
            length, rows = phase_length, phase_rows
    return int(length), int(rows)


def lr_at(opts: TrainOptions, step: int) -> float:
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    progress = (step - opts.warmup_steps) / max(1, opts.steps - opts.warmup_steps)
    return opts.lr * (opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def encode_doc(tok, *segments: tuple[str, str]) -> tuple[list[int], list[int]]:
    """ids of prompt + answer + EOS (for each (prompt, answer) segment) and labels (IGNORE on the prompts)."""
    ids: list[int] = []
    labels: list[int] = []
    for prompt, answer in segments:
        p, a = tok(prompt).input_ids, tok(answer).input_ids + [tok.eos_token_id]
        ids += p + a
        labels += [IGNORE] * len(p) + a
    return ids, labels


def needle_segments(doc: dict, rng: random.Random) -> list[tuple[str, str]]:
    """The document's own question first, then every other needle asked in turn, in random order."""
    kind = niah.VARIANTS[doc["variant"]][1]
    others = doc["needles"][1:]
    rng.shuffle(others)
    return [(doc["prompt"], doc["answer"])] + [("\n" + niah.question(kind, k), " " + v) for k, v in others]


def sample_doc(rng: random.Random, tok, opts: TrainOptions, max_tokens: int,
               split: str = "train") -> list[tuple[str, str]]:
    """One document of the mix as (prompt, answer) segments."""
    kinds, weights = zip(*opts.mix.items())
    kind = rng.choices(kinds, weights)[0]
    if kind == "niah" and max_tokens < opts.niah_min_length:
        kind = "arithmetic"  # no room left in the row for a needle document
    if kind == "niah":
        variant = rng.choices(*zip(*opts.niah_variants.items()))[0]
        haystack, value_kind, n_needles = niah.VARIANTS[variant]
        if haystack == "varied" and n_needles == 1:
            n_needles = rng.randint(1, opts.max_needles)
        count = lambda s: len(tok(s).input_ids)  # noqa: E731
        follow_up = 76 if value_kind == "uuid" else 48  # tokens of one follow-up question and its answer
        reserve = 24 + follow_up * (n_needles - 1)  # room for the answer and the follow-up questions
        for _ in range(20):
            length = rng.randint(opts.niah_min_length, max_tokens)
            try:
                doc = niah.make_doc(rng, variant, length, split, count_tokens=count, reserve=reserve,
                                    n_needles=n_needles)
                return needle_segments(doc, rng)
            except ValueError:  # too short for this variant's template: draw again
                continue
        kind = "arithmetic"
    gen = {"arithmetic": arithmetic.make_problem, "code": code.make_problem}[kind]
    p = gen(rng, split)
    return [(p["prompt"], p.get("completion") or p["canonical_solution"])]


def make_batch(tok, opts: TrainOptions, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels), each (rows, row length) of the step's phase; deterministic in (opts.seed, step)."""
    rng = random.Random(f"toy-train:{opts.seed}:{step}")
    length, rows = phase(opts, step)
    ids = torch.full((rows, length), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((rows, length), IGNORE, dtype=torch.long)
    for row in range(rows):
        used = 0
        while used < length - 16:  # pack whole documents; the tail stays padding (no loss)
            d_ids, d_labels = encode_doc(tok, *sample_doc(rng, tok, opts, length - used))
            if used + len(d_ids) > length:
                if used == 0:
                    continue
                break
            ids[row, used : used + len(d_ids)] = torch.tensor(d_ids)
            labels[row, used : used + len(d_labels)] = torch.tensor(d_labels)
            used += len(d_ids)
    return ids, labels


def answer_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # (B, T-1, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE)


def heldout_docs(tok, opts: TrainOptions) -> dict[str, list[tuple[list[int], list[int]]]]:
    """A fixed held-out (test split) set per kind for the progress metric."""
    out = {}
    for kind in ("niah", "arithmetic", "code"):
        rng = random.Random(f"toy-heldout:{opts.seed}:{kind}")
        one = TrainOptions(**{**opts.__dict__, "mix": {kind: 1.0}, "max_needles": 1})
        out[kind] = [encode_doc(tok, *sample_doc(rng, tok, one, 512, split="test")[:1]) for _ in range(opts.eval_docs)]
    return out


@torch.no_grad()
def heldout_metrics(model, docs) -> dict[str, float]:
    """Teacher-forced answer-token accuracy and whole-answer exact match per kind (a proxy for the lm-eval score)."""
    model.eval()
    metrics = {}
    for kind, items in docs.items():
        tok_ok = tok_n = exact = 0
        for d_ids, d_labels in items:
            ids, labels = torch.tensor([d_ids]), torch.tensor([d_labels])
            pred = model(input_ids=ids, use_cache=False).logits[:, :-1].argmax(-1)
            mask = labels[:, 1:] != IGNORE
            ok = (pred == labels[:, 1:]) & mask
            tok_ok, tok_n = tok_ok + ok.sum().item(), tok_n + mask.sum().item()
            exact += int(ok.sum().item() == mask.sum().item())
        metrics[f"{kind}/answer_token_acc"] = tok_ok / max(1, tok_n)
        metrics[f"{kind}/exact"] = exact / max(1, len(items))
    model.train()
    return metrics


def save_checkpoint(path: Path, model, optimizer, step: int, elapsed: float, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed, "history": history}, tmp)
    os.replace(tmp, path)  # atomic: an interrupted save never leaves a half-written checkpoint


def train(model, tok, opts: TrainOptions, run_dir: Path, resume: str | Path | None = None,
          progress: bool = True) -> dict:
    """Train `model` in place; checkpoints to run_dir/checkpoint.pt. Returns a summary (steps, seconds, metrics)."""
    torch.set_num_threads(opts.threads)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=opts.lr, betas=(0.9, 0.95))
    step, elapsed, history = 0, 0.0, []
    if resume:
        ckpt_path = Path(resume)
        ckpt_path = ckpt_path / CHECKPOINT if ckpt_path.is_dir() else ckpt_path
        if not ckpt_path.is_file():
            raise FileNotFoundError(f"task.resume={str(resume)!r}: no {CHECKPOINT} there")
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, elapsed, history = ckpt["step"], ckpt["elapsed"], ckpt["history"]
    docs = heldout_docs(tok, opts) if opts.eval_every else {}
    model.train()
    bar = tqdm(total=opts.steps, initial=step, desc="train_toy", unit="step", disable=not progress,
               mininterval=5.0)
    start = time.perf_counter() - elapsed
    loss_avg = None
    while step < opts.steps:
        ids, labels = make_batch(tok, opts, step)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(opts, step)
        loss = answer_loss(model, ids, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip).item()
        optimizer.step()
        step += 1
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{loss_avg:.3f}", len=ids.shape[1], gnorm=f"{grad_norm:.2f}", refresh=False)
        if opts.eval_every and (step % opts.eval_every == 0 or step == opts.steps):
            m = {"step": step, "seconds": time.perf_counter() - start, "loss": loss_avg,
                 **heldout_metrics(model, docs)}
            history.append(m)
            tqdm.write(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))
        if step % opts.checkpoint_every == 0 or step in (opts.steps, opts.stop_at):
            save_checkpoint(run_dir / CHECKPOINT, model, optimizer, step, time.perf_counter() - start, history)
        if step == opts.stop_at:
            break
    bar.close()
    model.eval()
    return {"steps": step, "train_seconds": time.perf_counter() - start, "final_loss": loss_avg,
            "history": history, "final_heldout": history[-1] if history else {}}
