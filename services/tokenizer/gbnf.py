"""Grammars clients send (`response_format` kind "grammar"): llama.cpp's GBNF or xgrammar's EBNF,
turned into the EBNF xgrammar parses.

The two dialects share rules (`name ::= ...`, `root` first to match), string literals, character
classes, `|`, grouping, `* + ?`, `{m}`, `{m,n}` and `#` comments. What GBNF has beyond
xgrammar 0.2.8's parser (tests/structured/test_gbnf.py runs llama.cpp's own grammars):
- an empty alternative (`ws ::= | " "`): written as `""`;
- `.` (any character): written as the class of every code point;
- `{,n}`: written as `{0,n}`;
- token references `<[id]>`, `<text>` and their negation `!<...>`: match vocabulary tokens, not
  text; refused (`GrammarError`), since the grammar engine works on text.
Everything else passes through unchanged and xgrammar judges it (its EBNF extensions, such as
lookahead `(= ...)`, included).
"""

from __future__ import annotations

import re

_ANY_CHAR = r"[\U00000000-\U0010FFFF]"
_LEXEME = re.compile(r"""
    (?P<space>\s+) | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*") | (?P<cls>\[(?:[^\]\\\n]|\\.)*\])
  | (?P<define>::=) | (?P<bar>\|) | (?P<open>\() | (?P<close>\))
  | (?P<token>!?<[^>\n]*>) | (?P<dot>\.) | (?P<brace>\{[^}\n]*\}) | (?P<name>[A-Za-z0-9_-]+)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


class GrammarError(ValueError):
    """The grammar uses a feature that cannot be enforced here (the message says which)."""


def to_xgrammar_ebnf(text: str) -> str:
    """`text` (GBNF or xgrammar EBNF) as xgrammar EBNF (see module rules)."""
    lexemes = [(m.lastgroup or "other", m.group()) for m in _LEXEME.finditer(text)]
    significant = [i for i, (kind, _) in enumerate(lexemes) if kind not in ("space", "comment")]
    rule_starts = {i for n, i in enumerate(significant[:-1])
                   if lexemes[i][0] == "name" and lexemes[significant[n + 1]][0] == "define"}
    out: list[str] = []
    previous = "start"
    for n, i in enumerate(significant + [len(lexemes)]):
        kind, value = lexemes[i] if i < len(lexemes) else ("end", "")
        ends_alternative = kind in ("bar", "close", "end") or i in rule_starts
        if previous in ("define", "bar", "open") and ends_alternative:
            out.append(' ""')
        start = significant[n - 1] + 1 if n else 0
        out.extend(v for _, v in lexemes[start:i])  # the spaces and comments before it
        if kind == "token":
            raise GrammarError(f"token references such as {value} are not supported; write "
                               "the text the token stands for as a string literal")
        if kind == "dot":
            value = _ANY_CHAR
        elif kind == "brace" and value[1:].lstrip().startswith(","):
            value = "{0" + value[1:]
        out.append(value)
        previous = kind
    return "".join(out)
