"""RULER's generated tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", NVIDIA/RULER), as prompts of exactly the requested number of
tokens of the model's own tokenizer, with their answers; shared by the evaluation
(`python -m lclm.eval ruler`) and training (`ruler:` in data.path).

Tasks (RULER's scripts/synthetic.yaml; the QA tasks need datasets and are left out):

    niah_single_1/2/3     one needle "One of the special magic numbers for KEY is: VALUE."
                          in noise / real text / real text with a UUID value
    niah_multikey_1/2/3   the asked needle among 3 other needles (real text) / in a haystack
                          made of distractor needles (word keys, then UUID keys and values)
    niah_multivalue       4 values for the asked key
    niah_multiquery       4 keys asked at once
    vt                    variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... in noise
    cwe                   the 10 most common words of a numbered word list
    fwe                   the 3 most frequent coded words of Zipf-distributed text

RULER's "essay" haystack is Paul Graham's essays, which are not here offline: the real-text
haystack is Python's reference documentation as every Python ships it (`pydoc_data.topics`),
sentence by sentence from its start, repeated where a prompt needs more (as RULER repeats the
essays). Word keys come from the word lists below, not `wonderwords`.

Exact length, one piece. A prompt is BOS (where the tokenizer adds one), then one text: the
chat text before the user turn (chat form), the task's instruction, the context, the question,
the chat text after the user turn, and RULER's answer prefix ("... The special magic number
for KEY mentioned in the provided text is"). The text is tokenised in one piece, as RULER
tokenises it (pieces tokenised apart would carry a SentencePiece model's dummy-prefix '▁'
each), with the most whole context units (a sentence, a needle, a list item, a coded word)
that fit; the first ids of the units after them, as the one-piece tokenisation of the text
with them has them, fill the rest at the context's end (the one place where the ids are not
the text's own). So the prompt has exactly `length - budget` tokens, `budget` being RULER's
tokens_to_generate of the task (128 for niah, 30 vt, 120 cwe, 50 fwe). Nothing is ever
truncated; a length too short for a task's fixed text is a one-line ValueError.

Seeds. A sample is a pure function of (tokenizer, form, task, length, seed, index, stream):
its numpy Generator is seeded with [stream, seed, crc32(task), length, index], where the
evaluation uses stream `EVAL` and training documents stream `TRAIN`, so no training document
is drawn from an evaluation prompt's randomness.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from scipy.special import zeta

from lclm.data.chat import get_template
from lclm.data.kind import OPTIONS, Kind
from lclm.data.line_retrieval import filler_id

EVAL, TRAIN = 0, 1  # the seed streams of evaluation prompts and training documents
# stand for the turns' text when a chat template is split
MARKS = tuple(f"\ue000RULER{i}\ue001" for i in range(3))

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# RULER's needle depths for the essay haystack: 40 points from 0% to 100%
DEPTHS = np.round(np.linspace(0, 100, num=40)).astype(int)

ADJECTIVES = """able absent ancient angry bitter black bold brave breezy bright broad broken
calm careful cheap clean clever cold cool crisp curious damp dark deep direct dizzy dry
dusty eager early empty endless fair famous fancy fast fierce flat fluffy foggy fresh
friendly funny gentle giant glad golden grand gray great green happy hard heavy hidden
hollow honest hot huge humble hungry icy jolly juicy keen kind large lazy light little
lively lonely long loud lucky mellow mighty modern narrow neat new nice noisy odd old
orange pale plain polite poor proud purple quick quiet rapid rare red rich rough round
royal rusty sad safe salty sharp shiny short shy silent silly simple sleepy slow small
smooth soft solid sour spicy steady steep sticky strange strong sunny sweet swift tall
tame tender thick thin tidy tiny tough warm weak wet white wide wild wise witty yellow
young""".split()
NOUNS = """acorn anchor apple arrow badge bakery balloon banana barn basket beach bell bicycle
blanket boat bottle bridge brush bucket butter button cabin camera candle canyon carpet
castle cellar chair cherry circle cliff clock cloud coat comet copper cottage crayon
desert diamond dragon drum eagle engine falcon feather fence field forest fountain garden
glacier glove guitar hammer harbor helmet hill island jacket jungle kettle kitten ladder
lake lantern lemon library lighthouse magnet maple market meadow mirror monkey mountain
needle notebook ocean orchard otter oven paddle palace panther parrot pencil pepper piano
pillow planet pocket pond puzzle rabbit railway river rocket saddle sailor salmon shadow
shelter shovel silver statue stove street sunset teapot temple tiger tower trumpet tunnel
umbrella valley violin wagon window wizard""".split()
VERBS = """admire arrive bake balance borrow bounce breathe carry chase climb collect cook
dance deliver design drift explore fold gather glide guard hike hover invent juggle
knit launch listen march melt mend paint plant polish pour repair rescue ripple sail
scatter sew shine sketch skate sparkle splash steer stitch swim trace travel tumble
wander whistle wrap""".split()


@dataclasses.dataclass(frozen=True)
class Niah:
    """A needle-in-a-haystack task: haystack 'noise' | 'essay' | 'needle' (distractor
    needles); key and value kinds 'words' | 'numbers' | 'uuids'; needles per prompt."""

    haystack: str
    key: str
    value: str
    n_keys: int = 1
    n_values: int = 1
    n_queries: int = 1
    budget: int = 128


@dataclasses.dataclass(frozen=True)
class VariableTracking:
    hops: int = 4
    icl_tokens: int = 500  # RULER's worked example before the prompt fills this many
    budget: int = 30


@dataclasses.dataclass(frozen=True)
class CommonWords:
    freq_common: int = 30  # below 4K tokens RULER uses 6 and 1 (and a smaller example)
    freq_uncommon: int = 3
    n_common: int = 10
    budget: int = 120


@dataclasses.dataclass(frozen=True)
class FrequentWords:
    alpha: float = 2.0
    word_len: int = 6
    budget: int = 50


Task = Niah | VariableTracking | CommonWords | FrequentWords

TASKS: dict[str, Task] = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", n_keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", n_values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", n_queries=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
}


@dataclasses.dataclass(frozen=True)
class Form:
    """How task text becomes prompt ids: `bos` first, the chat text `before` and `after` the
    user turn ('' for base models), `between` an answered example's reply and the next user
    text (the chat text that closes the reply and opens the next user turn; RULER's '\\n' in
    the base form), and `end_id`, the token that closes an answer (EOS, or the chat
    template's reply end)."""

    bos: tuple[int, ...]
    before: str
    after: str
    between: str
    end_id: int


@dataclasses.dataclass
class Sample:
    """One prompt: `tokens` `[length - budget]` int32, the answers it asks for (RULER's
    references), `target`, the answer written out (what training documents teach), and
    `target_ids`, its ids where the prompt's text and `target` are tokenised in one piece,
    which replace the prompt's last `joined` ids (0, but where the one piece joins the
    prompt's end to the target's start: vt's answer prefix ends with a space, which joins
    the first name)."""

    tokens: np.ndarray
    answers: list[str]
    target: str
    target_ids: list[int]
    joined: int


def prompt_form(tokenizer, chat: str | None = None) -> Form:
    """RULER's base form (`chat` None: BOS where the tokenizer adds one, then the text), or
    the user turn of the chat template `chat` ('tokenizer': the one the tokenizer ships),
    whose assistant header the answer prefix follows; `between` from the template's text of
    a second exchange. ValueError (one line) for a template that is not the tokenizer's or
    does not write the turns' text as given."""
    if chat is None:
        return Form((tokenizer.bos_id,) * tokenizer.add_bos, "", "", "\n", tokenizer.eos_id)
    if chat != "tokenizer":
        raise ValueError(
            f"chat={chat!r}: RULER prompts use the tokenizer's own chat template "
            "('tokenizer') or none"
        )
    template = get_template(chat, tokenizer)
    user, reply, again = MARKS
    one = template.text([("user", user)], prompt=True)
    if one.count(user) != 1:
        raise ValueError("the tokenizer's chat template does not write the user text as given")
    before, after = one.split(user)
    two = template.text([("user", user), ("assistant", reply), ("user", again)], prompt=True)
    first = before + user + after + reply
    if not (two.startswith(first) and two.endswith(again + after) and two.count(again) == 1):
        raise ValueError(
            "the tokenizer's chat template does not write a second exchange "
            "after the first as given (RULER's cwe example takes one)"
        )
    return Form(
        (), before, after, two[len(first) : two.index(again)], int(template.reply_end_id(tokenizer))
    )


def sample(
    task: str, tokenizer, form: Form, length: int, seed: int, index: int, stream: int = EVAL
) -> Sample:
    """Prompt `index` of `task` at `length` tokens (see the module docstring)."""
    spec = TASKS[task]
    rng = np.random.default_rng([stream, seed, zlib.crc32(task.encode()), length, index])
    n_prompt = length - spec.budget
    try:
        tokens, tail, answers, target = _BUILDERS[type(spec)](
            spec, rng, tokenizer, form, n_prompt, length
        )
    except _TooShort:
        raise ValueError(
            f"a {task} prompt does not fit in {length} tokens ({spec.budget} of "
            f"them for the answer); use a longer length"
        ) from None
    joined, target_ids = _continued(tokenizer, tail[0] + form.after + tail[1], target)
    return Sample(tokens, answers, target, target_ids, joined)


# -- assembling a prompt --------------------------------------------------------------------

# what a task's builder gives: (ids, (question, answer prefix), answers, target)
_Built = tuple[np.ndarray, tuple[str, str], list[str], str]


class _TooShort(Exception):
    """The fixed text alone fills the prompt: no room for a context."""


def _shared(a: list[int], b: list[int]) -> int:
    """How many first ids `a` and `b` have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _most(size: Callable[[int], int], n: int, most: int | None = None) -> int:
    """The largest k in [0, most] with size(k) <= n (0 where none is), `size` increasing in
    k and near linear (the token count of k context units). Each step aims along the line
    through the last two sizes measured at n, or at 8 times the last size where that is
    less (a rate from a few units is rough, and a probe far past n costs a whole long
    tokenisation), inside the bracket found so far; k doubles while the sizes are equal."""
    a, size_a = 0, size(0)
    if size_a > n:
        return 0
    lo, hi = 0, None if most is None else most + 1  # size(lo) <= n < size(hi)
    k = 1
    while hi is None or hi - lo > 1:
        k = max(k, lo + 1) if hi is None else min(max(k, lo + 1), hi - 1)
        s = size(k)
        lo, hi = (k, hi) if s <= n else (lo, k)
        step = (min(n, 8 * s) - s) * (k - a) // (s - size_a) if s != size_a else k
        a, size_a, k = k, s, k + step
    return lo


def _whole(spans: list[tuple[int, int]], end: int) -> int:
    """How many first tokens (character `spans`) lie wholly in the text's first `end`
    characters."""
    return next((i for i, (_, stop) in enumerate(spans) if stop > end), len(spans))


def _cut(tokenizer, left: str, right: str, more: Iterator[str], n: int) -> list[int]:
    """`n` ids: `left + right` tokenised in one piece, with the first ids of the text that
    `more` yields inserted where `left` ends: those that the one-piece tokenisation of left +
    that text + right gives it. A token that holds the end of `left` and what follows it
    (LLaMA-3's '.\\n') comes first on both sides of the cut: one character twice, where
    leaving it out would drop the newline before the question."""
    ids, spans = tokenizer.encode_with_offsets(left + right)
    gap = n - len(ids)
    if gap < 0:
        raise _TooShort
    extra = ""
    inserted: list[int] = []
    for piece in more:
        if len(inserted) >= gap:
            break
        extra += piece
        if len(tokenizer.encode(extra)) < gap:  # (tokenised alone: about as many ids)
            continue
        longer, longer_spans = tokenizer.encode_with_offsets(left + extra + right)
        start = _whole(longer_spans, len(left))
        inserted = longer[start : start + len(longer) - len(ids)]
    if len(inserted) < gap:
        raise _TooShort  # only finite texts end
    at = _whole(spans, len(left))
    return ids[:at] + inserted[:gap] + ids[at:]


def _prompt(
    tokenizer,
    form: Form,
    n_prompt: int,
    head: str,
    tail: tuple[str, str],
    context: Callable[[int], str],
    more: Callable[[int], Iterator[str]],
    most: int | None = None,
) -> tuple[np.ndarray, int]:
    """(ids `[n_prompt]`, k): BOS, then the chat text before + `head` + `context(k)` +
    `tail` (question and answer prefix, the chat text after the user turn between them)
    tokenised in one piece, k the most context units (at most `most`) that fit, and the
    first ids of the text `more(k)` yields (the units after those) at the context's end to
    fill the rest."""
    question, prefix = tail
    right = question + form.after + prefix
    n = n_prompt - len(form.bos)
    k = _most(lambda k: len(tokenizer.encode(form.before + head + context(k) + right)), n, most)
    ids = _cut(tokenizer, form.before + head + context(k), right, more(k), n)
    return np.asarray(list(form.bos) + ids, np.int32), k


def _continued(tokenizer, end: str, target: str) -> tuple[int, list[int]]:
    """(how many of the prompt's last ids the target replaces, the target's ids) where the
    prompt's `end` (its text after the context) and `target` are tokenised in one piece."""
    alone, joined = tokenizer.encode(end), tokenizer.encode(end + target)
    shared = _shared(alone, joined)
    return len(alone) - shared, joined[shared:]


def _insert(units: list, inserts: list, positions) -> list:
    """`units` with inserts[i] before units[positions[i]] (positions sorted, at most
    len(units)), inserts kept in their order."""
    out, j = [], 0
    for i, unit in enumerate(units + [None]):
        while j < len(inserts) and positions[j] <= i:
            out.append(inserts[j])
            j += 1
        if unit is not None:
            out.append(unit)
    return out


def _positions(rng, count: int, essay: bool) -> Callable[[int], list[int]]:
    """Where `count` inserts go among k units (sorted): at RULER's DEPTHS of real text
    (distinct depths), else at uniform fractions of the units; drawn once for every k."""
    if essay:
        depths = rng.choice(DEPTHS, count, replace=False)
        return lambda k: sorted(k * depths // 100)
    fractions = rng.random(count)
    return lambda k: sorted((fractions * k).astype(int))


def _haystack(
    tokenizer,
    form: Form,
    n_prompt: int,
    head: str,
    tail: tuple[str, str],
    sep: str,
    unit: Callable[[int], str],
    inserts: list[str],
    where: Callable[[int], list[int]],
) -> np.ndarray:
    """A prompt whose context is the haystack unit(0), unit(1), ... joined by `sep`, with
    the `inserts` (needles, chain lines) placed where(k) among k units."""
    context = lambda k: sep.join(_insert([unit(i) for i in range(k)], inserts, where(k)))
    more = lambda k: (sep + unit(i) for i in itertools.count(k))
    return _prompt(tokenizer, form, n_prompt, head, tail, context, more)[0]


# -- haystacks --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _essay_sentences() -> tuple[str, ...]:
    """Python's reference documentation (every topic in name order), whitespace collapsed,
    split into sentences."""
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics))).strip()
    return tuple(re.split(r"(?<=[.!?]) (?=[A-Z])", text))


