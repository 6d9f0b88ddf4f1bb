"""Tokenizers: SentencePiece `.model` files (LLaMA-1/2: unk=0, bos=1, eos=2) and HuggingFace
`tokenizer.json` files (LLaMA-3 and most current models), behind one interface.

`Tokenizer(path)` picks the kind from the file's content; `path` may also be a directory
holding `tokenizer.json` (preferred) or `tokenizer.model`, and either may be on gs:// or
s3:// (read whole through lclm.storage). Both kinds give:

- `encode(text)` ids without BOS/EOS; `encode_long(text)` the same ids, a long text
  tokenised in pieces on the tokenizer's own threads where that gives the same ids (below);
  `encode_batch(texts)` the ids of each text; `encode_with_offsets(text)` the same ids and each
  token's (start, end) character span in `text` (a token made by the tokenizer itself, like
  SentencePiece's leading '▁' or the first bytes of a byte-fallback character, has an empty
  span at the character it precedes); `decode(ids)` text, special tokens left out.
- `chat_template`: the chat template it ships (a `ModelTemplate`, lclm.data.model_chat;
  None for a SentencePiece model or a tokenizer without one) and `special_ids()`.
- `bos_id` (None when there is none), `eos_id`, `pad_id` (None when there is none),
  `add_bos` (documents start with BOS), `special_id(token)` (the id of a special token such
  as '<|eot_id|>'), `vocab_size` (one more than the largest id) and `check_fits`.

A HuggingFace tokenizer is read with the `tokenizers` library only; BOS, EOS and pad come from
the `tokenizer_config.json` and `special_tokens_map.json` beside it (the latter wins where both
name a token, as in `transformers`), and `add_bos` from `add_bos_token` there or, when that is
absent, from whether `tokenizer.json`'s post-processor puts BOS first. Special tokens written
in the text (say '<|eot_id|>') are encoded as those tokens, as `transformers` does.

A long text is cut into pieces of about `PIECE_CHARS` characters, encoded at once by the
`tokenizers` library's threads (its batch calls release the GIL and share the pieces out),
where that gives exactly the ids of the whole: a byte-level BPE whose pre-tokenizer is made
of ByteLevel without a prefix space, Digits and regex Splits (GPT-2's, LLaMA-3's, Qwen's,
SmolLM2's), no normaliser, and no added token holding a line break. The cuts fall after a
line break that follows a non-blank character and before another non-blank one: none of
those pre-tokenizers makes a pre-token that spans such a point, and BPE merges only inside
pre-tokens. A SentencePiece model, or a tokenizer.json with a Metaspace pre-tokenizer (its
'▁' prefix would start every piece), encodes a text whole.

The same tokenizers bound a text's length without encoding it (`most_tokens`: its UTF-8
bytes, as every token spells at least one), and `long_pieces(text)` gives the pieces, so that
a long document can be encoded a few pieces at a time, as far as it is needed
(`lclm.data.documents.Partial`): the data's length options decide most documents that they
leave out without encoding them whole, and a row draws a long document's tokens as it uses
them.
"""

from __future__ import annotations

import itertools
import json
import re

import sentencepiece as spm

from lclm import storage
from lclm.data.model_chat import ModelTemplate
from lclm.errors import ConfigError

HF_FILE, SP_FILE = "tokenizer.json", "tokenizer.model"
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # later files win
_NEITHER = f"is not a SentencePiece model or a HuggingFace {HF_FILE}"
# a long text's pieces (see the module's docstring): long enough that a piece's own cost (about
# 12 ms for SmolLM2's tokenizer on code) dwarfs a batch call's, short enough that deciding a
# length option (`max_tokens=8k`: 8K tokens, ~27K characters of code) reads little past it
PIECE_CHARS = 1 << 14
# where a piece may end: after a line break that follows a non-blank character, before a
# non-blank character
_CUT = re.compile(r"(?<=\S\n)(?=\S)")
# the pre-tokenizers whose pre-tokens never span such a point (ByteLevel's only without a
# prefix space, which would begin every piece)
_CUTTABLE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Split"})
_SET = (
    f"set config.data.tokenizer to a SentencePiece .model file, a {HF_FILE} or a "
    "directory holding one"
)


def _line(error: Exception) -> str:
    return " ".join(str(error).split())[:200]


