"""Text <-> token ids for the engine: byte-level BPE built on the `tokenizers` library.

A GGUF file carries no `tokenizer.json`; it stores the pieces under llama.cpp's keys: the vocabulary
(already spelled in GPT-2's byte alphabet, one printable character per byte), the merge list, a type
per token (3 = control) and the special ids. We rebuild the pipeline from them:

    split regex(es) chosen by `tokenizer.ggml.pre` -> bytes as alphabet characters -> BPE merges,

and decode with the byte-level decoder. Control tokens become special added tokens, so text such as
"<|im_start|>" is matched whole and can be skipped when decoding. The split must be the one the
merges were learned on, or valid but unnatural ids come out: SmolLM2 ('smollm', StarCoder-style)
isolates every numeric character before GPT-2's split, so " ½" is " " + "½", never "ĠÂ" + "½".
A HF folder needs no rebuilding: its `tokenizer.json` describes the whole pipeline.

Invariants:
- `encode` adds at most one token, BOS, and only if the model asks for it (`add_bos_token`);
  special-token text inside the input always maps to its single id.
- For every token stream, the pieces `IncrementalDetokenizer.add` returns plus `flush()` concatenate
  to `decode(ids)`; `add` never returns text ending in U+FFFD (a character not yet complete).
- `eos_token_ids` holds EOS and every end-of-turn token in the vocabulary; generation stops on any.
- In chat messages, text that spells a special token (`<|im_end|>`) is text: only the template's
  own markup becomes control tokens, so a message cannot forge another turn.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

# Split regexes, as llama.cpp applies them for each `tokenizer.ggml.pre` (and as the models' own
# `tokenizer.json` files do). GPT-2's keeps a leading space on words and runs of digits.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Qwen2 and Llama 3: case-insensitive contractions, a word may take one leading non-letter
# ("_init", "(x"), punctuation absorbs following newlines; digits one (Qwen) or up to 3 at a time.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# StarCoder-style vocabularies (SmolLM) first isolate every single digit, then split like GPT-2.
_DIGIT_SPLIT = r"\p{N}"

_GPT2_FAMILY = ("default", "gpt2")
_SINGLE_DIGIT_FAMILY = ("smollm", "starcoder", "refact", "codeshell")
_QWEN2_FAMILY = ("qwen2", "deepseek-r1-qwen")
_LLAMA3_FAMILY = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3")

_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(_GPT2_FAMILY, (_GPT2_SPLIT,)),
    **dict.fromkeys(_SINGLE_DIGIT_FAMILY, (_DIGIT_SPLIT, _GPT2_SPLIT)),
    **dict.fromkeys(_QWEN2_FAMILY, (_QWEN2_SPLIT,)),
    **dict.fromkeys(_LLAMA3_FAMILY, (_LLAMA3_SPLIT,)),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
)
_REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte token's piece


def _byte_level_bytes() -> dict[str, int]:
    """Byte-level BPE's alphabet, read back: a byte that prints as itself is its own
    character; every other byte is the character 256 + its rank among those bytes."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_bytes()


