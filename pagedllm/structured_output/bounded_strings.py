r"""JSON strings with a length bound, rewritten into a form whose token masks xgrammar precomputes.

xgrammar writes a schema string with minLength/maxLength as `"\"" chars{lo, hi} "\""`, where `chars` is a rule of one
character class. Inside that counted repetition a token fits or not depending on the count left, which its
per-position mask cache cannot hold, so every mask there runs the parser over most of the vocabulary (~1 ms a row
for 49k tokens; xgrammar issue #852). The same language as a chain of rules, one per count left, each ending in
the closing quote (the shape of xgrammar's own unbounded string rule),

    chars_upto_k ::= "\"" | chars chars_upto_{k-1}        chars_upto_0 ::= "\""
    chars{lo, hi} "\""  ->  lo rules of one `chars` each, chained, then chars_upto_{hi - lo}

gives every count a grammar position of its own whose mask is computed when the grammar is compiled (~0.03 ms a
row). Compiling costs a rule per count (~8 ms of CPU each for 49k tokens), so bounds over MAX_BOUND stay as they are,
and so do unbounded repetitions (minLength alone), whose masks xgrammar already fills without a per-count cost.

xgrammar's class for the characters of such strings, [^"\\\r\n], lets raw control characters (U+0000-U+001F but CR
and LF) into the string, which JSON forbids (json.loads refuses the output): tighten() makes it [^\0-\x1f"\\], what
its own unbounded string rule allows unescaped (escapes stay out of length-bounded strings, as in xgrammar).
"""

from __future__ import annotations

import re

MAX_BOUND = 128  # the largest maxLength rewritten: one rule per count
_RULE = re.compile(r"^(\w+) ::= (.*)$")
_CLASS_ONLY = re.compile(r"^\(\(\[(?:\\.|[^\]\\])*\]\)\)$")  # a rule that is one character class: (([...]))
_QUOTE = '"\\""'  # the closing quote as xgrammar prints it: "\""
_LOOSE_CHARS = r"(([^\"\\\r\n]))"  # xgrammar's class of a length-bounded string's characters, as it prints it
_JSON_CHARS = r"(([^\0-\x1f\"\\]))"  # the characters JSON allows unescaped in a string


def tighten(text: str) -> str:
    """The EBNF text with each rule that is xgrammar's bounded-string class made JSON's (no control characters)."""
    return re.sub(r"^(\w+ ::= )" + re.escape(_LOOSE_CHARS) + "$", lambda m: m.group(1) + _JSON_CHARS, text, flags=re.M)


def rewrite(text: str) -> str:
    """The EBNF text (as xgrammar prints a grammar), its bounded-string classes tightened, with each
    `class{lo, hi} "\""` of hi <= MAX_BOUND replaced by the equivalent chain of rules (no chain where a new rule's
    name is already taken)."""
    text = tighten(text)
    lines = text.splitlines()
    names = {m.group(1): m.group(2) for m in map(_RULE.match, lines) if m}
    classes = [name for name, body in names.items() if _CLASS_ONLY.match(body)]
    if not classes:
        return text
    counted = re.compile(r"\b(" + "|".join(map(re.escape, classes)) + r")\{(\d+), (\d+)\} " + re.escape(_QUOTE))
    added: dict[str, str] = {}

    def chain(m: re.Match) -> str:
        name, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        if hi > MAX_BOUND or lo > hi:
            return m.group(0)
        for k in range(hi - lo + 1):  # chars_upto_k: at most k characters, then the quote
            more = f" | ({name} {name}_upto_{k - 1})" if k else ""
            added.setdefault(f"{name}_upto_{k}", f"{name}_upto_{k} ::= (({_QUOTE}){more})")
        base = rule = f"{name}_upto_{hi - lo}"
        for j in range(1, lo + 1):  # base_min_j: one character, then base_min_{j-1} (base_min_0 = base)
            added.setdefault(f"{base}_min_{j}", f"{base}_min_{j} ::= (({name} {rule}))")
            rule = f"{base}_min_{j}"
        return rule

    out = [counted.sub(chain, line) for line in lines]
    if not added or any(name in names for name in added):
        return text
    return "\n".join(out + list(added.values())) + "\n"