def _essay(i: int) -> str:
    sentences = _essay_sentences()
    return sentences[i % len(sentences)]


# -- needle in a haystack ---------------------------------------------------------------------


def _word_key(rng) -> str:
    return f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"


def _random(rng, kind: str) -> str:
    """A random key or value: an adjective-noun word, a 7-digit number or a UUID."""
    if kind == "words":
        return _word_key(rng)
    if kind == "numbers":
        return str(int(rng.integers(10**6, 10**7)))
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _distractors(seed: int, spec: Niah, keys: set[str]) -> Callable[[int], str]:
    """unit(i): the i-th needle with another key (the haystack of niah_multikey_2/3), drawn
    once from its own generator."""
    rng = np.random.default_rng(seed)
    made: list[str] = []

    def unit(i: int) -> str:
        while len(made) <= i:
            key = _random(rng, spec.key)
            if key not in keys:
                made.append(_needle(spec.value, key, _random(rng, spec.value)))
        return made[i]

    return unit


def _niah_text(spec: Niah, query: str) -> tuple[str, tuple[str, str]]:
    """(instruction, (question, answer prefix)) of RULER's niah template, in the singular
    where one value is asked (as RULER rewrites it)."""
    kind = spec.value
    if spec.n_queries * spec.n_values == 1:
        kind = kind[:-1]
        head = (
            f"A special magic {kind} is hidden within the following text. Make sure to "
            f"memorize it. I will quiz you about the {kind} afterwards.\n"
        )
        return head, (
            f"\nWhat is the special magic {kind} for {query} mentioned in the provided text?",
            f" The special magic {kind} for {query} mentioned in the provided text is",
        )
    head = (
        f"Some special magic {kind} are hidden within the following text. Make sure to "
        f"memorize it. I will quiz you about the {kind} afterwards.\n"
    )
    return head, (
        f"\nWhat are all the special magic {kind} for {query} mentioned in the provided text?",
        f" The special magic {kind} for {query} mentioned in the provided text are",
    )


