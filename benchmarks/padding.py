"""How far a prompt's logits move between running alone and inside a left-padded batch, per cache format.

    PYTHONPATH=. python benchmarks/padding.py                      # the toy, needle prompts of 4 lengths
    PYTHONPATH=. python benchmarks/padding.py --lengths 1024 512 256 256 --recent 128 --mode simulated

Each prompt is scored alone, then inside one batch of all prompts left-padded to the longest (the positions counted
per row, as generate() numbers them). The cache keeps each row's own regions, so the two differ only where a matmul
over another batch shape rounds differently (~1e-6 in float32) and that moves a latent across a rounding boundary of
its format: one code word then differs, and the logits with it. Prints, per format, the largest logit difference,
the number of positions compared and how many of them change their argmax.
"""

from __future__ import annotations

import argparse

import torch
from omegaconf import OmegaConf

from mla_quant.cache.bytes import load_quant_option
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.tasks import niah
from mla_quant.toy.model import load_toy_model, load_toy_tokenizer

FORMATS = ["bf16", "fp8_ds_mla", "int8_joint", "int4_joint", "int2_content_int4_rope", "int2_joint"]


def logits_of(model, ids: torch.Tensor, mask: torch.Tensor, quant) -> torch.Tensor:
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions,
                     **cache_kwargs(quantized_cache(model, quant))).logits.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 512, 256, 256],
                        help="needle prompt lengths in the toy's tokens (one prompt each)")
    parser.add_argument("--recent", type=int, default=128, help="quant.protected.recent")
    parser.add_argument("--mode", default="simulated", choices=["simulated", "serving"])
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tok = load_toy_model(), load_toy_tokenizer()
    prompts = []
    for i, length in enumerate(args.lengths):
        doc = niah.test_set("multikey_1", [length], 1, args.seed + i, lambda s: len(tok(s).input_ids))[0]
        prompts.append(torch.tensor(tok(doc["prompt"]).input_ids))
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p):], mask[row, longest - len(p):] = p, 1
    print(f"toy model, {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, left-padded to {longest}; "
          f"protected: 4 sinks + {args.recent} recent; mode {args.mode}")
    print("| format | largest logit difference | positions | argmax changed |")
    print("|---|---|---|---|")
    for option in args.formats:
        quant = OmegaConf.merge(load_quant_option(option, groups={"wide": 32, "narrow": 32}),
                                {"protected": {"recent": args.recent}, "mode": args.mode})
        batch = logits_of(model, ids, mask, quant)
        worst, changed, positions = 0.0, 0, 0
        for row, p in enumerate(prompts):
            alone = logits_of(model, p[None], torch.ones(1, len(p), dtype=torch.long), quant)[0]
            got = batch[row, longest - len(p):]
            worst = max(worst, float((got - alone).abs().max()))
            changed += int((got.argmax(-1) != alone.argmax(-1)).sum())
            positions += len(p)
        print(f"| {option} | {worst:.3g} | {positions} | {changed} |")


if __name__ == "__main__":
    main()
