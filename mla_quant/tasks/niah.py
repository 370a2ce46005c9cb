"""Needle-in-a-haystack retrieval in the style of RULER's S-NIAH-1/2/3 and MK-NIAH-1 (same template and needle).

A key/value "needle" sentence is hidden among haystack sentences and asked for at the end:

    Some special magic numbers are hidden within the following text. ... I will quiz you about the numbers afterwards.
    The grass is green. The sky is blue. ...            <- haystack, one block per line
    One of the special magic numbers for quiet-otter is: 4817263.
    ...
    What is the special magic number for quiet-otter mentioned in the provided text?
    -> prompt ends with " The special magic number for quiet-otter mentioned in the provided text is", answer " 4817263"

Variants (VARIANTS): single_1 = repeated filler + number, single_2 = varied generated text + number,
single_3 = varied text + UUID-like value, multikey_1 = varied text + 3 distractor needles with other keys.
Keys and values are split train/test by hash, so held-out needles never appear in training data.

    docs = test_set("single_1", lengths=[512, 1024], n=25, seed=1234)
    docs = test_set("single_1", [1024], 25, 1234, outside=(4, 128))   # needles where such a cache quantizes them
    prompt, answer = train_example(random.Random(0), "multikey_1", max_length=768)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from mla_quant.tasks.split import HELD_OUT, check_split, in_split

# The RULER template (lm_eval/tasks/ruler/niah_utils.py) in its singular form, and its needle sentence.
TEMPLATE = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What is the special magic {kind} for {query} mentioned in the provided text?"
)
NEEDLE = "One of the special magic {kinds} for {key} is: {value}."
GEN_PREFIX = "The special magic {kind} for {query} mentioned in the provided text is"
REPEAT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

ADJECTIVES = (
    "quiet brave calm eager fancy gentle happy jolly kind lively merry nice proud silly witty zany able "
    "bold bright busy clever cool cosy crisp curly daring dizzy early famous fierce fuzzy giant glad grand "
    "hasty humble icy keen large loud lucky mighty modern narrow noble odd plain polite quick rapid rare "
    "rough royal rusty shiny shy sleepy small smooth snowy solid spicy steady stormy sunny swift tall tame "
    "tiny tough vivid warm wild wise young"
).split()
NOUNS = (
    "otter badger falcon tiger panda koala lemur moose raven salmon beetle camel donkey eagle ferret gecko "
    "heron iguana jackal kitten llama magpie newt ostrich parrot quail rabbit shark toucan turtle walrus "
    "yak zebra anchor basket candle castle drum engine feather garden hammer island jacket kettle ladder "
    "lantern meadow needle orchard pebble pillow pocket quilt ribbon saddle temple tunnel umbrella valley "
    "wagon window harbor forest river canyon"
).split()
VERBS = "watches follows paints carries finds visits builds cleans moves lifts counts opens".split()
PLACES = "near the river|in the garden|behind the castle|on the hill|at the market|under the bridge|in the forest".split("|")

VARIANTS = {
    # name: (haystack, value kind, number of needles)
    "single_1": ("repeat", "number", 1),
    "single_2": ("varied", "number", 1),
    "single_3": ("varied", "uuid", 1),
    "multikey_1": ("varied", "number", 4),
}


@dataclass(frozen=True)
class Needle:
    key: str
    value: str


def random_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))  # 7 digits, as in RULER
    if kind == "uuid":
        h = f"{rng.getrandbits(128):032x}"
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    raise ValueError(f"value kind {kind!r}; allowed: number, uuid")


def random_needle(rng: random.Random, kind: str, split: str, taken: set[str]) -> Needle:
    """A needle whose key and value are both in `split` and whose key is not in `taken`."""
    for _ in range(10_000):
        key, value = random_key(rng), random_value(rng, kind)
        if key not in taken and in_split("niah-key:" + key, split) and in_split("niah-value:" + value, split):
            return Needle(key, value)
    raise RuntimeError(f"could not draw a {split} needle")


def varied_sentence(rng: random.Random) -> str:
    """One sentence of project-generated filler text (no digits, so it never looks like a value)."""
    a, b = rng.choice(NOUNS), rng.choice(NOUNS)
    return f"The {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {b} {rng.choice(PLACES)}."


def haystack_block(rng: random.Random, haystack: str) -> str:
    if haystack == "repeat":
        return REPEAT_FILLER
    if haystack == "varied":
        return varied_sentence(rng)
    raise ValueError(f"haystack {haystack!r}; allowed: repeat, varied")


def char_offsets(text: str) -> list[tuple[int, int]]:
    """One token per character (the default, matching `count_tokens=len`)."""
    return [(i, i + 1) for i in range(len(text))]


def token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """[first, last + 1) of the tokens whose characters overlap [start, end)."""
    hit = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return hit[0], hit[-1] + 1


def make_doc(rng: random.Random, variant: str, max_length: int, split: str = "train",
             count_tokens: Callable[[str], int] = len, reserve: int = 48, n_needles: int | None = None,
             token_offsets: Callable[[str], list[tuple[int, int]]] = char_offsets,
             outside: tuple[int, int] | None = None, max_tries: int = 1000) -> dict:
    """One example whose prompt plus `reserve` generated tokens fits in `max_length` tokens.

    Returns RULER's fields (input, outputs, gen_prefix, length, max_length) plus prompt/answer for training,
    `needles` ((key, value) of every needle, the asked one first) and `needle_tokens` ([first, end) of each needle's
    value among the prompt's tokens, from `token_offsets`: (start, end) characters per token of a text, consistent with
    `count_tokens`). `n_needles` overrides the variant's count. `outside` = (n_sink, recent): the asked needle's
    value lies after the prompt's first n_sink tokens and before its last `recent` ones, where a cache protecting
    those stores it quantized (depths drawn uniformly until one fits; distractors anywhere; None: anywhere, RULER's
    uniform depth).
    """
    check_split(split)
    if variant not in VARIANTS:
        raise ValueError(f"niah variant {variant!r}; allowed: {sorted(VARIANTS)}")
    haystack, kind, default_needles = VARIANTS[variant]
    n_needles = default_needles if n_needles is None else n_needles
    if n_needles < 1:
        raise ValueError(f"n_needles={n_needles}; at least 1")
    kinds = kind + "s"
    taken: set[str] = set()
    needles = []
    for _ in range(n_needles):
        needle = random_needle(rng, kind, split, taken)
        taken.add(needle.key)
        needles.append(needle)
    query = needles[0]  # the first needle is asked for; the others are distractors
    needle_lines = [NEEDLE.format(kinds=kinds, key=n.key, value=n.value) for n in needles]

    def render(blocks: list[str], slots: list[int]) -> str:
        lines = list(blocks)
        for slot, line in sorted(zip(slots, needle_lines), reverse=True):
            lines.insert(slot, line)
        body = TEMPLATE.format(kind=kind, context="\n".join(lines), query=query.key)
        return body

    blocks: list[str] = []
    budget = max_length - reserve
    gen_prefix = GEN_PREFIX.format(kind=kind, query=query.key)
    if count_tokens(render([], [0] * n_needles) + " " + gen_prefix) > budget:
        raise ValueError(f"max_length={max_length} is too short for a {variant} needle prompt "
                         f"(the template, needles and {reserve} answer tokens need more)")
    while True:  # grow the haystack one block at a time until the next block would not fit
        candidate = blocks + [haystack_block(rng, haystack)]
        if count_tokens(render(candidate, [0] * n_needles) + " " + gen_prefix) > budget:
            break
        blocks = candidate
    for _ in range(max_tries):
        slots = [rng.randint(0, len(blocks)) for _ in range(n_needles)]  # needle depth uniform over the haystack
        text = render(blocks, slots)
        prompt = f"{text} {gen_prefix}"  # lm-eval joins input and gen_prefix with one space
        offsets = token_offsets(prompt)
        spans = []
        for line, needle in zip(needle_lines, needles):
            start = prompt.index(line) + line.index(needle.value)
            spans.append(token_span(offsets, start, start + len(needle.value)))
        first, end = spans[0]  # the asked needle's value: the answer's tokens (distractors may sit anywhere)
        if outside is None or (first >= outside[0] and end <= len(offsets) - outside[1]):
            break
    else:
        raise ValueError(f"no placement of the asked needle in a {max_length}-token {variant} prompt lies outside "
                         f"its first {outside[0]} and last {outside[1]} tokens after {max_tries} draws (the question "
                         f"and answer prefix sit in the last tokens); use longer contexts (eval.data.niah_lengths) or "
                         f"a smaller window (eval.data.needle_outside)")
    return {
        "input": text,
        "outputs": [query.value],
        "gen_prefix": gen_prefix,
        "length": count_tokens(prompt),
        "max_length": max_length,
        "variant": variant,
        "key": query.key,
        "prompt": prompt,
        "answer": " " + query.value,
        "needles": [(n.key, n.value) for n in needles],
        "needle_tokens": [list(span) for span in spans],
    }


def question(kind: str, key: str) -> str:
    """The query part of the template for `key`, ending with the generation prefix (what a prompt ends with)."""
    tail = TEMPLATE.split("{context}\n", 1)[1]
    return tail.format(kind=kind, query=key) + " " + GEN_PREFIX.format(kind=kind, query=key)


def test_set(variant: str, lengths: list[int], n: int, seed: int, count_tokens: Callable[[str], int] = len,
             split: str = "test", token_offsets: Callable[[str], list[tuple[int, int]]] = char_offsets,
             outside: tuple[int, int] | None = None) -> list[dict]:
    """`n` held-out examples of `split` (test or dev) per length, deterministic in (variant, lengths, n, seed, split,
    outside); `outside` as in `make_doc`."""
    check_split(split, HELD_OUT)
    rng = random.Random(f"niah-{split}:{variant}:{seed}")
    return [make_doc(rng, variant, length, split, count_tokens, token_offsets=token_offsets, outside=outside)
            for length in lengths for _ in range(n)]


def train_example(rng: random.Random, variant: str, max_length: int) -> tuple[str, str]:
    doc = make_doc(rng, variant, max_length, "train")
    return doc["prompt"], doc["answer"]
