"""The traces benchmarks/serve.py sends: what to ask, of which model, and when.

A trace is a list of conversations; a single request is a conversation of one turn. Each turn resends the
conversation so far (its system prompt, earlier questions and the answers the server actually gave) plus a new
question, as chat clients do, so the server's prefix cache sees what it would see in production. Every draw comes
from one seeded `random.Random`: the same arguments give the same trace.

Lengths are in words: prompts are random words from a small list of common English ones, which a BPE tokenizer
keeps whole or cuts in a few pieces (one token each on large English vocabularies, about two on the demo model's;
the server's usage reports the exact counts).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Common short English words: most are one token in any BPE vocabulary trained on English text.
_WORDS = """the of and to in is was for on are as with his they at be this from have or by one had not but what all were
    when we there can an your which their said if do will each about how up out them then she many some so these would
    other into has more her two like him see time could no make than first been its who now people my made over did
    down only way find use may water long little very after words called just where most know get through back much
    go good new write our used me man too any day same right look think also around another came come work three word
    must because does part even place well such here take why things help put years different away again off went old
    number great tell men say small every found still between name should home big give air line set own under read
    last never us left end along while might next sound below saw something thought both few those always looked show
    large often together asked house world going want school important until form food keep children feet land side
    without boy once animals life enough took sometimes four head above kind began almost live page got earth need far
    hand high year mother light parts country father let night following picture being study second eyes soon times
    story boys since white days ever paper hard near sentence better best across during today others however sure means
    knew try told young miles sun ways thing whole hear example heard several change answer room sea against top turned
    learn point city play toward five using himself usually"""
WORDS = tuple(_WORDS.split())


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    question: str
    max_tokens: int
    think_s: float  # the pause between the previous answer and this question (0 for a conversation's first turn)


@dataclasses.dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    start_s: float  # when its first turn is due, from the run's start (open loop; a closed loop ignores it)
    model: str  # the base model's name or an adapter's
    system: str | None  # the system prompt, shared by a tenant's conversations
    turns: tuple[Turn, ...]
    tenant: int | None = None


def num_turns(trace: Sequence[Conversation]) -> int:
    return sum(len(c.turns) for c in trace)


# --- distributions -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Distribution:
    """fixed (low == high), uniform over [low, high], or lognormal with mean `low` and shape `sigma` (the spread of
    the log), written "N", "LOW:HIGH" or "lognormal:MEAN[:SIGMA]" (SIGMA 0.5 by default)."""

    kind: str  # "fixed", "uniform" or "lognormal"
    low: float
    high: float
    sigma: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Distribution:
        parts = text.strip().split(":")
        try:
            if parts[0] == "lognormal":
                if len(parts) not in (2, 3):
                    raise ValueError
                mean, sigma = float(parts[1]), float(parts[2]) if len(parts) == 3 else 0.5
                if mean <= 0 or sigma < 0:
                    raise ValueError
                return cls("lognormal", mean, mean, sigma)
            if len(parts) == 1:
                value = float(parts[0])
                dist = cls("fixed", value, value)
            elif len(parts) == 2:
                dist = cls("uniform", float(parts[0]), float(parts[1]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{text!r} is not N, LOW:HIGH or lognormal:MEAN[:SIGMA] with positive numbers") from None
        if dist.low < 0 or dist.high < dist.low:
            raise ValueError(f"{text!r}: need 0 <= LOW <= HIGH")
        return dist

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high)
        # exp(N(mu, sigma)) has mean exp(mu + sigma^2 / 2): mu is chosen so that the mean is `low`.
        return rng.lognormvariate(math.log(self.low) - self.sigma**2 / 2, self.sigma)

    def draw_int(self, rng: random.Random, minimum: int = 1) -> int:
        """A whole number of at least `minimum`; a uniform draw covers both ends equally."""
        if self.kind == "uniform":
            return max(minimum, rng.randint(math.ceil(self.low), math.floor(self.high)))
        return max(minimum, round(self.draw(rng)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.low:g}"
        if self.kind == "uniform":
            return f"{self.low:g}:{self.high:g}"
        return f"lognormal:{self.low:g}:{self.sigma:g}"


# --- draws ---------------------------------------------------------------------------------------------------------


def poisson_arrivals(rng: random.Random, count: int, rate: float) -> list[float]:
    """`count` arrival times of a Poisson process of `rate` per second, the first at 0 (exponential gaps between
    them); an infinite rate sends everything at once."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    times: list[float] = []
    now = 0.0
    for i in range(count):
        if i and not math.isinf(rate):
            now += rng.expovariate(rate)
        times.append(now)
    return times