def _niah(spec: Niah, rng, tokenizer, form: Form, n_prompt: int, length: int) -> _Built:
    n_keys = max(spec.n_keys, spec.n_queries)
    keys: list[str] = []
    while len(keys) < n_keys:
        key = _random(rng, spec.key)
        if key not in keys:
            keys.append(key)
    values = [[_random(rng, spec.value) for _ in range(spec.n_values)] for _ in keys]
    needles = [_needle(spec.value, k, v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = sorted(rng.choice(n_keys, spec.n_queries, replace=False))
    answers = [v for i in asked for v in values[i]]
    names = [keys[i] for i in asked]
    query = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]
    head, tail = _niah_text(spec, query)
    essay = spec.haystack == "essay"
    where = _positions(rng, len(needles), essay)
    if spec.haystack == "needle":
        unit = _distractors(int(rng.integers(2**31)), spec, set(keys))
    else:
        unit = _essay if essay else lambda i: NOISE
    # RULER joins real text's sentences with a space, other haystacks' with a newline
    tokens = _haystack(
        tokenizer, form, n_prompt, head, tail, " " if essay else "\n", unit, needles, where
    )
    return tokens, tail, answers, " " + ", ".join(answers) + "."


# -- variable tracking -----------------------------------------------------------------------

VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = (
    "\nQuestion: Find all variables that are assigned the value {value} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {n} "
    "variables are assigned the value {value}, they are: "
)


def _chain(rng, hops: int) -> tuple[list[str], str, list[str]]:
    """(variable names, value, lines "VAR A = 12345", "VAR B = VAR A", ...)."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(chr(65 + int(c)) for c in rng.integers(26, size=5))
        if name not in names:
            names.append(name)
    value = str(int(rng.integers(10000, 99999)))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    return names, value, lines


def _vt_example(spec: VariableTracking, rng, tokenizer, n_prompt: int) -> str:
    """RULER's worked example before the prompt: a noise text with its own chain, the
    question, the answer prefix and the answer, in at most `icl_tokens` tokens (a quarter
    of shorter prompts, so that most of a prompt stays its task's)."""
    names, value, lines = _chain(rng, spec.hops)
    where = _positions(rng, len(lines), essay=False)

    def text(k: int) -> str:
        return (
            VT_HEAD
            + "\n".join(_insert([NOISE] * k, lines, where(k)))
            + VT_QUESTION.format(value=value)
            + VT_PREFIX.format(n=len(names), value=value)
            + " ".join(names)
            + "\n"
        )

    limit = min(spec.icl_tokens, n_prompt // 4)
    return text(_most(lambda k: len(tokenizer.encode(text(k))), limit))


def _vt(spec: VariableTracking, rng, tokenizer, form: Form, n_prompt: int, length: int) -> _Built:
    example = _vt_example(spec, rng, tokenizer, n_prompt)
    names, value, lines = _chain(rng, spec.hops)
    tail = (VT_QUESTION.format(value=value), VT_PREFIX.format(n=len(names), value=value))
    tokens = _haystack(
        tokenizer,
        form,
        n_prompt,
        example + VT_HEAD,
        tail,
        "\n",
        lambda i: NOISE,
        lines,
        _positions(rng, len(lines), essay=False),
    )
    return tokens, tail, names, " ".join(names)


# -- common words ------------------------------------------------------------------------------

CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often.\n"
)
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"


def _word_pool(rng, n_common: int) -> list[str]:
    """Words in a random order, single words first and adjective-noun pairs once those run
    out; the first `n_common` (the answers) are single words that no other word in the pool
    holds, nor one another (RULER's string_match_all credits an answer found anywhere in the
    prediction: a listed 'bold', or past ~16K 'kind-acorn', would earn 'old' or 'kind')."""
    singles = sorted(set(ADJECTIVES + NOUNS + VERBS))
    pairs = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
    order = [singles[i] for i in rng.permutation(len(singles))] + [
        pairs[i] for i in rng.permutation(len(pairs))
    ]
    answers: list[str] = []
    for word in order[: len(singles)]:
        if len(answers) < n_common and not any(word in a or a in word for a in answers):
            answers.append(word)
    return answers + [w for w in order if not any(a in w for a in answers)]


def _word_list(
    words: list[str], n_common: int, n_uncommon: int, freq: tuple[int, int], seed: int
) -> list[str]:
    """The common words `freq[0]` times, the next `n_uncommon` `freq[1]` times, shuffled."""
    common, rare = words[:n_common], words[n_common : n_common + n_uncommon]
    items = common * freq[0] + rare * freq[1]
    np.random.default_rng(seed).shuffle(items)
    return items


def _numbered(words: list[str], start: int = 1) -> str:
    """RULER's numbered list: '1. apple 2. pear'."""
    return " ".join(f"{i}. {w}" for i, w in enumerate(words, start))


def _cwe(spec: CommonWords, rng, tokenizer, form: Form, n_prompt: int, length: int) -> _Built:
    short = length < 4096  # RULER's smaller repetitions and example below 4K
    freq = (6, 1) if short else (spec.freq_common, spec.freq_uncommon)
    example_words = _word_pool(rng, spec.n_common)[: 20 if short else 40]
    example_list = _word_list(
        example_words,
        spec.n_common,
        len(example_words) - spec.n_common,
        (3, 1) if short else (10, 3),
        int(rng.integers(2**31)),
    )
    # the example is an exchange of its own, answered, as RULER writes it
    example = (
        CWE_HEAD
        + _numbered(example_list)
        + CWE_QUESTION
        + form.after
        + CWE_PREFIX
        + " "
        + _numbered(example_words[: spec.n_common])
        + form.between
    )
    words = _word_pool(rng, spec.n_common)
    seed = int(rng.integers(2**31))
    answers = words[: spec.n_common]

    def listed(k: int) -> int:
        return spec.n_common * freq[0] + k * freq[1]

    def more(k: int) -> Iterator[str]:  # once-only words: never among the most common
        return (f" {i}. {w}" for i, w in enumerate(words[spec.n_common + k :], listed(k) + 1))

    tokens, _ = _prompt(
        tokenizer,
        form,
        n_prompt,
        example + CWE_HEAD,
        (CWE_QUESTION, CWE_PREFIX),
        lambda k: _numbered(_word_list(words, spec.n_common, k, freq, seed)),
        more,
        most=len(words) - spec.n_common,
    )
    return tokens, (CWE_QUESTION, CWE_PREFIX), answers, " " + _numbered(answers)


# -- frequent words ----------------------------------------------------------------------------

FWE_HEAD = (
    "Read the following coded text and track the frequency of each coded word. Find "
    "the three most frequently appeared coded words. "
)
FWE_QUESTION = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)


def _coded_vocab(rng, size: int, word_len: int) -> list[str]:
    """`size` distinct random lowercase words in a random order, the first replaced by the
    noise word '...' (the most frequent, to be ignored)."""
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(chr(97 + int(c)) for c in rng.integers(26, size=word_len)))
    words = sorted(vocab)
    rng.shuffle(words)
    return ["..."] + words[1:]