def _resolve(path: str) -> str:
    """The tokenizer file that `path` (local, gs:// or s3://) names: itself, or in a
    directory tokenizer.json, else tokenizer.model."""
    if storage.isdir(path):
        for name in (HF_FILE, SP_FILE):
            if storage.isfile(storage.join(path, name)):
                return storage.join(path, name)
        raise FileNotFoundError(
            f"tokenizer directory {path!r} holds neither {HF_FILE} nor "
            f"{SP_FILE}; set config.data.tokenizer to one of those"
        )
    if not storage.isfile(path):
        raise FileNotFoundError(f"tokenizer {path!r} not found; {_SET}")
    return path


def _is_json(file: str) -> bool:
    with storage.open_file(file) as f:
        return f.read(64).lstrip()[:1] == b"{"  # a SentencePiece model starts with 0x0a


def pieces(text: str, size: int) -> list[str]:
    """`text` cut at `_CUT` points into pieces of at least `size` characters (the last may
    be shorter, and a text without such points stays whole); they join to `text`."""
    found, start = [], 0
    while len(text) - start > size and (cut := _CUT.search(text, start + size)) is not None:
        found.append(text[start : cut.start()])
        start = cut.start()
    return [*found, text[start:]]


def _cuttable(config: dict) -> bool:
    """Whether a tokenizer.json's `config` encodes a text cut by `pieces` into exactly the
    ids of the whole (see the module's docstring)."""
    pre = config.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return (
        config.get("normalizer") is None
        and config.get("model", {}).get("type") == "BPE"
        and any(p.get("type") == "ByteLevel" for p in parts)
        and all(
            p.get("type") in _CUTTABLE_PRE_TOKENIZERS and not p.get("add_prefix_space", False)
            for p in parts
        )
        and not any("\n" in t.get("content", "") for t in config.get("added_tokens", []))
    )


