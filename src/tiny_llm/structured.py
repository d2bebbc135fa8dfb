"""Structured outputs: a grammar a request's output must match, as a mask on its logits.

A request may carry a ``StructuredOutput``: a JSON schema, any JSON object, a regular
expression, a choice among strings, or a grammar (Lark, or the EBNF/GBNF dialect of
llama.cpp, converted). At admission the engine compiles it, once per distinct grammar
(``Grammars``), and gives the request its own copy of the matcher (``Constraint``).
Before each of the request's tokens is sampled, the matcher says which tokens of the
vocabulary keep the output a prefix of some sentence of the grammar; every other logit
becomes -inf, before penalties, temperature and filters, so the distribution sampled from
is the model's own, restricted.
The sampled token advances the matcher; a step that fails rolls it back, as it rewinds the
request's random generator. End-of-sequence tokens are allowed exactly where the output is
a whole sentence, so a constrained request ends when its grammar is done.

The matching engine is llguidance (an Earley parser with a lexer over the tokenizer's
vocabulary). Among the registry's grammar engines it is the one with no dependencies
(xgrammar needs torch and transformers; outlines-core compiles regular languages only, no
context-free grammar), it reads JSON schema, regular expressions and Lark grammars itself,
and it builds its view of the vocabulary from the tokenizer's own ``tokenizer.json``.

Masks are per request and per step: rows of other requests are never touched, and a
request's mask depends only on its own output, so batch invariance holds.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

log = logging.getLogger("tiny_llm")

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMARS = 256  # compiled grammars an engine keeps
# JSON as json.dumps writes it, on one line: free whitespace between tokens would let a
# model pad its output without end. A schema's own "x-guidance" options override these.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A structured output that does not compile (refused at admission: a 400 over HTTP)."""


# ANCHOR: structured_output
@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be: exactly one of these."""

    json: dict[str, Any] | str | None = None  # a JSON schema (an object, or its text)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # a regular expression the whole output matches
    choice: tuple[str, ...] | list[str] | None = None  # one of these strings
    grammar: str | None = None  # a Lark grammar (or llama.cpp's GBNF)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"a structured output is exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise TypeError(f"json must be a JSON schema (a dict or its text), got "
                            f"{type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            raise TypeError("json_object must be True or False")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise TypeError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, list | tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise TypeError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> str:
        """The grammar's identity, for the cache of compiled grammars (a schema's keys in
        their order: a JSON schema's properties are generated in that order)."""
        return json.dumps(asdict(self))
# ANCHOR_END: structured_output


class Grammars:
    """An engine's grammar compiler: llguidance's view of the tokenizer (built on first
    use) and a compiled matcher per distinct grammar, which each request's matcher is a
    copy of."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiled: dict[str, Any] = {}  # key -> a fresh matcher of that grammar
        self._lock = threading.Lock()

    @functools.cached_property
    def lltokenizer(self) -> Any:
        import llguidance

        return llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                      eos_token=sorted(self.tokenizer.eos_token_ids))

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A fresh matcher for one request (a copy of the grammar's compiled one);
        ``GrammarError``, naming the problem, for a grammar that does not compile."""
        with self._lock:
            template = self._compiled.get(spec.key)
        if template is None:
            template = self._compile(spec)
            with self._lock:
                if len(self._compiled) >= MAX_GRAMMARS:  # the oldest goes
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[spec.key] = template
        return Constraint(template.deep_copy(), self.vocab_size)

    def _compile(self, spec: StructuredOutput) -> Any:
        import llguidance

        try:
            grammar = _grammar_text(asdict(spec))
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"the structured output does not compile: {e}") from None
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the structured output does not compile: {matcher.get_error()}")
        matcher.compute_bitmask()  # a grammar that no output matches fails its first mask
        if matcher.is_error():
            raise GrammarError("the structured output can never be matched: no output "
                               "satisfies it")
        return matcher


def _grammar_text(spec: dict[str, Any]) -> str:
    """llguidance's grammar for a ``StructuredOutput``'s fields."""
    import llguidance

    if spec["json"] is not None or spec["json_object"]:
        schema = {"type": "object"} if spec["json_object"] else spec["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not JSON: {e}") from None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if spec["regex"] is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec["regex"])
    if spec["choice"] is not None:
        return llguidance.grammar_from("choice", json.dumps(spec["choice"]))
    return llguidance.grammar_from("grammar", spec["grammar"])


# ANCHOR: constraint
class Constraint:
    """One request's matcher: the tokens allowed next, advanced by each sampled token."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.consumed = 0  # tokens the matcher has taken (the request's output tokens)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens that keep the output inside the grammar."""
        # TASK 9.1: Constraint.allowed — The mask
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self.vocab_size]
        return bits.astype(bool)
        # END TASK

    def consume(self, token: int) -> None:
        if self.matcher.is_stopped():  # the grammar is complete: its end token is not kept
            return
        if not self.matcher.consume_token(token):  # a token the mask allowed: a matcher bug
            log.warning("a structured output's matcher failed: %s", self.matcher.get_error())
        self.consumed += 1

    def rollback(self, consumed: int) -> None:
        """Forget the tokens taken since the matcher had taken ``consumed``."""
        if self.consumed > consumed:
            self.matcher.rollback(self.consumed - consumed)
            self.consumed = consumed
# ANCHOR_END: constraint


# ANCHOR: constrained
def constrained(row: np.ndarray, constraint: Constraint) -> np.ndarray:
    """A float32 row of logits with every token its grammar does not allow next at -inf
    (the grammar always allows something: at its end, the end tokens)."""
    # TASK 9.2: constrained — Masking a row
    return np.where(constraint.allowed(), np.asarray(row, dtype=np.float32), np.float32(-np.inf))
    # END TASK
# ANCHOR_END: constrained
