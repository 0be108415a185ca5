"""Owns text <-> token ids and the chat template, both read from the GGUF's own metadata.

Uses transformers' GGUF tokenizer support (no hand-written BPE). The converted tokenizer is
cached on disk by file fingerprint, so a second start skips the slow conversion.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from isolab.errors import InvalidRequestError, ModelLoadError
from isolab.paths import user_cache

# Nothing may call out to a model hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

log = logging.getLogger(__name__)

Message = dict[str, str]


END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>")


def cache_root() -> Path:
    """ISOLAB_CACHE/tokenizers where set, else the user cache's (isolab/paths.py)."""
    return Path(os.environ["ISOLAB_CACHE"]) / "tokenizers" if os.environ.get("ISOLAB_CACHE") else user_cache("tokenizers")


def _cache_dir(fingerprint: str) -> Path:
    return cache_root() / fingerprint[:32]


def _release_construction_tables(tok: Any) -> None:
    """Drop the Python copies of the vocabulary and merges that transformers' BPE tokenizers (Llama,
    Gemma, GPT-2, ...) keep after building their Rust backend from them: the backend holds its own
    and nothing reads these again (transformers reads them only in __init__). For Gemma 3's 262k
    tokens and 515k merges they were about 140 MiB of an idle server (bench/server_start.py)."""
    for name, empty in (("_vocab", {}), ("_merges", [])):
        if getattr(tok, "_tokenizer", None) is not None and isinstance(getattr(tok, name, None), type(empty)):
            setattr(tok, name, empty)


