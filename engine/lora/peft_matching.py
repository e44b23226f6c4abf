"""PEFT's rules for which modules an adapter_config.json selects, reproduced from peft 0.21.2.

Sources: `check_target_module_exists` in peft/tuners/tuners_utils.py (target_modules, exclude_modules,
layers_to_transform, layers_pattern) and `get_pattern_key` / `match_target_against_key` in peft/utils/other.py
(rank_pattern, alpha_pattern, a target_modules string). Keys are module names in the transformers model, such
as "model.layers.3.self_attn.q_proj". Matching the way PEFT does matters: a rank or scaling picked by a
different rule gives a different model without any error.

The regular expressions come from uploads, and Python's `re` has no timeout, so `check_regex` refuses the
shapes that backtrack exponentially (a repetition inside a repetition, or an alternation inside one) and bounds
the number of repetitions, which keeps the polynomial worst case small on names of about 40 characters.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from loraplex.engine.lora.errors import AdapterConfigError

MAX_REGEX_CHARS = 256
# Repetitions a pattern may hold (besides PEFT's own "(.*\.)?"): few enough that a hostile config cannot make
# matching backtrack for long (decision 0019 has the cost of one match).
MAX_REGEX_REPEATS = 3

# re's own parser (public as sre_parse, deprecated since 3.11): the tree of a pattern, to inspect its shape.
_re_parser: Any = importlib.import_module("re._parser")
_REPEATS = frozenset({"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"})


def is_targeted(
    key: str,
    *,
    target_modules: tuple[str, ...] | str,
    exclude_modules: tuple[str, ...] | str | None,
    layers_to_transform: tuple[int, ...] | None,
    layer_regexes: tuple[re.Pattern[str], ...],
) -> bool:
    """Whether PEFT would put a LoRA layer on module `key` (check_target_module_exists).

    target_modules: a string is a regex that must match the whole key (re.fullmatch); list entries match a key
    equal to them or ending in "." + entry. layers_to_transform filters only list entries matched by suffix (an
    entry equal to the whole key bypasses it, and a regex ignores it; PEFT's own rule). layer_regexes come from
    compile_layers_pattern (none: PEFT's default rule). exclude_modules wins.
    """
    if exclude_modules:
        if isinstance(exclude_modules, str):
            if re.fullmatch(exclude_modules, key):
                return False
        elif key in exclude_modules or any(key.endswith(f".{name}") for name in exclude_modules):
            return False
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, key) is not None
    if key in target_modules:
        return True
    if not any(key.endswith(f".{name}") for name in target_modules):
        return False
    if not layers_to_transform:
        return True
    layer = _layer_index(key, layer_regexes)
    return layer is not None and layer in layers_to_transform


def compile_pattern_key(pattern: str) -> re.Pattern[str]:
    """A rank_pattern / alpha_pattern key as get_pattern_key matches it: against a dotted suffix of the name."""
    return re.compile(rf"(.*\.)?({pattern})$")


def first_matching(patterns: tuple[re.Pattern[str], ...], key: str) -> int | None:
    """Index of the first pattern (in the file's order) that matches `key` (get_pattern_key), if any.

    PEFT uses re.match, anchored at the start; compile_pattern_key's "$" anchors the end.
    """
    for index, pattern in enumerate(patterns):
        if pattern.match(key):
            return index
    return None


def check_regex(pattern: str, field: str) -> int:
    """Refuse a regex that is invalid or could backtrack for a long time, naming the config field.

    Returns its number of repetitions (*, +, {m,n}), so a caller can bound the total over many patterns.
    """
    if len(pattern) > MAX_REGEX_CHARS:
        raise AdapterConfigError(
            f"adapter_config.json field '{field}' holds a regular expression of {len(pattern)} characters; "
            f"at most {MAX_REGEX_CHARS} are accepted",
            field=field,
        )
    try:
        tree = _re_parser.parse(pattern)
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise AdapterConfigError(
            f"adapter_config.json field '{field}' holds {pattern!r}, which is not a valid regular expression: {exc}",
            field=field,
        ) from None
    num_repeats = _count_repeats(tree)
    problem = _backtracking_problem(tree, inside_repeat=False)
    if problem is None and num_repeats > MAX_REGEX_REPEATS:
        problem = f"more than {MAX_REGEX_REPEATS} repetitions"
    if problem is not None:
        raise AdapterConfigError(
            f"adapter_config.json field '{field}' holds the regular expression {pattern!r}, which has {problem}; "
            "loraplex refuses it because matching it could take very long. Simplify it or list module names",
            field=field,
        )
    return num_repeats


def compile_layers_pattern(pattern: str) -> re.Pattern[str]:
    """A layers_pattern entry as PEFT uses it: the name before the layer index. The lazy .*? picks the first
    numbered segment (the layer, not a nested index), as PEFT does."""
    return re.compile(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.")


_DEFAULT_LAYER_REGEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")


def _layer_index(key: str, layer_regexes: tuple[re.Pattern[str], ...]) -> int | None:
    match = None
    for regex in layer_regexes or (_DEFAULT_LAYER_REGEX,):
        match = regex.match(key)
        if match is not None:
            break
    if match is None or match.groupdict().get("idx") is None:
        return None
    return int(match.group("idx"))


def _children(op: str, av: Any) -> list[Any]:
    """The sub-patterns of one node of re's parse tree."""
    if op in _REPEATS:
        return [av[2]]
    if op == "SUBPATTERN":
        return [av[3]]
    if op == "BRANCH":
        return list(av[1])
    if op in ("ASSERT", "ASSERT_NOT"):
        return [av[1]]
    if op == "ATOMIC_GROUP":
        return [av]
    if op == "GROUPREF_EXISTS":
        return [body for body in av[1:] if body is not None]
    return []


def _backtracking_problem(tree: Any, *, inside_repeat: bool) -> str | None:
    for op_code, av in tree:
        op = str(op_code)
        if op == "GROUPREF":
            return "a backreference"
        repeats = op in _REPEATS and av[1] > 1
        if inside_repeat and repeats:
            return "a repetition inside a repetition"
        if inside_repeat and op == "BRANCH":
            return "an alternation inside a repetition"
        for child in _children(op, av):
            problem = _backtracking_problem(child, inside_repeat=inside_repeat or repeats)
            if problem is not None:
                return problem
    return None


def _count_repeats(tree: Any) -> int:
    count = 0
    for op_code, av in tree:
        op = str(op_code)
        count += int(op in _REPEATS and av[1] > 1)
        count += sum(_count_repeats(child) for child in _children(op, av))
    return count
