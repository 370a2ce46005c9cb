"""The toy model's tokenizer: a small byte-level BPE (digits always single tokens), built with `tokenizers`.

Trained deterministically on text from the task generators (`mla_quant.tasks`, training split only), so every
word of the closed task vocabulary is one token while numbers stay digit by digit (which is what arithmetic and
copying a needle need). Byte-level, so any text round-trips. Saved as a `PreTrainedTokenizerFast` folder
(tokenizer.json + tokenizer_config.json) that loads offline with

    AutoTokenizer.from_pretrained("mla_quant/toy/assets")

    python -m mla_quant.toy.tokenizer /tmp/tok      # (re)build and save it
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]  # ids 0, 1, 2
VOCAB_SIZE = 1024
MAX_LENGTH = 1024
UUID_PATTERN = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def corpus(n_docs: int = 600, seed: int = 0) -> Iterator[str]:
    """Training-split documents of every task (prompt + answer), deterministic in (n_docs, seed)."""
    from mla_quant.tasks import arithmetic, code, niah

    rng = random.Random(f"tokenizer-corpus:{seed}")
    for i in range(n_docs):  # short needle documents, so the haystack does not crowd out the other tasks' words
        variant = list(niah.VARIANTS)[i % len(niah.VARIANTS)]
        yield "".join(niah.train_example(rng, variant, max_length=700))
        for _ in range(2):
            yield "".join(arithmetic.train_example(rng))
            yield "".join(code.train_example(rng))


def build_tokenizer(vocab_size: int = VOCAB_SIZE, n_docs: int = 600, seed: int = 0):
    """A PreTrainedTokenizerFast: eos `</s>`, pad `<pad>`, no BOS ever added, left padding for generation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    # A UUID-like value is a piece of its own, so its first characters never merge with the space before it (the
    # first answer token is " ", as for a number). Then digits, so that the byte-level regex never merges a number.
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(UUID_PATTERN), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    core.train_from_iterator(corpus(n_docs, seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=MAX_LENGTH,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(folder: str | Path, tokenizer=None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (tokenizer or build_tokenizer()).save_pretrained(str(folder))
    return folder


if __name__ == "__main__":
    print(save_tokenizer(sys.argv[1] if len(sys.argv) > 1 else "mla_quant/toy/assets"))
