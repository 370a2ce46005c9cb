"""Calibration token batches (N, T), by source (conf/calib/*.yaml):

    toy     documents of the toy's training mix (train split of the hashed task split; the evaluation suites draw only
            from the test split, so the two never share a needle key, a problem or a function)
    text    a Hugging Face text dataset through `datasets` (WikiText-2, C4), its `train` split, concatenated and cut
            into rows of seq_len tokens
    random  uniform random token ids (tiny random models, which have no tokenizer and no data)
    auto    toy for the shipped toy model, text (WikiText-2) for checkpoints, random for tiny random models

Every source is deterministic in `calib.seed`; the batch's SHA-256 goes into the fitted transforms' provenance.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch

from mla_quant.checks import int_setting

SOURCES = ("auto", "toy", "text", "random")
EVAL_SPLITS = ("test", "validation")  # splits the evaluation reads; calibration must not
AUTO_SOURCE = {"mla_quant.toy.model.load_toy_model": "toy", "mla_quant.models.build.pretrained_model": "text",
               "mla_quant.models.build.tiny_model": "random"}


def resolve_source(calib_cfg, model_target: str | None) -> str:
    source = calib_cfg.get("source", "auto")
    if source not in SOURCES:
        raise ValueError(f"calib.source={source!r}; allowed: {list(SOURCES)}")
    if source == "auto":
        if model_target not in AUTO_SOURCE:
            raise ValueError(f"calib.source=auto has no default for model._target_={model_target!r}; set calib.source "
                             f"to one of {list(SOURCES[1:])}")
        source = AUTO_SOURCE[model_target]
    return source


def check_calib(calib_cfg, source: str, min_seq_len: int = 16) -> None:
    """Bad calibration settings, before any model work: sizes, and any overlap with the evaluation split."""
    n, t = int(calib_cfg.samples), int(calib_cfg.seq_len)
    if n < 1:
        raise ValueError(f"calib.samples={n}: need at least one calibration sequence")
    if t < min_seq_len:
        raise ValueError(f"calib.seq_len={t} is too short; need at least {min_seq_len} tokens per sequence")
    split = calib_cfg.get("split", "train")
    if split in EVAL_SPLITS:
        raise ValueError(f"calib.split={split!r} is the evaluation split: calibrating on it would tune the transforms "
                         f"on the held-out data they are judged on; use split=train")
    q = calib_cfg.get("query_tokens")
    if q is not None:
        int_setting(q, "calib.query_tokens", allowed="a positive number of query positions per sequence, or null for "
                                                     "all of them")
    if source == "text" and not calib_cfg.get("dataset"):
        raise ValueError("calib.source=text needs calib.dataset (e.g. wikitext with calib.subset=wikitext-2-raw-v1)")


def toy_ids(tokenizer, n: int, t: int, seed: int, split: str = "train", scored: bool = False):
    """n rows of t tokens packed with documents of the toy's training mix (the last document of a row is cut).
    scored=True: also the (n, t) bool mask of the tokens the toy was trained to predict (answers, not prompts)."""
    from mla_quant.toy.train import IGNORE, TrainOptions, encode_doc, sample_doc

    opts = TrainOptions()
    rows, masks = [], []
    for row in range(n):
        rng = random.Random(f"toy-calib:{seed}:{row}")
        ids: list[int] = []
        mask: list[bool] = []
        while len(ids) < t:
            d_ids, labels = encode_doc(tokenizer, *sample_doc(rng, tokenizer, opts, max(t - len(ids), 64), split=split))
            ids += d_ids
            mask += [label != IGNORE for label in labels]
        rows.append(ids[:t])
        masks.append(mask[:t])
    ids = torch.tensor(rows, dtype=torch.long)
    return (ids, torch.tensor(masks, dtype=torch.bool)) if scored else ids


def text_dataset(data_cfg, key: str, purpose: str = "calibration"):
    """The text dataset a data config names (dataset, subset, split, data_files), loaded through `datasets` (its
    cache, local files, or the network). Offline without it: OSError naming the setting `key` (e.g. `calib`) and
    the local-file alternative. Called before any weight is read, and again (from the cache) where it is used."""
    kwargs = {"data_files": _plain(data_cfg.data_files)} if data_cfg.get("data_files") else {}
    subset = None if kwargs else data_cfg.get("subset")
    loader = local_builder(kwargs["data_files"]) or data_cfg.dataset if kwargs else data_cfg.dataset
    try:
        from datasets import load_dataset

        return load_dataset(loader, subset, split=data_cfg.get("split", "train"), **kwargs)
    except Exception as err:  # offline, unknown dataset, missing package: one clear message
        where = (f"the local files {key}.data_files={kwargs['data_files']}" if kwargs else
                 f"{key}.dataset={data_cfg.dataset!r} (subset {data_cfg.get('subset')!r}, split "
                 f"{data_cfg.get('split', 'train')!r})")
        raise OSError(f"cannot load the {purpose} text from {where}: {type(err).__name__}: {err}. The text must be on "
                      f"this machine (the Hugging Face datasets cache, or network), or point "
                      f"{key}.data_files at local files (e.g. {key}.data_files={{{data_cfg.get('split', 'train')}:"
                      f"/data/text.jsonl}}, JSON lines with a {data_cfg.get('text_field', 'text')!r} field)") from err


def local_builder(data_files) -> str | None:
    """The `datasets` builder of files on this machine, by suffix: text (.txt), csv, parquet, else json (JSON lines);
    None where they are not all local files (then they are files of the named dataset's repository, as C4's)."""
    if isinstance(data_files, dict):
        files = [f for v in data_files.values() for f in (v if isinstance(v, (list, tuple)) else [v])]
    else:
        files = list(data_files) if isinstance(data_files, (list, tuple)) else [data_files]
    if not files or not all(Path(str(f)).expanduser().is_file() for f in files):
        return None
    suffix = str(files[0]).rsplit(".", 1)[-1].lower()
    return {"txt": "text", "csv": "csv", "parquet": "parquet"}.get(suffix, "json")


def _plain(node):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def text_ids(calib_cfg, tokenizer, n: int, t: int, purpose: str = "calibration", key: str = "calib") -> torch.Tensor:
    """n rows of t tokens of a text dataset (`calib_cfg`: dataset, subset, split, text_field, seed, data_files)."""
    if tokenizer is None:
        raise ValueError(f"{purpose} data from a text dataset needs a model with a tokenizer")
    data = text_dataset(calib_cfg, key, purpose)
    texts = [x for x in data[calib_cfg.get("text_field", "text")] if x and x.strip()]
    rng = random.Random(int(calib_cfg.seed))
    rng.shuffle(texts)
    take = 40 * n  # texts joined; twice as many while they give fewer than n x t tokens (long sequences)
    while True:
        ids = tokenizer("\n\n".join(texts[:take]), return_tensors="pt").input_ids[0]
        if ids.numel() >= n * t or take >= len(texts):
            break
        take *= 2
    if ids.numel() < n * t:
        where = (f"the local files {key}.data_files" if calib_cfg.get("data_files") else
                 f"{key}.dataset={calib_cfg.dataset!r}")
        raise ValueError(f"the {purpose} text from {where} has {ids.numel()} tokens in all; {key}.samples x "
                         f"{key}.seq_len = {n} x {t} needs {n * t}: fewer or shorter sequences, or more text")
    return ids[: n * t].view(n, t)


def calibration_ids(calib_cfg, source: str, tokenizer=None, vocab_size: int | None = None) -> torch.Tensor:
    """The calibration batch (calib.samples, calib.seq_len) of `source` (resolved, see `resolve_source`)."""
    check_calib(calib_cfg, source)
    n, t, seed = int(calib_cfg.samples), int(calib_cfg.seq_len), int(calib_cfg.seed)
    if source == "toy":
        if tokenizer is None:
            raise ValueError("calib.source=toy needs the toy model's tokenizer (model=toy_mla)")
        ids = toy_ids(tokenizer, n, t, seed, calib_cfg.get("split", "train"))
    elif source == "text":
        ids = text_ids(calib_cfg, tokenizer, n, t)
    elif source == "random":
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, int(vocab_size), (n, t), generator=g)
    else:
        raise ValueError(f"calib.source={source!r}; allowed: {list(SOURCES)}")
    if ids.numel() == 0 or ids.shape[1] < t:
        raise ValueError(f"calibration data has shape {tuple(ids.shape)}; need ({n}, {t})")
    return ids


def ids_sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