def check_text(what: str, text: str) -> None:
    """Raise ValueError unless ``text`` is valid Unicode: a lone surrogate (what undecodable
    bytes become) can be neither encoded nor tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: character {e.start} "
                         f"({text[e.start]!r}) is a lone surrogate") from None


class Tokenizer:
    """Encode, decode, stream-decode and chat-format text for one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int] = (),
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        end_of_turn = (backend.token_to_id(token) for token in _END_OF_TURN_TOKENS)
        known = [eos_token_id, *extra_eos_token_ids, *end_of_turn]
        self.eos_token_ids: set[int] = {i for i in known if i is not None}
        self._plain: Backend | None = None  # the backend without added tokens, built lazily
        self._specials: re.Pattern[str] | bool | None = None  # built lazily; False: none

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file describes, from `mx.load(path, return_metadata=True)[1]`."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model): "
                "only byte-level BPE ('gpt2') is supported"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        pre = metadata.get("tokenizer.ggml.pre", "default")
        backend = _byte_level_bpe(tokens, metadata["tokenizer.ggml.merges"], pre)
        _add_typed_tokens(backend, tokens, _as_list(metadata.get("tokenizer.ggml.token_type", [])))
        ids = {name: _gguf_id(metadata, name) for name in ("bos", "eos", "eot", "eom")}
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_FAMILY)
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            extra_eos_token_ids=[i for i in (ids["eot"], ids["eom"]) if i is not None],
            add_bos_token=bool(_as_scalar(add_bos)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, plus what tokenizer_config.json, generation_config.json,
        config.json and chat_template.{jinja,json} add, where the folder has them."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}: a Hugging Face model folder needs one to tokenize"
            )
        backend = Backend.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        model_configs = [_read_json(folder / f) for f in ("generation_config.json", "config.json")]
        bos_ids = _special_ids(backend, "bos", config, *model_configs)
        eos_ids = _special_ids(backend, "eos", config, *model_configs)
        add_bos = config.get("add_bos_token")
        return cls(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=eos_ids,
            add_bos_token=_prepends(backend, bos_ids) if add_bos is None else bool(add_bos),
            chat_template=_hf_chat_template(folder, config),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: it releases the GIL, so a long text tokenized in a worker
        # thread does not stop the server's event loop.
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ANCHOR: chat_template
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render the conversation (and the tools offered, for a template that reads them)
        with the model's template, as `transformers` does."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template, so chat messages cannot be formatted; "
                "encode a plain prompt instead"
            )
        return _compile(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=None,
            bos_token=self._token_string(self.bos_token_id),
            eos_token=self._token_string(self.eos_token_id),
        )

    @property
    def template_reads_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list itself."""
        return self.chat_template is not None and _reads_tools(self.chat_template)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Template, then ids; no extra BOS, as the template writes one itself when needed.
        Where a message or a tool spells a special token (``<|im_end|>``) in any string, key
        or value, the template sees a placeholder in that spelling's place, and the
        rendering's placeholders are encoded as the spelling's text (``encode_as_text``):
        only the template's own markup becomes control tokens."""
        specials = self._special_pattern()
        if specials is None or not any(map(specials.search, strings_in([messages, tools]))):
            prompt = self.apply_chat_template(messages, add_generation_prompt, tools)
            return self.encode(prompt, add_special_tokens=False)
        nonce = secrets.token_hex(8)  # no text a client sends can spell this placeholder
        spelled: list[str] = []

        def placeholder(match: re.Match[str]) -> str:
            spelled.append(match.group(0))
            return f"\ue000{nonce}:{len(spelled) - 1}\ue001"

        def masked(value: Any) -> Any:
            if isinstance(value, str):
                return specials.sub(placeholder, value)
            if isinstance(value, list | tuple):  # as strings_in reads them
                return [masked(v) for v in value]
            if isinstance(value, dict):
                return {masked(k): masked(v) for k, v in value.items()}
            return value

        prompt = self.apply_chat_template(masked(messages), add_generation_prompt,
                                          masked(tools))
        ids: list[int] = []
        at = 0
        for mark in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", prompt):
            ids += self.encode(prompt[at:mark.start()], add_special_tokens=False)
            ids += self.encode_as_text(spelled[int(mark.group(1))])
            at = mark.end()
        return ids + self.encode(prompt[at:], add_special_tokens=False)
    # ANCHOR_END: chat_template

    def encode_as_text(self, text: str) -> list[int]:
        """``text``'s ids with every special or added token spelled out as ordinary text."""
        if self._plain is None:
            spec = json.loads(self.backend.to_str())
            spec["added_tokens"] = []
            self._plain = Backend.from_str(json.dumps(spec))
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def _special_pattern(self) -> re.Pattern[str] | None:
        """The spellings of the special (control) tokens, longest first, as one pattern."""
        if self._specials is None:
            texts = sorted({t.content for t in self.backend.get_added_tokens_decoder().values()
                            if t.special and t.content}, key=len, reverse=True)
            self._specials = re.compile("|".join(map(re.escape, texts))) if texts else False
        return self._specials or None

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` leaves out."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items()
                         if t.special)

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        skipped = self.special_token_ids if skip_special_tokens else frozenset()
        return IncrementalDetokenizer(self.decode, skipped)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for: its text's, or where the token is part of a
        character (its text U+FFFD), the bytes its piece spells (byte-level BPE's alphabet,
        or a byte-fallback piece ``<0xAB>``). A piece in neither spelling gives its text's."""
        text = self.decode([token_id])
        if _REPLACEMENT_CHAR not in text:
            return text.encode()
        piece = self._token_string(token_id)
        if byte := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(byte[1], 16)])
        if piece and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return text.encode()

    def _token_string(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""


# ANCHOR: detokenizer
class IncrementalDetokenizer:
    """Turns a token stream into text pieces, one `add` per token, never splitting a character.

    It decodes a short window: the last emitted chunk (context, so that decoders which treat the
    first token specially agree with the full decode) plus the tokens not emitted yet. While the
    window's text ends in U+FFFD, its last character may be incomplete (an emoji split over byte
    tokens), so nothing is emitted; once it ends cleanly, the new text is emitted and the window
    slides forward. The window grows only while text keeps ending mid-character, so a step costs
    O(1) on real text, not O(length of the stream). The ids in ``skipped`` (the special
    tokens, unless the request keeps their text) never enter the window: they add no text.
    """

    def __init__(self, decode: Callable[[list[int]], str],
                 skipped: frozenset[int] = frozenset()) -> None:
        self._decode = decode
        self._skipped = skipped
        self._window: list[int] = []
        self._pending_from = 0  # window[:pending_from] is the already emitted context
        self._context_chars = 0  # len(decode(window[:pending_from]))
        self.text = ""

    def add(self, token_id: int) -> str:
        if token_id in self._skipped:
            return ""
        self._window.append(token_id)
        decoded = self._decode(self._window)
        if decoded.endswith(_REPLACEMENT_CHAR) or len(decoded) <= self._context_chars:
            return ""
        piece = decoded[self._context_chars :]
        self._window = self._window[self._pending_from :]
        self._pending_from = len(self._window)
        self._context_chars = len(self._decode(self._window))
        return self._emit(piece)

    def flush(self) -> str:
        """Emit what is held back (U+FFFD if the stream stops mid-character); ends the stream."""
        piece = self._decode(self._window)[self._context_chars :]
        self._window, self._pending_from, self._context_chars = [], 0, 0
        return self._emit(piece)

    def _emit(self, piece: str) -> str:
        self.text += piece
        return piece
# ANCHOR_END: detokenizer


def _byte_level_bpe(tokens: list[str], merges: Sequence[str], pre: str) -> Backend:
    if pre not in _SPLITS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
            f"supported: {', '.join(sorted(_SPLITS))}"
        )
    # Llama 3's vocabulary comes from tiktoken, which takes a piece found whole in the vocabulary
    # before trying merges; llama.cpp and Llama 3's tokenizer.json do the same (`ignore_merges`).
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[tuple(merge.split(" ", 1)) for merge in merges],
        ignore_merges=pre in _LLAMA3_FAMILY,
    )
    backend = Backend(bpe)
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _SPLITS[pre]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_typed_tokens(backend: Backend, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special; user-defined ones are matched whole but are not special."""
    typed = list(zip(tokens, token_types, strict=False))  # files without types add nothing

    def of_type(wanted: int, special: bool) -> list[AddedToken]:
        return [AddedToken(t, special=special, normalized=False) for t, k in typed if k == wanted]

    backend.add_special_tokens(of_type(_CONTROL, special=True))
    backend.add_tokens(of_type(_USER_DEFINED, special=False))


def _as_scalar(value: Any) -> Any:
    """A plain Python value from an mx/numpy scalar (or a plain value)."""
    return value.item() if hasattr(value, "item") else value


def _as_list(value: Any) -> list[Any]:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _gguf_id(metadata: dict[str, Any], name: str) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(_as_scalar(value))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config spells a special token as text or as a serialized AddedToken."""
    return token.get("content") if isinstance(token, dict) else token


def _special_ids(
    backend: Backend, name: str, tokenizer_config: dict[str, Any], *model_configs: dict[str, Any]
) -> list[int]:
    """Ids for "bos"/"eos": the tokenizer's token first, then generation_config's and config's."""
    text = _token_text(tokenizer_config.get(f"{name}_token"))
    found = [backend.token_to_id(text)] if text else []
    for config in model_configs:
        value = config.get(f"{name}_token_id")
        found += [value] if isinstance(value, int) else value or []
    return list(dict.fromkeys(i for i in found if i is not None))


def _prepends(backend: Backend, bos_ids: list[int]) -> bool:
    """Whether tokenizer.json's post-processor puts BOS in front (when the config does not say)."""
    return bool(bos_ids) and backend.encode("", add_special_tokens=True).ids[:1] == bos_ids[:1]


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def strings_in(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (nested lists and dicts: keys and values)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from strings_in(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings_in(k)
            yield from strings_in(v)


@lru_cache(maxsize=8)
def _reads_tools(source: str) -> bool:
    from jinja2 import meta

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in meta.find_undeclared_variables(env.parse(source))
    except TemplateError:  # rendering says what is wrong with it, where it is used
        return False


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Like transformers' filter: plain `json.dumps`, unlike jinja's HTML-escaping `tojson`."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def _compile(source: str) -> Template:
    """The template in the environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source)
