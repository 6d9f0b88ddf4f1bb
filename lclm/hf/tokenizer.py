"""The tokenizer of an export: SentencePiece models converted to tokenizer.json, HuggingFace
tokenizers copied, so that `transformers.AutoTokenizer.from_pretrained` loads the export."""

import base64
import os
import shutil

from google.protobuf.message import DecodeError
from sentencepiece import sentencepiece_model_pb2

from lclm.config import ModelConfig
from lclm.hf.errors import HFFormatError
from lclm.writes import replacing, write_json

# what an export holds of a tokenizer
# chat_template.jinja: where transformers 5 keeps a tokenizer's chat template
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
# SentencePiece ModelProto piece types (5, UNUSED, needs no handling) and model types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_UNIGRAM, _BPE = 1, 2


def _regex_replace(pattern: str, content: str) -> dict:
    return {"type": "Replace", "pattern": {"Regex": pattern}, "content": content}


def sentencepiece_to_hf(model_path: str, add_bos: bool = True) -> tuple[dict, dict]:
    """(tokenizer.json, the special tokens) for a SentencePiece BPE or unigram model: the
    `tokenizers` pipeline that encodes as SentencePiece does. The normalizer is the model's
    own: its precompiled character map (e.g. nmt_nfkc), its whitespace rules (collapsing runs
    and trimming the ends where `remove_extra_whitespaces`), the dummy prefix, spaces as
    "▁"; BPE merges rank as SentencePiece scores the merged pieces; unknown characters fall
    back to byte pieces where the model has them. BOS is prepended when `add_bos`."""
    with open(model_path, "rb") as f:
        raw = f.read()
    try:
        # the protobuf module builds its classes at import time and ships no stubs of them
        proto = sentencepiece_model_pb2.ModelProto.FromString(raw)  # type: ignore[attr-defined]
    except DecodeError as e:
        raise HFFormatError(f"{model_path!r} is not a SentencePiece model ({e})") from None
    kind = proto.trainer_spec.model_type
    norm = proto.normalizer_spec
    if kind not in (_BPE, _UNIGRAM):
        raise HFFormatError(
            f"{model_path!r}: SentencePiece model_type {kind} cannot be "
            "exported; lclm converts BPE and unigram models"
        )
    if proto.trainer_spec.treat_whitespace_as_suffix:
        raise HFFormatError(f"{model_path!r}: treat_whitespace_as_suffix is not supported")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    by_type = lambda t: [i for i, p in enumerate(pieces) if p[2] == t]
    unk = by_type(_UNKNOWN)
    specials = {}
    for name, piece_id in (
        ("unk_token", proto.trainer_spec.unk_id),
        ("bos_token", proto.trainer_spec.bos_id),
        ("eos_token", proto.trainer_spec.eos_id),
        ("pad_token", proto.trainer_spec.pad_id),
    ):
        if 0 <= piece_id < len(pieces):
            specials[name] = pieces[piece_id][0]

    normalizers: list[dict] = []
    if norm.precompiled_charsmap:
        normalizers.append(
            {
                "type": "Precompiled",
                "precompiled_charsmap": base64.b64encode(norm.precompiled_charsmap).decode(),
            }
        )
    if norm.remove_extra_whitespaces:
        normalizers += [_regex_replace(" {2,}", " "), _regex_replace(r"\A | \z", "")]
    if norm.add_dummy_prefix:
        normalizers.append({"type": "Prepend", "prepend": "\u2581"})
    if norm.escape_whitespaces:
        normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})

    byte_fallback = bool(proto.trainer_spec.byte_fallback and by_type(_BYTE))
    if kind == _BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        merges = []
        for i, (piece, score, t) in enumerate(pieces):
            if t != _NORMAL:
                continue
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    merges.append((-score, i, vocab[left], [left, right]))
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": pieces[unk[0]][0] if unk else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": byte_fallback,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [m[-1] for m in sorted(merges)],
        }
    else:
        model = {
            "type": "Unigram",
            "unk_id": unk[0] if unk else None,
            "vocab": [[piece, score] for piece, score, _ in pieces],
            "byte_fallback": byte_fallback,
        }
    # control pieces become special tokens: unlike SentencePiece, transformers matches their
    # text ("<s>") in its input
    added = [
        {
            "id": i,
            "content": pieces[i][0],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": pieces[i][2] != _USER_DEFINED,
        }
        for i in sorted(by_type(_UNKNOWN) + by_type(_CONTROL) + by_type(_USER_DEFINED))
    ]
    decoders: list[dict] = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}]
    if byte_fallback:
        decoders.append({"type": "ByteFallback"})
    decoders.append({"type": "Fuse"})
    if norm.add_dummy_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    post = None
    bos = specials.get("bos_token")
    if add_bos and bos is not None:
        token = lambda name, type_id: {"SpecialToken": {"id": name, "type_id": type_id}}
        seq = lambda name, type_id: {"Sequence": {"id": name, "type_id": type_id}}
        post = {
            "type": "TemplateProcessing",
            "single": [token(bos, 0), seq("A", 0)],
            "pair": [token(bos, 0), seq("A", 0), token(bos, 1), seq("B", 1)],
            "special_tokens": {
                bos: {"id": bos, "ids": [proto.trainer_spec.bos_id], "tokens": [bos]}
            },
        }
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }
    return tokenizer, specials