def zipf_weights(count: int, alpha: float) -> list[float]:
    """Popularity of ranks 1..count under a power law: weight of rank k proportional to 1 / k**alpha, summing to 1."""
    if alpha < 0:
        raise ValueError("the Zipf exponent must be at least 0")
    raw = [1.0 / (rank**alpha) for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelMix:
    """Which model a request asks for: `base_share` of them the base model, the rest an adapter drawn with Zipf
    popularity of exponent `alpha` (adapters[0] the most popular). Without adapters, every request is the base's."""

    base_model: str
    adapters: tuple[str, ...] = ()
    alpha: float = 1.0
    base_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.base_share <= 1:
            raise ValueError("base_share must be within [0, 1]")
        if self.alpha < 0:
            raise ValueError("the Zipf exponent must be at least 0")

    def draw(self, rng: random.Random) -> str:
        if not self.adapters or rng.random() < self.base_share:
            return self.base_model
        return rng.choices(self.adapters, weights=zipf_weights(len(self.adapters), self.alpha))[0]


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


# --- generators ----------------------------------------------------------------------------------------------------


def synthetic_trace(
    *,
    num_requests: int,
    mix: ModelMix,
    input_len: Distribution,
    output_len: Distribution,
    rate: float | None = None,
    seed: int = 0,
) -> list[Conversation]:
    """Independent single-turn requests: `input_len` random words each, `output_len` tokens out, arriving as a
    Poisson process of `rate` per second (None: a closed loop sets the pace; every start is 0)."""
    rng = random.Random(seed)
    starts = poisson_arrivals(rng, num_requests, rate) if rate is not None else [0.0] * num_requests
    return [
        Conversation(
            index=i,
            start_s=starts[i],
            model=mix.draw(rng),
            system=None,
            turns=(Turn(random_words(rng, input_len.draw_int(rng)), output_len.draw_int(rng), 0.0),),
        )
        for i in range(num_requests)
    ]


def chat_trace(
    *,
    num_tenants: int,
    conversations_per_tenant: int,
    mix: ModelMix,
    turns: Distribution,
    system_len: Distribution,
    question_len: Distribution,
    answer_len: Distribution,
    think_s: Distribution,
    rate: float | None = None,
    seed: int = 0,
) -> list[Conversation]:
    """Multi-turn chats: each tenant has one system prompt and one model (drawn from `mix`) that all its
    conversations share, so the server can reuse the prompt's KV across them. Conversations start as a Poisson
    process of `rate` per second in a shuffled tenant order (None: a closed loop sets the pace); a turn's question
    follows the previous answer after `think_s` seconds."""
    rng = random.Random(seed)
    tenants = [(mix.draw(rng), random_words(rng, system_len.draw_int(rng))) for _ in range(num_tenants)]
    order = [t for t in range(num_tenants) for _ in range(conversations_per_tenant)]
    rng.shuffle(order)
    starts = poisson_arrivals(rng, len(order), rate) if rate is not None else [0.0] * len(order)
    trace: list[Conversation] = []
    for index, tenant in enumerate(order):
        model, system = tenants[tenant]
        num = turns.draw_int(rng)
        trace.append(
            Conversation(
                index=index,
                start_s=starts[index],
                model=model,
                system=system,
                turns=tuple(
                    Turn(
                        random_words(rng, question_len.draw_int(rng)),
                        answer_len.draw_int(rng),
                        think_s.draw(rng) if turn else 0.0,
                    )
                    for turn in range(num)
                ),
                tenant=tenant,
            )
        )
    return trace


# --- files ---------------------------------------------------------------------------------------------------------


def trace_to_json(trace: Sequence[Conversation]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(c) for c in trace]


def load_trace(path: Path) -> list[Conversation]:
    """A trace written by `trace_to_json` (or by hand in its shape): a JSON list of conversations, each with
    start_s, model, system (or null), tenant (optional) and turns of {question, max_tokens, think_s}."""
    try:
        items = json.loads(path.read_text())
        return [
            Conversation(
                index=i,
                start_s=float(item["start_s"]),
                model=str(item["model"]),
                system=item.get("system"),
                turns=tuple(
                    Turn(str(t["question"]), int(t["max_tokens"]), float(t.get("think_s", 0.0))) for t in item["turns"]
                ),
                tenant=item.get("tenant"),
            )
            for i, item in enumerate(items)
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a trace ({exc!r})") from None