class Tokenizer:
    """A thin, typed wrapper over a transformers tokenizer built from a GGUF file."""

    def __init__(self, gguf_path: Path, fingerprint: str, default_template: str | None = None) -> None:
        """default_template: the chat template to use when the GGUF carries none (a family's own:
        models/templates/, e.g. Gemma 3's, which some GGUFs leave out)."""
        from transformers import AutoTokenizer

        cached = _cache_dir(fingerprint)
        try:
            if (cached / "tokenizer_config.json").exists():
                self._tok = AutoTokenizer.from_pretrained(str(cached))
            else:
                self._tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
                try:
                    self._tok.save_pretrained(str(cached))
                except OSError:
                    pass  # a read-only home only costs the next start a conversion
        except Exception as exc:
            # a KeyError's text is the bare key ('tokens'): name it as the GGUF's metadata does
            why = f"no tokenizer.ggml.{exc.args[0]} in its metadata" if isinstance(exc, KeyError) and exc.args else exc
            raise ModelLoadError(f"the tokenizer in {str(gguf_path)!r} could not be built ({why})") from exc
        _release_construction_tables(self._tok)
        if default_template and not getattr(self._tok, "chat_template", None):
            self._tok.chat_template = default_template
            # (a base model's GGUF carries none, as Gemma 3 270M's does not: chat requests then format
            # prompts for a model that was never tuned to answer them)
            log.warning("%s carries no chat template: chat requests use the model family's own; a base "
                        "(pretrained, not instruction-tuned) model may not follow them", gguf_path.name)
        self.eos_token_id: int | None = self._tok.eos_token_id
        # tokens that end a chat turn besides EOS (Gemma's <end_of_turn>): the engine stops on them too,
        # as transformers' generation configs list them beside EOS
        ids = {t: self._tok.convert_tokens_to_ids(t) for t in END_OF_TURN}  # (not get_vocab: 262k entries for Gemma)
        self.end_of_turn_ids = frozenset(i for t, i in ids.items() if isinstance(i, int) and i != self._tok.unk_token_id
                                         and i != self.eos_token_id and self._tok.convert_ids_to_tokens(i) == t)
        self.bos_token_id: int | None = self._tok.bos_token_id
        self.vocab_size = len(self._tok)
        self._skipped: dict[int, bool] = {}  # is_skipped's answers by token id

    @property
    def hf(self) -> Any:
        """The transformers tokenizer underneath (for libraries that take one, e.g. llguidance)."""
        return self._tok

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def is_skipped(self, token_id: int) -> bool:
        """Whether decode() leaves this token out of the text: a special token (EOS, <|im_end|>, <bos>)."""
        hit = self._skipped.get(token_id)
        if hit is None:
            hit = self._skipped[token_id] = self.decode([token_id]) == "" != self.decode([token_id], skip_special_tokens=False)
        return hit

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._ids(text, add_special_tokens)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self._tok(text, add_special_tokens=add_special_tokens).input_ids)
        except TypeError:  # the Rust tokenizer's answer to a str it cannot encode as UTF-8
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                # U+DC80..U+DCFF: a byte of a command-line argument that was not UTF-8 (Python's
                # surrogateescape); any other: half of an escaped UTF-16 pair
                raw = next((c for c in text if "\udc80" <= c <= "\udcff"), None)
                why = (f"the text is not valid UTF-8 (byte 0x{ord(raw) - 0xDC00:02x})" if raw is not None else
                       "the text holds a lone UTF-16 surrogate")
                raise InvalidRequestError(f"{why}; send valid Unicode", field="prompt") from None
            raise

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return cast(str, self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
                            template: str | None = None, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The messages through the chat template: the GGUF's, or `template` (a Jinja text) when
        given; template_kwargs are extra variables the template may read. A template that fails to
        render is an InvalidRequestError naming chat_template_kwargs (or messages)."""
        if template is None and not self.has_chat_template:
            raise InvalidRequestError("this model's GGUF has no chat template; send a plain prompt", field="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"message {i} needs a 'role' and a 'content'", field="messages")
        extra = dict(template_kwargs or {})
        clash = {"messages", "add_generation_prompt", "chat_template", "tokenize", "conversation"} & set(extra)
        if clash:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}",
                                      field="chat_template_kwargs")
        try:
            text = self._tok.apply_chat_template(list(messages), tokenize=False, chat_template=template,
                                                 add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:  # jinja2's TemplateError and whatever the template raises
            field = "chat_template_kwargs" if extra else "messages"
            raise InvalidRequestError(f"the chat template failed to render: {type(exc).__name__}: {exc}",
                                      field=field) from None
        return self._ids(cast(str, text), False)

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes, exactly (OpenAI's logprobs `bytes`): a token that holds part of a
        UTF-8 character gives that part, so a client can join the bytes back into the text, where
        decoding one token alone gives U+FFFD. Byte-level BPE (GPT-2's alphabet: SmolLM2, Llama 3,
        Qwen) maps each character of the token back to its byte; SentencePiece-style vocabularies
        (Gemma) spell a byte as <0xNN> and a space as U+2581; added tokens are their text.
        tests/models/test_tokenizer.py checks every token of the vocabulary against llguidance's
        own table."""
        return [self._token_bytes_of(t) for t in token_ids]

    @functools.cached_property
    def _token_bytes_of(self) -> Callable[[int], bytes]:
        """One token id -> its bytes (cached a token), built on first use from the backend's decoder."""
        import re

        from transformers.convert_slow_tokenizer import bytes_to_unicode

        tok = self._tok
        backend = getattr(tok, "backend_tokenizer", None)
        kinds = backend.decoder.__getstate__().decode() if backend is not None and backend.decoder else ""
        byte_level = '"ByteLevel"' in kinds
        byte_fallback = '"ByteFallback"' in kinds
        added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
        inverse = {c: b for b, c in bytes_to_unicode().items()} if byte_level else {}  # GPT-2's alphabet, inverted
        hex_byte = re.compile(r"<0x([0-9A-Fa-f]{2})>")

        @functools.lru_cache(maxsize=1 << 16)
        def one(token_id: int) -> bytes:
            if token_id in added:
                return added[token_id].encode("utf-8")
            piece = tok.convert_ids_to_tokens(token_id)
            if not isinstance(piece, str):
                return b""
            if byte_level and all(c in inverse for c in piece):
                return bytes(inverse[c] for c in piece)
            m = hex_byte.fullmatch(piece) if byte_fallback else None
            if m:
                return bytes([int(m.group(1), 16)])
            return piece.replace("\u2581", " ").encode("utf-8")

        return one