def save_tokenizer(source: str, hf_dir: str, c: ModelConfig) -> tuple[list[str], list[str]]:
    """Put the tokenizer the model was trained with into the export `hf_dir` so that
    `transformers.AutoTokenizer.from_pretrained(hf_dir)` loads it; returns (the files written,
    warnings). `source` is a SentencePiece `.model` (copied as tokenizer.model, with a
    tokenizer.json that encodes like it and its tokenizer_config.json), a HuggingFace
    tokenizer.json or a directory holding one (copied with the tokenizer_config.json,
    special_tokens_map.json and chat_template.jinja beside it)."""

    def copy(src, name):
        with open(src, "rb") as f, replacing(os.path.join(hf_dir, name), binary=True) as out:
            shutil.copyfileobj(f, out)
        return name

    folder = source if os.path.isdir(source) else os.path.dirname(source)
    if os.path.isdir(source):
        if os.path.isfile(os.path.join(source, "tokenizer.json")):
            source = os.path.join(source, "tokenizer.json")
        elif os.path.isfile(os.path.join(source, "tokenizer.model")):
            source = os.path.join(source, "tokenizer.model")
        else:
            raise FileNotFoundError(
                f"tokenizer directory {source!r} holds neither tokenizer.json nor tokenizer.model"
            )
    if not os.path.isfile(source):
        raise FileNotFoundError(f"tokenizer {source!r} not found")
    written: list[str] = []
    warnings: list[str] = []
    if source.endswith(".json"):  # a HuggingFace tokenizer: its own files, as they are
        written.append(copy(source, "tokenizer.json"))
        for name in TOKENIZER_FILES[1:]:
            if os.path.isfile(os.path.join(folder, name)):
                written.append(copy(os.path.join(folder, name), name))
        if "tokenizer_config.json" not in written:
            write_json(
                os.path.join(hf_dir, "tokenizer_config.json"),
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": c.max_position_embeddings,
                },
            )
            written.append("tokenizer_config.json")
        return written, warnings

    written.append(copy(source, "tokenizer.model"))
    tokenizer, specials = sentencepiece_to_hf(source)
    write_json(os.path.join(hf_dir, "tokenizer.json"), tokenizer)
    written.append("tokenizer.json")
    write_json(
        os.path.join(hf_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": c.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
    )
    write_json(os.path.join(hf_dir, "special_tokens_map.json"), specials)
    written += ["tokenizer_config.json", "special_tokens_map.json"]
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    bos, eos = ids.get(specials.get("bos_token"), -1), ids.get(specials.get("eos_token"))
    if bos != c.bos_id or (eos is not None and eos not in c.eos_ids):
        warnings.append(
            f"the tokenizer's bos/eos ids ({bos}/{eos}) differ from the model's "
            f"bos_id/eos_ids ({c.bos_id}/{list(c.eos_ids)}) in config.json"
        )
    return written, warnings
