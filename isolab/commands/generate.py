"""Owns `isolab generate`: one prompt through the engine, the text streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from isolab.commands.common import add_engine_args, llm_kwargs
from isolab.errors import InvalidRequestError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default here): greedy, and --top-p, --top-k and --seed do not matter")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: off)")
    p.add_argument("--seed", type=int, default=None, help="this request's generator's seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from isolab.engine.detokenize import Detokenizer
    from isolab.llm import LLM
    from isolab.sampling_params import SamplingParams

    if not args.prompt:  # (whitespace is text to continue, as LLM.generate and the server take it)
        raise InvalidRequestError("the prompt is empty: give some text to continue", field="prompt")
    if args.max_tokens < 1:  # (the engine takes 0 for a prompt's logprobs alone, which this command does not print)
        raise InvalidRequestError(f"--max-tokens must be at least 1, not {args.max_tokens}", field="max_tokens")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop),
    )
    llm = LLM(**llm_kwargs(args))
    detok = Detokenizer(llm.tokenizer, params.stop, params.min_tokens)

    def on_step(outputs):
        for o in outputs:
            delta = detok.push(o.new_token_ids)
            if delta:
                sys.stdout.write(delta)
                sys.stdout.flush()

    if args.chat:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        out = llm.generate(ids, params, on_step=on_step)[0]
    else:
        out = llm.generate(args.prompt, params, on_step=on_step)[0]
    sys.stdout.write(detok.finish() + "\n")
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0
