"""The rule engine for chat: constraint lines in the prompt, checks on the output.

A rule is one line. Most rules are plain instructions that only go into the
prompt (each as a line beginning with `##必须遵守:`, through the configurable
template). Rules that begin with a directive are also checked on the output:

    forbid: <phrase>            the phrase must not appear (also blocked while decoding)
    forbid_regex: <pattern>     no match of the regular expression (RE2 syntax) may appear
    format: json                the whole output must be valid JSON
    numbers_from_context        every number in the output must appear in the conversation

Violations are reported per rule kind (a bounded set, used as the metric label).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jinja2
import re2
from jinja2.sandbox import ImmutableSandboxedEnvironment

RULE_KINDS = ("forbid", "forbid_regex", "format_json", "numbers_from_context")
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*")
STRICT_LINE = "Your previous answer broke these rules: {broken}. Follow every rule exactly."
# A request's pattern runs on the worker's event loop: RE2 matches in time linear in the text, where a
# backtracking engine can take hours on a pattern such as (\D*)*\d. So no backreferences or lookaround.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is the request's error, not a line on the worker's stderr
_RE2_OPTIONS.max_mem = 8 << 20  # per compiled pattern


class RuleError(ValueError):
    """A rule line that cannot be used (a bad regular expression, an unknown format)."""


@dataclass(frozen=True)
class Rule:
    kind: str  # one of RULE_KINDS, or "instruction" for prompt-only rules
    argument: str
    text: str  # the line as written
    pattern: object = None  # forbid_regex: the compiled RE2 pattern

    @property
    def prompt_line(self) -> str:
        """How the rule reads to the model."""
        if self.kind == "forbid":
            return f'Never write "{self.argument}".'
        if self.kind == "forbid_regex":
            return f"Never write text matching the pattern {self.argument}."
        if self.kind == "format_json":
            return "Answer with valid JSON only, and nothing else."
        if self.kind == "numbers_from_context":
            return "Only use numbers that appear in the conversation; never invent or change a number."
        return self.text


@dataclass(frozen=True)
class Violation:
    rule: str  # the rule kind (the metric label)
    detail: str


def parse_rule(line: str) -> Rule:
    text = line.strip()
    head, sep, rest = text.partition(":")
    key, arg = head.strip().lower(), rest.strip()
    if sep and key == "forbid" and arg:
        return Rule("forbid", arg, text)
    if sep and key == "forbid_regex" and arg:
        try:
            pattern = re2.compile(arg, options=_RE2_OPTIONS)
        except re2.error as exc:
            reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
            raise RuleError(f"rule {text!r}: not a regular expression RE2 takes ({reason}; RE2 has no "
                            "backreferences or lookaround)") from None
        return Rule("forbid_regex", arg, text, pattern)
    if sep and key == "format":
        if arg.lower() != "json":
            raise RuleError(f"rule {text!r}: the only checked format is json")
        return Rule("format_json", "json", text)
    if text.lower() == "numbers_from_context":
        return Rule("numbers_from_context", "", text)
    return Rule("instruction", text, text)


class RuleSet:
    """The rules for one request, with the template that turns them into prompt lines."""

    def __init__(self, lines: list[str], template: str) -> None:
        seen: set[str] = set()
        self.rules: list[Rule] = []
        for line in lines:
            if line.strip() and line.strip() not in seen:
                seen.add(line.strip())
                self.rules.append(parse_rule(line))
        self._template = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined).from_string(template)

    def __bool__(self) -> bool:
        return bool(self.rules)

    @property
    def banned_phrases(self) -> tuple[str, ...]:
        return tuple(r.argument for r in self.rules if r.kind == "forbid")

    def prompt_block(self, extra_lines: tuple[str, ...] = ()) -> str:
        return self._template.render(rules=[r.prompt_line for r in self.rules] + list(extra_lines)).strip()

    def check(self, output: str, context: str) -> list[Violation]:
        found: list[Violation] = []
        lowered = output.lower()
        for rule in self.rules:
            if rule.kind == "forbid" and rule.argument.lower() in lowered:
                found.append(Violation("forbid", f'contains the forbidden phrase "{rule.argument}"'))
            elif rule.kind == "forbid_regex" and (m := rule.pattern.search(output)):
                found.append(Violation("forbid_regex", f"matches {rule.argument!r} at {m.start()}: {m.group(0)[:40]!r}"))
            elif rule.kind == "format_json":
                try:
                    json.loads(output)
                except ValueError as exc:
                    found.append(Violation("format_json", f"not valid JSON: {exc}"[:200]))
            elif rule.kind == "numbers_from_context":
                known = {_norm(n) for n in _NUMBER.findall(context)}
                invented = [n for n in _NUMBER.findall(output) if _norm(n) not in known]
                if invented:
                    found.append(Violation("numbers_from_context", "numbers not in the context: "
                                           + ", ".join(sorted(set(invented))[:10])))
        return found


def _norm(number: str) -> str:
    return number.replace(",", "").lstrip("+")