def _fwe(spec: FrequentWords, rng, tokenizer, form: Form, n_prompt: int, length: int) -> _Built:
    """Words drawn by counts floor(m k^-alpha / zeta(alpha)) for rank k (the largest m that
    fits), shuffled, then the noise word to fill the prompt."""
    vocab = _coded_vocab(rng, max(n_prompt // 50, 5), spec.word_len)
    seed = int(rng.integers(2**31))
    ranks = np.arange(1, len(vocab) + 1, dtype=np.float64)

    def counts(m: int) -> np.ndarray:
        return (m * ranks**-spec.alpha / zeta(spec.alpha)).astype(int)

    def context(m: int) -> str:
        drawn = np.repeat(np.arange(len(vocab)), counts(m))
        return " ".join(vocab[i] for i in np.random.default_rng(seed).permutation(drawn))

    tail = (FWE_QUESTION, FWE_PREFIX)
    tokens, m = _prompt(
        tokenizer, form, n_prompt, FWE_HEAD, tail, context, lambda m: itertools.repeat(" ...")
    )
    c = counts(m)
    if not c[3] > c[4]:  # the three asked words must be the most frequent, unambiguously
        raise _TooShort
    answers = vocab[1:4]
    return tokens, tail, answers, " " + " ".join(answers)


_BUILDERS: dict[type, Callable[..., _Built]] = {
    Niah: _niah,
    VariableTracking: _vt,
    CommonWords: _cwe,
    FrequentWords: _fwe,
}


# -- the training data source ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """Options of a `ruler:` source (';'-separated `key=value`): tokens: document length
    (the prompt is tokens minus the task's answer budget; answer, its end token and filler
    with no loss make up the rest); tasks: '+'-separated names of `TASKS` ('all': every
    one), taken in turn; seed; docs: the number of distinct documents; chat: 'tokenizer' for
    the tokenizer's chat template, '' for the base form."""

    tokens: int = 4096
    tasks: str = "all"
    seed: int = 0
    docs: int = 1_000_000
    chat: str = ""

    @classmethod
    def parse(cls, text: str) -> Spec:
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in text.split(";"))):
            key, sep, raw = item.partition("=")
            if not sep or key not in fields:
                raise ValueError(
                    f"bad ruler option {item!r}; use ';'-separated key=value with "
                    f"keys {sorted(fields)}"
                )
            values[key] = raw if key in ("tasks", "chat") else int(raw)
        spec = cls(**values)
        unknown = [t for t in spec.task_names if t not in TASKS]
        if unknown:
            raise ValueError(
                f"unknown ruler task {unknown[0]!r}; use '+'-separated names of "
                f"{', '.join(TASKS)} or 'all'"
            )
        return spec

    @property
    def task_names(self) -> list[str]:
        return list(TASKS) if self.tasks == "all" else self.tasks.split("+")


