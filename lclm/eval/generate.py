"""Text from a checkpoint: a prompt in, its continuation out.

    python -m lclm.eval.generate --checkpoint WORKDIR --prompt "Once upon a time"
    python -m lclm.eval.generate --checkpoint WORKDIR --step 2000 --prompt "..." \
        --max-new-tokens 128 --temperature 0.8 --top-p 0.95 --seed 1
    python -m lclm.eval.generate --hf HF_DIR --prompt "..." --sp 4
    python -m lclm.eval.generate --checkpoint WORKDIR --chat vicuna \
        --prompt "What is ring attention?"

The model is loaded as the line-retrieval eval loads it (`lclm.eval.model`): the latest (or
`--step`) parameters of a training workdir (a staged run's directory: its last stage with a
checkpoint, as `lclm.convert --to-hf` exports) with its saved config, tokenizer
(`data.tokenizer` unless `--tokenizer`) and mesh (`--dp/--fsdp/--tp/--sp` override a size;
a machine with fewer devices than the training mesh needs them), or a HuggingFace model
directory. The prompt is tokenised as training tokenises a document (BOS first where
the tokenizer adds one), or with `--chat TEMPLATE` as a user turn of that chat template
(`lclm.data.chat`, the templates ShareGPT data trains with: the template's default system
text, then the prompt, then the assistant's prefix; the reply ends at the template's
closing token), prefilled with the run's ring attention on that mesh and decoded
with a KV cache (`lclm.eval.decode`): greedily with `--temperature 0` (the default), else
drawn from the softmax at that temperature, cut to `--top-k` tokens and the `--top-p`
nucleus, the same text for the same `--seed`.

The continuation, up to the first EOS (or with `--chat` the template's end of turn), goes to
stdout; decoding stops there rather than running on to `--max-new-tokens`. Logs go to
stderr. A missing checkpoint or step, an empty prompt, or a prompt whose tokens with
`--max-new-tokens` pass the positions the model was made for is one line `error: ...` and
exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

import numpy as np

from lclm import logs
from lclm.cli import run_cli
from lclm.data.chat import TEMPLATE_NAMES, get_template
from lclm.errors import ConfigError, StartupError
from lclm.eval.decode import Pick, generate, greedy, pad_front, padded_length, sampler
from lclm.eval.model import LoadedModel, add_model_arguments, answer_text, load_model
from lclm.eval.retrieval import stop_ids
from lclm.workdir.resume import CONVERTED_FROM

log = logging.getLogger(__name__)


def prompt_ids(tokenizer, text: str, chat: str | None = None) -> list[int]:
    """The ids of `text` as a document starts in training (BOS first where the tokenizer
    adds one, no EOS), or with `chat` (a template's name) as a conversation's user turn that
    the assistant answers next, as chat data is rendered in training."""
    if chat is None:
        return [tokenizer.bos_id] * tokenizer.add_bos + tokenizer.encode(text)
    return get_template(chat, tokenizer).render_prompt([("user", text)], tokenizer).tolist()


def max_positions(model: LoadedModel, saved: dict | None) -> int:
    """Positions the model was made for: its max_position_embeddings, or the data.seq_len of
    a checkpoint's run where that is longer (a converted checkpoint has trained nothing)."""
    converted = saved is not None and CONVERTED_FROM in saved.get("identity", {})
    trained = saved["data"]["seq_len"] if saved and not converted else 0
    return max(model.config.max_position_embeddings, trained)


def continuation(
    model: LoadedModel, ids: list[int], max_new: int, pick: Pick = greedy, stop: int | None = None
) -> np.ndarray:
    """The ids `[n <= max_new]` int32 that follow prompt `ids`, each chosen by `pick`, up to
    and including the first EOS or `stop` (decoding ends there)."""
    # the mesh's batch axes shard rows: the prompt fills each of them, the first is read
    rows = model.mesh.shape["dp"] * model.mesh.shape["fsdp"]
    length = padded_length(
        len(ids), model.mesh.shape["sp"], model.config.ffn_chunk, model.attention
    )
    # any pad id: the pad segment is never attended to
    batch = pad_front([np.asarray(ids, np.int32)] * rows, length, pad_id=0)
    return generate(
        model.config,
        model.attention,
        model.params,
        *batch,
        max_new,
        mesh=model.mesh,
        pick=pick,
        stop_ids=stop_ids(model.tokenizer, stop),
    )[0]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m lclm.eval.generate", description=__doc__.split("\n")[0]
    )
    add_model_arguments(ap)
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument(
        "--chat",
        choices=sorted(TEMPLATE_NAMES),
        default=None,
        help="the prompt is a user turn of this chat template; the reply is printed",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens decoded (default 64)")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (default); > 0: sample at this temperature",
    )
    ap.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample among the k most likely tokens (default 0: all)",
    )
    ap.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the fewest most likely tokens holding this much "
        "probability (default 1: all)",
    )
    ap.add_argument("--seed", type=int, default=0, help="of the sampling (default 0)")
    return ap.parse_args(argv)


def _check_args(args) -> None:
    """The flags' mistakes, found before the model is loaded."""
    if not args.prompt.strip():
        raise StartupError("--prompt is empty; give the text to continue")
    if args.max_new_tokens < 1:
        raise StartupError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if not 0 <= args.temperature < math.inf:
        raise StartupError(
            f"--temperature={args.temperature} must be a finite number >= 0 (0: greedy)"
        )
    if args.top_k < 0:
        raise StartupError(f"--top-k={args.top_k} must be >= 0 (0: all tokens)")
    if not 0 < args.top_p <= 1:
        raise StartupError(f"--top-p={args.top_p} must be in (0, 1]")
    if args.temperature == 0 and (args.top_k or args.top_p < 1):
        raise StartupError(
            "--top-k and --top-p choose among sampled tokens; pass --temperature > 0 to sample"
        )


def _check_fits(n_prompt: int, max_new: int, limit: int) -> None:
    if n_prompt + max_new > limit:
        raise StartupError(
            f"the prompt's {n_prompt} tokens and --max-new-tokens={max_new} "
            f"pass the model's {limit} positions; shorten the prompt or "
            "decode fewer tokens"
        )


def _run(args) -> None:
    _check_args(args)
    model, saved = load_model(args)
    stop = None
    if args.chat:
        try:
            template = get_template(args.chat, model.tokenizer)
            template.check(model.tokenizer)
        except (ConfigError, ValueError) as e:
            raise StartupError(f"--chat {args.chat}: {e}") from None
        stop = template.reply_end_id(model.tokenizer)
    ids = prompt_ids(model.tokenizer, args.prompt, args.chat)
    _check_fits(len(ids), args.max_new_tokens, max_positions(model, saved))
    pick = (
        greedy
        if args.temperature == 0
        else sampler(args.temperature, args.top_k, args.top_p, args.seed)
    )
    log.info(
        "%s on mesh %s: %d prompt tokens, %d new",
        model.name,
        dict(model.mesh.shape),
        len(ids),
        args.max_new_tokens,
    )
    print(
        answer_text(
            model.tokenizer, continuation(model, ids, args.max_new_tokens, pick, stop), stop
        )
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    logs.configure()
    return run_cli(lambda: _run(args), input_errors=(ValueError,))  # e.g. a bad mesh size


if __name__ == "__main__":
    sys.exit(main())