class Tokenizer:
    """`Tokenizer(path)` is a `SentencePieceTokenizer` or an `HFTokenizer`, by content."""

    path: str
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    add_bos: bool
    chat_template: ModelTemplate | None = None

    def __new__(cls, path: str | None = None):
        if cls is Tokenizer:
            if path is None:  # as os.path would raise; subclasses may be made without a path
                raise TypeError("Tokenizer() needs the path of a tokenizer")
            cls = HFTokenizer if _is_json(_resolve(path)) else SentencePieceTokenizer
        return super().__new__(cls)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_long(self, text: str) -> list[int]:
        """`encode(text)`, on the tokenizer's threads and in pieces where it can (see the
        module's docstring)."""
        return self.encode(text)

    def most_tokens(self, text: str) -> int | None:
        """An upper bound of `len(encode(text))` found without encoding it, or None where
        the tokenizer gives none (see the module's docstring)."""
        return None

    def long_pieces(self, text: str) -> list[str]:
        """The pieces that `encode_long` encodes `text` in: `encode_batch` of any run of them,
        joined in order, gives the ids of the whole (one piece where the tokenizer cannot
        cut)."""
        return [text]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def special_id(self, token: str) -> int:
        raise NotImplementedError

    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (BOS, EOS, <|im_end|>, ...)."""
        return frozenset(i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None)

    def check_fits(self, model_vocab_size: int) -> None:
        """Fail when token ids could fall outside the model's embedding table."""
        if self.vocab_size > model_vocab_size:
            raise ConfigError(
                f"tokenizer {self.path!r} has {self.vocab_size} pieces but "
                f"model.vocab_size={model_vocab_size}; set model.vocab_size >= "
                f"{self.vocab_size}"
            )


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file; loading it parses a protobuf, never executes anything."""

    def __init__(self, path: str):
        self.path = path
        try:
            # from its bytes: the file may be an object (tokenizers are a few MB at most)
            self._sp = spm.SentencePieceProcessor(model_proto=storage.read_bytes(_resolve(path)))
        except RuntimeError as e:  # SentencePiece's only error for a file it cannot parse
            raise ConfigError(
                f"tokenizer {path!r} {_NEITHER} (SentencePiece: {_line(e)}); {_SET}"
            ) from None
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        if self._sp.eos_id() < 0:
            raise ConfigError(
                f"tokenizer {path!r} has no EOS piece; documents and replies end with one"
            )
        self.eos_id = self._sp.eos_id()
        self.add_bos = self.bos_id is not None
        try:
            self._sp.encode("a", out_type="offset_mapping")
            self._offset_mapping = True
        except (RuntimeError, ValueError):  # sentencepiece < 0.2.2 has immutable protos instead
            self._offset_mapping = False

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self._offset_mapping:  # sentencepiece >= 0.2.2
            m = self._sp.encode(text, out_type="offset_mapping")
            return m["ids"], m["offsets"]
        # older: the same (the stubs of sentencepiece >= 0.2.2 no longer list this out_type)
        pieces = self._sp.encode(text, out_type="immutable_proto").pieces  # type: ignore[arg-type]
        return [p.id for p in pieces], [(p.begin, p.end) for p in pieces]  # character spans

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def special_id(self, token: str) -> int:
        i = self._sp.piece_to_id(token)
        if i == self._sp.unk_id() and token != self._sp.id_to_piece(i):
            raise ConfigError(
                f"tokenizer {self.path!r} has no token {token!r}; use a chat "
                "template written for this tokenizer (data.chat_template)"
            )
        return i


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer(Tokenizer):
    """A HuggingFace `tokenizer.json`, read with the `tokenizers` library (no `transformers`)."""

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError:
            raise ConfigError(
                f"tokenizer {path!r} is a HuggingFace {HF_FILE}, which needs the "
                "`tokenizers` package; pip install tokenizers"
            ) from None
        self.path = path
        file = _resolve(path)
        text = storage.read_text(file)
        try:
            self._tok = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception for bad files)
            raise ConfigError(
                f"tokenizer {path!r} {_NEITHER} (tokenizers: {_line(e)}); {_SET}"
            ) from None
        settings = {}
        for name in HF_CONFIG_FILES:
            cfg = storage.join(storage.dirname(file), name)
            if storage.isfile(cfg):
                try:
                    loaded = json.loads(storage.read_text(cfg))
                except (OSError, ValueError) as e:
                    raise ConfigError(
                        f"{cfg} is not valid JSON ({_line(e)}); fix or remove it"
                    ) from None
                if isinstance(loaded, dict):
                    settings.update(loaded)
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.bos_id = self._config_id(settings, "bos_token")
        eos_id = self._config_id(settings, "eos_token")
        self.pad_id = self._config_id(settings, "pad_token")
        if eos_id is None:
            raise ConfigError(
                f"tokenizer {path!r} names no eos_token (tokenizer_config.json or "
                "special_tokens_map.json beside it); documents and replies end "
                "with one"
            )
        self.eos_id = eos_id
        if isinstance(settings.get("add_bos_token"), bool):
            self.add_bos = settings["add_bos_token"] and self.bos_id is not None
        else:  # the post-processor decides, as in transformers
            probe = self._tok.encode("a", add_special_tokens=True).ids
            self.add_bos = self.bos_id is not None and probe[:1] == [self.bos_id]
        # ids never get special tokens from the post-processor (BOS/EOS are placed by the
        # caller), and without it no offsets are trimmed
        self._tok.post_processor = None
        self.chat_template = self._chat_template(file, settings)
        self._cuttable = _cuttable(json.loads(text))
        # asked once per rendered chat: the added tokens' table is built once here
        self._special = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )

    @staticmethod
    def _chat_template(file: str, settings: dict) -> ModelTemplate | None:
        """The template tokenizer_config.json holds (a string, or named ones: 'default'),
        else chat_template.jinja beside it (transformers 5 writes it there), with the special
        tokens' strings the template may read."""
        source = settings.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja = storage.join(storage.dirname(file), "chat_template.jinja")
        if not isinstance(source, str) and storage.isfile(jinja):
            source = storage.read_text(jinja)
        if not isinstance(source, str) or not source.strip():
            return None
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        tokens = tuple((k, _token_name(settings.get(k))) for k in names)
        return ModelTemplate(source, tuple((k, v) for k, v in tokens if v is not None))

    def _config_id(self, settings: dict, key: str) -> int | None:
        name = _token_name(settings.get(key))
        if name is None:
            return None
        i = self._tok.token_to_id(name)
        if i is None:
            raise ConfigError(
                f"tokenizer {self.path!r}: {key} {name!r} from its config is not in its {HF_FILE}"
            )
        return i

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # the same ids as encode_batch, without the offsets' bookkeeping (~1.6x faster)
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_long(self, text: str) -> list[int]:
        # a batch call even for one piece: it releases the GIL while it encodes
        return list(itertools.chain.from_iterable(self.encode_batch(self.long_pieces(text))))

    def most_tokens(self, text: str) -> int | None:
        # every token of a byte-level BPE without a normaliser spells at least one byte
        return len(text.encode("utf-8", "surrogatepass")) if self._cuttable else None

    def long_pieces(self, text: str) -> list[str]:
        return pieces(text, PIECE_CHARS) if self._cuttable else [text]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        e = self._tok.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def special_ids(self) -> frozenset[int]:
        return self._special

    def special_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ConfigError(
                f"tokenizer {self.path!r} has no token {token!r}; use a chat "
                "template written for this tokenizer (data.chat_template)"
            )
        return i