class RulerDocuments:
    """Random-access training documents `(tokens int32 [tokens], loss int8 [tokens])`: task
    i mod (number of tasks), sample i div it, from the TRAIN seed stream."""

    def __init__(self, spec: Spec, tokenizer):
        self.spec, self.tokenizer = spec, tokenizer
        self.form = prompt_form(tokenizer, spec.chat or None)
        self.tasks, self.filler = spec.task_names, filler_id(tokenizer)
        for task in self.tasks:  # each fits (a one-line error now, not mid-training)
            self._document(task, 0)

    def __len__(self) -> int:
        return self.spec.docs

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._document(self.tasks[i % len(self.tasks)], i // len(self.tasks))

    def _document(self, task: str, index: int):
        """Prompt, answer (the prompt's text and the answer in one piece) and its end token
        (the loss), filler: `tokens` ids. An answer longer than the task's budget (a small
        vocabulary spells names letter by letter) takes a shorter prompt: a sample drawn
        for that length."""
        length = self.spec.tokens
        while True:
            s = sample(task, self.tokenizer, self.form, length, self.spec.seed, index, TRAIN)
            prompt = s.tokens[: len(s.tokens) - s.joined]
            answer = s.target_ids + [self.form.end_id]
            gap = self.spec.tokens - len(prompt) - len(answer)
            if gap >= 0:
                break
            length += gap
        tokens = np.concatenate([prompt, answer, np.full(gap, self.filler)]).astype(np.int32)
        loss = np.concatenate([np.zeros(len(prompt)), np.ones(len(answer)), np.zeros(gap)]).astype(
            np.int8
        )
        return tokens, loss


def open_source(options: str, tokenizer) -> RulerDocuments:
    """The document set of a `ruler:OPTIONS` entry of `config.data.path`."""
    return RulerDocuments(Spec.parse(options), tokenizer)


# the data source kind `ruler:OPTIONS` (generated documents: records are not read)
KIND = Kind("ruler", lambda options, tokenizer, _: open_source(options, tokenizer), OPTIONS)
