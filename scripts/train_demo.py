"""Trains loraplex's demo model and three LoRA adapters on a CPU, from text that ships with Python.

    .venv/bin/python scripts/train_demo.py                   # writes demo/ (about 20 minutes on 2 CPU threads)
    .venv/bin/python scripts/train_demo.py --adapter think   # retrains one adapter on demo/'s base (minutes)
    .venv/bin/python scripts/train_demo.py --check           # seconds: does demo/ still match this script?

The corpus is pydoc's help topics (`pydoc_data.topics`, the text `help("assert")` shows) and the docstrings of the
standard library's top-level modules, read with `ast` (nothing is imported). From it come a byte-level BPE tokenizer,
a small Llama (GQA, SwiGLU, tied embeddings) and three PEFT LoRA adapters:

- upper: answers in UPPER CASE, the same answer the base model gives;
- terse: answers with the first sentence only, then ends its turn;
- think: writes a short think block first, in Qwen3's format (`<think>\n` ... `\n</think>\n\n`, then the answer), and
  answers at once when the prompt closed the block (the chat template's `enable_thinking: false`).

Training is plain torch (AdamW, fp32) on transformers' LlamaForCausalLM, with peft for the adapters: both are dev
dependencies, and this is a script, never product code. Seeds are fixed, so a rerun on the same Python, library
versions and thread count gives the same files. docs/decisions/0008-demo-model.md says why it is built this way.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.engine.tools.demo import (
    BOS_TOKEN,
    DEFAULT_CHAT_TEMPLATE,
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    SPECIAL_TOKENS,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "demo"
# What adapter_config.json names as its base: a name, never a path on the machine that trained it.
BASE_MODEL_NAME = "loraplex-demo"
MAX_DEMO_BYTES = 20 * 2**20
# The figures README.md shows (times, losses, corpus, environment), kept so that an adapter retrained alone keeps
# the others' figures.
REPORT_FILE = "report.json"

# The model: about 4M parameters, a few MB in bf16, fast enough to train and serve on two CPU threads.
VOCAB_SIZE = 4096
HIDDEN_SIZE = 256
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE_SIZE = 704
CONTEXT_LENGTH = 256
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5

# Pretraining. A block is upper-cased with this probability (drawn again every epoch), so the base model knows upper
# case as a way of writing the same words, as any real base model does; the upper adapter only has to switch it on.
UPPER_BLOCK_PROBABILITY = 0.2
BASE_STEPS = 360
BASE_BATCH = 16  # sequences of CONTEXT_LENGTH tokens
BASE_LR = 2e-3
WARMUP_STEPS = 20

# The adapters: rank 8 on every projection, trained on chat turns only (loss on what the model writes: the answer,
# the think adapter's think block, and the <|im_end|> that ends the turn).
ADAPTERS = ("upper", "terse", "think")
LORA_RANK = 8
LORA_ALPHA = 16
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The think adapter has more to learn (when to close the block and when to end the turn) and longer turns, which it
# is batched by length for (BUCKET_BATCHES batches sorted at a time).
ADAPTER_STEPS = {"upper": 120, "terse": 120, "think": 400}
ADAPTER_LR = {"upper": 2e-3, "terse": 2e-3, "think": 3e-3}
ADAPTER_BATCH = 16
BUCKET_BATCHES = 8

# The think adapter writes a think block before its answer, as Qwen3 does: "<think>\n" + thinking + "\n</think>\n\n"
# + answer. The demo's context is 256 tokens, so the thinking is 40-110 tokens (its length drawn anew for every
# example, so that a thinking budget visibly cuts some blocks and not others) and the answer at most 60.
THINK_START = "<think>\n"
THINK_END = "\n</think>\n\n"
MIN_THINK_TOKENS = 40
MAX_THINK_TOKENS = 110
MAX_THINK_ANSWER_TOKENS = 60
# Shares of the think adapter's examples that are not a whole think block: prompts rendered with
# enable_thinking=false (an empty block closed in the prompt: the answer follows at once), and blocks cut short the
# way the engine cuts one whose budget runs out (its closing text and the end marker forced in, not learned).
NO_THINK_SHARE = 0.22
CUT_THINK_SHARE = 0.15
# How much more the tokens that shape a reply weigh in the think adapter's loss than the others (see _weighted).
DECISION_WEIGHT = 5.0

QUESTION_TEMPLATES = (
    "Tell me about {subject}.",
    "What is {subject}?",
    "Explain {subject}.",
    "Can you describe {subject}?",
    "What should I know about {subject}?",
)
# The prompts demo/README.md shows; the first is the one tests/test_demo_assets.py asserts on.
SAMPLE_PROMPTS = (
    'Tell me about the "for" statement.',
    'What is the "json" module?',
    "How do I write a class?",
)
SAMPLE_MAX_TOKENS = 64
# The adapters whose sample answers README shows one a line; the think adapter's are longer and shown whole.
TABLE_ADAPTERS = ("upper", "terse")
THINK_SAMPLE_MAX_TOKENS = 200
# The budgets README's serve command gives the reasoning_effort tiers: `high` mostly lets the think adapter finish.
DEMO_REASONING_BUDGETS = "none=0,minimal=8,low=16,medium=48,high=128"

_UNDERLINE = re.compile(r"([*=\-~^])\1+")
# A sentence ends at . ! or ? followed by a capital or a quote: "e.g. the" and "1.5" stay inside one.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(A-Z])")
MAX_ANSWER_SENTENCES = 3
MAX_ANSWER_CHARS = 400
MAX_MORE_SENTENCES = 12  # QA.more: enough for the longest think block
# A token that ends a sentence: a full stop (or ? or !), perhaps inside a closing quote or parenthesis.
_SENTENCE_STOP = re.compile(r"[.!?][\"')]*\s*$")


@dataclass(frozen=True)
class Document:
    """One help topic or module docstring: sections of (title, blocks); prose is unwrapped to one line a block."""

    sections: tuple[tuple[str, tuple[str, ...]], ...]

    def blocks(self) -> Iterator[str]:
        for title, blocks in self.sections:
            yield title
            yield from blocks


@dataclass(frozen=True)
class QA:
    """A chat turn the base model learns to answer: a question about `subject`, answered by pydoc's own words."""

    subject: str  # 'the "assert" statement'
    answer: str  # the section's opening sentences (at most three)
    # The prose sentences after the answer (its section's, then the next sections'): the think adapter's reasoning.
    more: tuple[str, ...] = ()


@dataclass(frozen=True)
class ThinkSample:
    """One greedy output of the think adapter, as README shows it."""

    prompt: str
    enable_thinking: bool  # False: rendered with enable_thinking=false, the think block closed in the prompt
    text: str
    num_think_tokens: int  # "<think>" up to and including "</think>"; 0 when the output closed none


# ---------------------------------------------------------------------------------------------------------- corpus


def load_documents() -> list[Document]:
    """pydoc's topics (deduplicated: 'if' and 'else' are one text) and the stdlib's module docstrings, sorted."""
    from pydoc_data.topics import topics

    documents = [_parse(text) for text in sorted(set(topics.values()))]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if docstring and len(docstring) >= 200:  # shorter ones are mostly a line naming the module
            documents.append(_parse(docstring, title=f'The "{path.stem}" module'))
    return documents


def _parse(text: str, *, title: str = "") -> Document:
    sections: list[tuple[str, tuple[str, ...]]] = []
    blocks: list[str] = []
    for raw in re.split(r"\n\s*\n", text.strip("\n")):
        lines = raw.rstrip().split("\n")
        if len(lines) == 2 and _UNDERLINE.fullmatch(lines[1].strip()):  # reST title: a new section starts
            if title or blocks:
                sections.append((title, tuple(blocks)))
            title, blocks = lines[0].strip(), []
            continue
        lines = [line for line in lines if not _UNDERLINE.fullmatch(line.strip())]
        if not lines:
            continue
        if _is_prose(lines):
            # pydoc wraps at 70 columns; a chat answer is one line, so the model learns prose as one.
            blocks.append(re.sub(" {2,}", " ", " ".join(line.strip() for line in lines)))
        else:
            blocks.append("\n".join(lines))
    sections.append((title, tuple(blocks)))
    return Document(tuple((t, b) for t, b in sections if t or b))


def _is_prose(lines: list[str]) -> bool:
    first = lines[0]
    return all(line[:1] not in (" ", "\t") for line in lines) and (first[:1].isalnum() or first[:1] in "\"'(")


def question_answers(documents: list[Document]) -> list[QA]:
    """One QA per section whose first prose block starts with a sentence short enough to be an answer."""
    seen: set[tuple[str, str]] = set()
    result: list[QA] = []
    for document in documents:
        for index, (title, blocks) in enumerate(document.sections):
            prose = [b for b in blocks if "\n" not in b and len(b) >= 60 and b[:1].isupper()]
            if not title or not prose:
                continue
            sentences = _SENTENCE_END.split(prose[0])
            answer, used = sentences[0], 1
            for sentence in sentences[1:MAX_ANSWER_SENTENCES]:
                if len(answer) + 1 + len(sentence) > MAX_ANSWER_CHARS:
                    break
                answer, used = answer + " " + sentence, used + 1
            if len(answer) > MAX_ANSWER_CHARS or not answer.endswith("."):  # "...as follows:" needs its code
                continue
            # Read on in the document, past the section's end when it is short.
            after = [b for _, later in document.sections[index + 1 :] for b in later]
            more = sentences[used:] + [
                s for b in prose[1:] + after if "\n" not in b and b[:1].isupper() for s in _SENTENCE_END.split(b)
            ]
            more = [s for s in more if _SENTENCE_STOP.search(s)]  # not "... as follows:", which needs its code
            qa = QA(_subject(title), answer, tuple(more[:MAX_MORE_SENTENCES]))
            if (qa.subject, qa.answer) not in seen:
                seen.add((qa.subject, qa.answer))
                result.append(qa)
    return result


def _subject(title: str) -> str:
    # 'The "for" statement' -> 'the "for" statement'; other titles keep their capitals ("Debugger Commands").
    return "t" + title[1:] if title.startswith("The ") else title


def first_sentence(text: str) -> str:
    return _SENTENCE_END.split(text, maxsplit=1)[0]


# ------------------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(documents: list[Document], qas: list[QA]) -> Any:
    """A byte-level BPE in engine/tools/demo.py's conventions (special ids 0-3, BOS added by the post-processor).

    It is trained on every block in both cases, so that upper-case words get merges of their own: without them an
    upper-case answer is spelled a letter or two a token, which a 4M-parameter model does badly.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as BackendTokenizer

    texts = [block for document in documents for block in document.blocks()]
    texts += [f"user\n{QUESTION_TEMPLATES[0].format(subject=qa.subject)}\nassistant\n{qa.answer}" for qa in qas]
    texts += [text.upper() for text in texts]
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    if backend.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the corpus gave {backend.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    bos_id = backend.token_to_id(BOS_TOKEN)
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
            ),
        ]
    )
    return backend


def write_model_files(folder: Path, backend: Any) -> None:
    """tokenizer.json, tokenizer_config.json, config.json and generation_config.json, as engine/tools/demo.py
    writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    _write_json(
        folder / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": {
                str(ids[token]): {
                    "content": token,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for token in SPECIAL_TOKENS
            },
            "bos_token": BOS_TOKEN,
            "chat_template": DEFAULT_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END_TOKEN,
            "model_max_length": CONTEXT_LENGTH,
            "pad_token": END_OF_TEXT_TOKEN,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(folder / "config.json", model_config(ids[BOS_TOKEN], ids[END_OF_TEXT_TOKEN]))
    # A chat model stops at the end of its turn as well as at the end of the text, as Llama 3 Instruct does.
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[END_OF_TEXT_TOKEN], ids[IM_END_TOKEN]]},
    )


def model_config(bos_token_id: int, eos_token_id: int) -> dict[str, Any]:
    """config.json with transformers 4.4x field names (rope_theta, torch_dtype), which transformers 5 still reads."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "head_dim": HIDDEN_SIZE // NUM_HEADS,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": CONTEXT_LENGTH,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


# -------------------------------------------------------------------------------------------------------- training


def chat_prompt(tokenizer: Any, question: str, *, enable_thinking: bool = True) -> list[int]:
    """The prompt ids exactly as the engine builds them: its own chat template renderer, no second BOS.
    enable_thinking=False is Qwen3's template variable: the prompt ends with an empty, closed think block."""
    kwargs = None if enable_thinking else {"enable_thinking": False}
    return tokenizer.encode_chat(  # type: ignore[no-any-return]
        [{"role": "user", "content": question}], template_kwargs=kwargs
    )


def answer_ids(tokenizer: Any, answer: str) -> list[int]:
    return [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.token_to_id(IM_END_TOKEN)]


def pretraining_batches(
    tokenizer: Any, documents: list[Document], qas: list[QA], seed: int
) -> Iterator[list[list[int]]]:
    """Endless batches of packed CONTEXT_LENGTH sequences: documents (some blocks upper-cased) and chat turns.

    Every epoch draws its own upper-cased blocks, question wordings and order from `seed` and the epoch number.
    """
    bos, eot = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(END_OF_TEXT_TOKEN)
    for epoch in range(1_000_000):
        rng = random.Random(f"{seed}-{epoch}")
        pieces: list[list[int]] = []
        for document in documents:
            text = "\n\n".join(b.upper() if rng.random() < UPPER_BLOCK_PROBABILITY else b for b in document.blocks())
            pieces.append([bos, *tokenizer.encode(text, add_special_tokens=False), eot])
        for qa in qas:
            question = rng.choice(QUESTION_TEMPLATES).format(subject=qa.subject)
            pieces.append(chat_prompt(tokenizer, question) + answer_ids(tokenizer, qa.answer))
        rng.shuffle(pieces)
        stream = [token for piece in pieces for token in piece]
        sequences = [stream[i : i + CONTEXT_LENGTH] for i in range(0, len(stream) - CONTEXT_LENGTH + 1, CONTEXT_LENGTH)]
        rng.shuffle(sequences)
        for i in range(0, len(sequences) - BASE_BATCH + 1, BASE_BATCH):
            yield sequences[i : i + BASE_BATCH]


def _lr(step: int, total: int, peak: float) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _train(
    model: Any, parameters: list[Any], batches: Iterator[Any], steps: int, peak_lr: float, name: str
) -> list[float]:
    import torch

    optimizer = torch.optim.AdamW(parameters, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses: list[float] = []
    started = time.monotonic()
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, steps, peak_lr)
        input_ids, labels, attention_mask, weights = next(batches)
        if weights is None:
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            mean = loss
        else:
            # transformers' loss, each token weighted; the mean that is logged and reported stays unweighted.
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
            target = labels[:, 1:]
            token_losses = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="none"
            ).view_as(target)
            loss = (token_losses * weights[:, 1:]).sum() / weights[:, 1:].sum()
            mean = token_losses.sum() / (target != -100).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean.item())
        if step % 20 == 0 or step == steps - 1:
            recent = sum(losses[-20:]) / len(losses[-20:])
            print(
                f"  {name} step {step + 1}/{steps}  loss {recent:.3f}  {time.monotonic() - started:.0f} s", flush=True
            )
    model.eval()
    return losses


def train_base(tokenizer: Any, documents: list[Document], qas: list[QA], model_dir: Path, seed: int) -> list[float]:
    """Pretrains the base model and writes model.safetensors in bfloat16."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = json.loads((model_dir / "config.json").read_text())
    # Trained in float32; config.json's torch_dtype says how the weights are stored.
    fields.pop("torch_dtype")
    model = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.float32)

    def tensors() -> Iterator[tuple[Any, Any, Any, Any]]:
        for batch in pretraining_batches(tokenizer, documents, qas, seed):
            ids = torch.tensor(batch)
            yield ids, ids, None, None

    losses = _train(model, list(model.parameters()), tensors(), BASE_STEPS, BASE_LR, "base")
    # The tied lm_head is the embedding matrix: safetensors stores a shared tensor once, under the embedding's name.
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return losses


# (input ids, labels: -100 where no loss is taken, loss weights: None when every label weighs 1)
Example = tuple[list[int], list[int], list[float] | None]


def style_examples(tokenizer: Any, qas: list[QA], style: Callable[[str], str]) -> list[Example]:
    """Every QA in every question wording, its answer restyled; only answer tokens carry a loss."""
    examples: list[Example] = []
    for qa in qas:
        for template in QUESTION_TEMPLATES:
            prompt = chat_prompt(tokenizer, template.format(subject=qa.subject))
            answer = answer_ids(tokenizer, style(qa.answer))
            examples.append((prompt + answer, [-100] * len(prompt) + answer, None))
    return examples


def think_examples(tokenizer: Any, qas: list[QA], seed: int) -> list[Example]:
    """Every QA in every question wording, answered after a think block (see NO_THINK_SHARE for the others).

    The thinking restates the question and reads on in the section, the answer is its opening sentence or two.
    Loss on everything the model writes: the think block, the answer and its <|im_end|>, never the prompt or the
    text the engine forces in when a budget runs out.
    """
    from loraplex.engine import ReasoningConfig

    closing = tokenizer.encode(ReasoningConfig(parser="qwen3").closing_text + "</think>", add_special_tokens=False)
    rng = random.Random(f"{seed}-think")
    examples = []
    for qa in qas:
        answer = short_answer(tokenizer, qa.answer)
        for template in QUESTION_TEMPLATES:
            question = template.format(subject=qa.subject)
            draw = rng.random()
            if draw < NO_THINK_SHARE:
                prompt = chat_prompt(tokenizer, question, enable_thinking=False)
                target = answer_ids(tokenizer, answer)
                examples.append(_weighted(tokenizer, prompt + target, [-100] * len(prompt) + target))
                continue
            prompt = chat_prompt(tokenizer, question)
            thinking = think_text(tokenizer, qa, answer, rng.randint(MIN_THINK_TOKENS, MAX_THINK_TOKENS))
            if draw < NO_THINK_SHARE + CUT_THINK_SHARE:
                head = tokenizer.encode(THINK_START + thinking, add_special_tokens=False)
                head = head[: rng.randint(4, len(head) - 4)]
                tail = answer_ids(tokenizer, "\n\n" + answer)
                ids = prompt + head + closing + tail
                examples.append(_weighted(tokenizer, ids, [-100] * len(prompt) + head + [-100] * len(closing) + tail))
                continue
            target = answer_ids(tokenizer, THINK_START + thinking + THINK_END + answer)
            examples.append(_weighted(tokenizer, prompt + target, [-100] * len(prompt) + target))
    return examples


def _weighted(tokenizer: Any, ids: list[int], labels: list[int]) -> Example:
    """The example with DECISION_WEIGHT on the tokens that decide its shape: the first the model writes after a
    prompt or forced text (open a think block or answer), every one after a full stop (read on, close the block,
    or end the turn) and the think markers' own (several tokens each: the demo tokenizer has no token for them).
    The other tokens' loss is about wording, which a model this small learns far less of, and would drown them out."""
    weights = [0.0 if label == -100 else 1.0 for label in labels]
    for i in range(1, len(ids)):
        if labels[i] != -100 and (labels[i - 1] == -100 or _SENTENCE_STOP.search(tokenizer.decode([ids[i - 1]]))):
            weights[i] = DECISION_WEIGHT
    for marker in ("<think>", "</think>"):
        marker_ids = tokenizer.encode(marker, add_special_tokens=False)
        for i in range(len(ids) - len(marker_ids) + 1):
            if ids[i : i + len(marker_ids)] == marker_ids and labels[i] != -100:
                weights[i : i + len(marker_ids)] = [DECISION_WEIGHT] * len(marker_ids)
    return ids, labels, weights


def short_answer(tokenizer: Any, answer: str) -> str:
    """The answer's opening sentences that fit MAX_THINK_ANSWER_TOKENS (the first one always)."""
    sentences = _SENTENCE_END.split(answer)
    result = sentences[0]
    for sentence in sentences[1:]:
        if _num_tokens(tokenizer, result + " " + sentence) > MAX_THINK_ANSWER_TOKENS:
            break
        result += " " + sentence
    return result


def think_text(tokenizer: Any, qa: QA, answer: str, max_tokens: int) -> str:
    """The question restated, then the QA's sentences after `answer` and those of `qa.more`, as long as they fit
    `max_tokens` (one that does not fit is passed over for a shorter one after it). Where they give fewer than
    MIN_THINK_TOKENS the thinking restates the answer first."""
    sentences = _SENTENCE_END.split(qa.answer)
    later = [*sentences[len(_SENTENCE_END.split(answer)) :], *qa.more]
    for pool in (later, [*sentences, *later]):
        text = f"The user asks about {qa.subject}."
        for sentence in pool:
            if _num_tokens(tokenizer, text + " " + sentence) <= max_tokens:
                text += " " + sentence
        if _num_tokens(tokenizer, text) >= MIN_THINK_TOKENS:
            break
    return text


def _num_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def adapter_batches(tokenizer: Any, examples: list[Example], seed: int, *, by_length: bool = False) -> Iterator[Any]:
    """Endless padded batches of `examples`, reshuffled every pass. `by_length` batches examples of about the same
    length together (each run of BUCKET_BATCHES batches sorted by length), so that less time goes on padding."""
    import torch

    pad = tokenizer.token_to_id(END_OF_TEXT_TOKEN)
    examples = list(examples)
    rng = random.Random(seed)
    while True:
        rng.shuffle(examples)
        batches = [examples[i : i + ADAPTER_BATCH] for i in range(0, len(examples) - ADAPTER_BATCH + 1, ADAPTER_BATCH)]
        if by_length:
            run = ADAPTER_BATCH * BUCKET_BATCHES
            batches = []
            for start in range(0, len(examples) - run + 1, run):
                bucket = sorted(examples[start : start + run], key=lambda example: len(example[0]))
                batches += [bucket[i : i + ADAPTER_BATCH] for i in range(0, run, ADAPTER_BATCH)]
            rng.shuffle(batches)
        for batch in batches:
            width = max(len(ids) for ids, _, _ in batch)
            input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _, _ in batch])
            labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab, _ in batch])
            mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _, _ in batch])
            weights = None
            if any(w is not None for _, _, w in batch):
                weights = torch.tensor([(w or [1.0] * len(ids)) + [0.0] * (width - len(ids)) for ids, _, w in batch])
            yield input_ids, labels, mask, weights


def adapter_examples(tokenizer: Any, qas: list[QA], name: str, seed: int) -> list[Example]:
    if name == "think":
        return think_examples(tokenizer, qas, seed)
    styles: dict[str, Callable[[str], str]] = {"upper": str.upper, "terse": first_sentence}
    return style_examples(tokenizer, qas, styles[name])


def train_adapter(tokenizer: Any, qas: list[QA], model_dir: Path, name: str, out: Path, seed: int) -> list[float]:
    """Trains one LoRA on the saved (bf16) base, the weights it will be served with, and saves it with PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=list(LORA_MODULES),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    peft_model.peft_config["default"].base_model_name_or_path = BASE_MODEL_NAME
    parameters = [p for p in peft_model.parameters() if p.requires_grad]
    examples = adapter_examples(tokenizer, qas, name, seed)
    batches = adapter_batches(tokenizer, examples, seed, by_length=name == "think")
    losses = _train(peft_model, parameters, batches, ADAPTER_STEPS[name], ADAPTER_LR[name], name)
    if out.exists():
        shutil.rmtree(out)
    # save_embedding_layers=False: PEFT would otherwise look the base's name up on the Hugging Face Hub.
    peft_model.save_pretrained(str(out), save_embedding_layers=False)
    # PEFT's model card is an empty template; demo/README.md describes the adapters.
    (out / "README.md").unlink(missing_ok=True)
    return losses


# --------------------------------------------------------------------------------------------------------- outputs


def sample_outputs(out: Path) -> dict[str, dict[str, str]]:
    """Greedy answers to SAMPLE_PROMPTS from the loraplex engine: base model and each TABLE_ADAPTERS, in one batch."""
    from loraplex.engine import LLM, LoRARequest, SamplingParams

    llm = LLM(out / "model", device="cpu", kv_budget=64 * 2**20)
    loras: list[LoRARequest | None] = [None, *(LoRARequest(n, out / "adapters" / n) for n in TABLE_ADAPTERS)]
    names = ["base", *TABLE_ADAPTERS]
    conversations = [[{"role": "user", "content": prompt}] for prompt in SAMPLE_PROMPTS for _ in loras]
    results = llm.chat(
        conversations,
        SamplingParams(temperature=0.0, max_tokens=SAMPLE_MAX_TOKENS),
        lora_request=[lora for _ in SAMPLE_PROMPTS for lora in loras],
    )
    samples: dict[str, dict[str, str]] = {prompt: {} for prompt in SAMPLE_PROMPTS}
    for i, result in enumerate(results):
        samples[SAMPLE_PROMPTS[i // len(loras)]][names[i % len(loras)]] = result.outputs[0].text
    return samples


def think_samples(out: Path) -> list[ThinkSample]:
    """The think adapter's greedy outputs, whole and raw: SAMPLE_PROMPTS, then again with enable_thinking=false."""
    from loraplex.engine import LLM, LoRARequest, SamplingParams

    llm = LLM(out / "model", device="cpu", kv_budget=64 * 2**20)
    tokenizer = llm.get_tokenizer()
    asked = [(prompt, True) for prompt in SAMPLE_PROMPTS] + [(prompt, False) for prompt in SAMPLE_PROMPTS]
    results = llm.generate(
        [{"prompt_token_ids": chat_prompt(tokenizer, prompt, enable_thinking=thinking)} for prompt, thinking in asked],
        SamplingParams(temperature=0.0, max_tokens=THINK_SAMPLE_MAX_TOKENS),
        lora_request=LoRARequest("think", out / "adapters" / "think"),
    )
    samples = []
    for (prompt, thinking), result in zip(asked, results, strict=True):
        text = result.outputs[0].text
        head, marker, _ = text.partition(THINK_END.strip("\n"))
        num_think = len(tokenizer.encode(head + marker, add_special_tokens=False)) if marker and thinking else 0
        samples.append(ThinkSample(prompt, thinking, text, num_think))
    return samples


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


ADAPTER_WHAT = {
    "upper": "answers in UPPER CASE",
    "terse": "answers with one sentence, then ends its turn",
    "think": "thinks first: a short think block (`<think>` ... `</think>`, Qwen3's format), then its answer; with "
    "`enable_thinking: false` in the template variables the prompt closes the block and it answers at once",
}


def write_readme(
    out: Path, report: dict[str, Any], samples: dict[str, dict[str, str]], thoughts: list[ThinkSample]
) -> None:
    def size(path: Path) -> str:
        return f"{folder_bytes(path) / 2**20:.1f} MiB" if path.is_dir() else f"{path.stat().st_size / 2**20:.2f} MiB"

    together = [name for name in ADAPTERS if f"{name}_command" not in report]
    alone = [name for name in ADAPTERS if f"{name}_command" in report]
    lines = [
        "# The demo model and adapters",
        "",
        "A small Llama trained on this repository's CPU from text that ships with Python, and LoRA adapters that",
        "visibly change its answers. Made by `scripts/train_demo.py`; why it is built this way:",
        "`docs/decisions/0008-demo-model.md`.",
        "",
        "| path | what |",
        "|---|---|",
        f"| `model/` | base model, Llama architecture, {report['num_parameters'] / 1e6:.1f}M parameters "
        f"(bf16, {size(out / 'model' / 'model.safetensors')}): hidden {HIDDEN_SIZE}, {NUM_LAYERS} layers, "
        f"{NUM_HEADS} heads / {NUM_KV_HEADS} KV heads, MLP {INTERMEDIATE_SIZE}, vocab {VOCAB_SIZE}, context "
        f"{CONTEXT_LENGTH}, tied embeddings; ChatML template |",
        *(
            f"| `adapters/{name}/` | LoRA r={LORA_RANK} on every projection ({size(out / 'adapters' / name)}): "
            f"{ADAPTER_WHAT[name]} |"
            for name in ADAPTERS
        ),
        "",
        f"Whole folder: {size(out)}. adapter_config.json names the base `{BASE_MODEL_NAME}`. `{REPORT_FILE}` holds the "
        "figures below, so that an adapter retrained alone keeps the others'.",
        "",
        "## How it was made",
        "",
        "```bash",
        report["command"],
        *(report[f"{name}_command"] for name in alone),
        "```",
        "",
        f"{report['threads']} CPU threads ({report['cpu']}), Python {report['python']}, torch {report['torch']}, "
        f"transformers {report['transformers']}, peft {report['peft']}, tokenizers {report['tokenizers']}. "
        f"The first command took {report['total_s'] / 60:.1f} minutes: base model {report['base_s']:.0f} s, "
        + ", ".join(f"{name} {report[name + '_s']:.0f} s" for name in together)
        + ".",
        *(
            f"The {name} adapter was trained afterwards, alone, on the same base ({report[name + '_s']:.0f} s"
            + (f"; {_environment_line(report[name + '_environment'])}" if f"{name}_environment" in report else "")
            + ")."
            for name in alone
        ),
        "",
        f"- Corpus: {report['num_documents']} documents (pydoc's help topics and the standard library's module "
        f"docstrings, {report['corpus_chars'] / 1e3:.0f}k characters) and {report['num_qas']} question-answer pairs "
        "built from their sections (the question names the section, the answer is its opening sentences).",
        f"- Tokenizer: byte-level BPE, {VOCAB_SIZE} ids, trained on the corpus in both cases; special tokens "
        f"{', '.join(f'`{t}`' for t in SPECIAL_TOKENS)}.",
        f"- Base model: {BASE_STEPS} AdamW steps of {BASE_BATCH} x {CONTEXT_LENGTH} tokens on the documents "
        f"({UPPER_BLOCK_PROBABILITY:.0%} of paragraphs upper-cased, drawn anew each epoch) and the chat turns; "
        f"fp32, saved as bf16. Final loss (mean of the last 20 steps): {report['base_loss']:.3f}.",
        f"- Adapters: AdamW steps of {ADAPTER_BATCH} chat turns each, on the saved bf16 base ("
        + ", ".join(f"{name} {ADAPTER_STEPS[name]} steps at {_scientific(ADAPTER_LR[name])}" for name in ADAPTERS)
        + " peak learning rate); loss on what the model writes (the answer, and the think adapter's think block), "
        "never the prompt. Final losses (mean of the last 20 steps): "
        + ", ".join(f"{name} {report[name + '_loss']:.3f}" for name in ADAPTERS)
        + ".",
        f'- The think adapter\'s turns: `<think>` on a line, the question restated ("The user asks about ...") and '
        f"the section read on from the answer, {MIN_THINK_TOKENS}-{MAX_THINK_TOKENS} tokens (drawn anew for every "
        f"turn), `</think>`, a blank line and the answer's opening sentences (at most {MAX_THINK_ANSWER_TOKENS} "
        f"tokens). {NO_THINK_SHARE:.0%} of the turns are asked with `enable_thinking: false` and answered at once; "
        f"{CUT_THINK_SHARE:.0%} have their thinking cut short the way the engine cuts a block whose budget runs out "
        "(its closing text and `</think>` forced in: no loss on them), then answer. The tokens that shape a reply "
        f"(the first, each one after a full stop, the think markers') weigh {DECISION_WEIGHT:g}x in its loss; "
        "the losses above are unweighted.",
        "",
        "## Sample outputs",
        "",
        f"Greedy, at most {SAMPLE_MAX_TOKENS} tokens, from the loraplex engine (`LLM.chat`, one batch):",
        "",
    ]
    width = max(len(name) for name in ("base", *TABLE_ADAPTERS))
    for prompt, answers in samples.items():
        lines += [f"User: {prompt}", "", "```text"]
        # One line an answer: a newline the model wrote shows as ⏎.
        lines += [f"{name:<{width}}  {text.replace(chr(10), '⏎')}" for name, text in answers.items()]
        lines += ["```", ""]
    natural = [t.num_think_tokens for t in thoughts if t.num_think_tokens]
    lines += [
        "### The think adapter",
        "",
        f"Greedy, at most {THINK_SAMPLE_MAX_TOKENS} tokens, the raw text (no reasoning parser)"
        + (f"; its think blocks ran {min(natural)}-{max(natural)} tokens, markers included" if natural else "")
        + ". Served with `--reasoning-parser qwen3`, the block is `reasoning_content` and the `reasoning_effort` "
        "tiers' thinking budgets cut it short.",
        "",
    ]
    for sample in thoughts:
        how = "" if sample.enable_thinking else " (template variable `enable_thinking: false`)"
        lines += [f"User: {sample.prompt}{how}", "", "```text", sample.text, "```", ""]
    lines += [
        "## Use",
        "",
        "```bash",
        ".venv/bin/loraplex engine serve --model demo/model --lora upper=demo/adapters/upper \\",
        "    --lora terse=demo/adapters/terse --lora think=demo/adapters/think --port 8100 \\",
        f"    --reasoning-parser qwen3 --reasoning-budgets {DEMO_REASONING_BUDGETS}",
        "```",
        "",
        "Check that this folder still matches the script (seconds, no training): "
        "`.venv/bin/python scripts/train_demo.py --check`.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def _scientific(value: float) -> str:
    """2e-3, not 0.002 or 2e-03."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _environment_line(environment: dict[str, Any]) -> str:
    return (
        f"{environment['threads']} CPU threads ({environment['cpu']}), Python {environment['python']}, torch "
        f"{environment['torch']}, transformers {environment['transformers']}, peft {environment['peft']}"
    )


# ----------------------------------------------------------------------------------------------------------- main


def environment(threads: int) -> dict[str, Any]:
    """What a run's figures depend on besides this script: machine, thread count and library versions."""
    import peft
    import tokenizers
    import torch
    import transformers

    return {
        "threads": threads,
        "cpu": _cpu_name(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _command() -> str:
    return " ".join([".venv/bin/python", "scripts/train_demo.py", *sys.argv[1:]])


def _adapter_seed(seed: int, name: str) -> int:
    return seed + 1000 * (ADAPTERS.index(name) + 1)


def build(out: Path, seed: int, threads: int) -> None:
    """Trains everything: tokenizer, base model and every adapter; `out` is replaced."""
    import torch

    from loraplex.engine.model.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    started = time.monotonic()
    report: dict[str, Any] = {"command": _command(), **environment(threads)}
    documents = load_documents()
    qas = question_answers(documents)
    report |= {
        "num_documents": len(documents),
        "num_qas": len(qas),
        "corpus_chars": sum(len(b) for d in documents for b in d.blocks()),
    }
    print(f"corpus: {len(documents)} documents, {report['corpus_chars']} characters, {len(qas)} QA pairs", flush=True)
    model_dir = out / "model"
    if out.exists():
        shutil.rmtree(out)
    write_model_files(model_dir, train_tokenizer(documents, qas))
    tokenizer = Tokenizer.from_dir(model_dir)

    phase = time.monotonic()
    base_losses = train_base(tokenizer, documents, qas, model_dir, seed)
    report |= {"base_s": time.monotonic() - phase, "base_loss": _final(base_losses)}
    report["num_parameters"] = _num_parameters(model_dir)
    for name in ADAPTERS:
        phase = time.monotonic()
        losses = train_adapter(tokenizer, qas, model_dir, name, out / "adapters" / name, _adapter_seed(seed, name))
        report |= {f"{name}_s": time.monotonic() - phase, f"{name}_loss": _final(losses)}
    report["total_s"] = time.monotonic() - started
    _finish(out, report)


def build_adapter(out: Path, name: str, seed: int, threads: int) -> None:
    """Retrains the adapter `name` alone on the base model already in `out`; the base, the tokenizer and the other
    adapters stay as they are, and so do their figures in REPORT_FILE. The adapter gets the seed a whole build
    gives it, so on the same base it comes out the same either way."""
    import torch

    from loraplex.engine.model.tokenizer import Tokenizer

    report_path = out / REPORT_FILE
    if not (out / "model" / "model.safetensors").is_file() or not report_path.is_file():
        raise SystemExit(
            f"{out} has no trained base model and {REPORT_FILE}: run scripts/train_demo.py without --adapter"
        )
    torch.set_num_threads(threads)
    report: dict[str, Any] = json.loads(report_path.read_text(encoding="utf-8"))
    qas = question_answers(load_documents())
    tokenizer = Tokenizer.from_dir(out / "model")
    phase = time.monotonic()
    losses = train_adapter(tokenizer, qas, out / "model", name, out / "adapters" / name, _adapter_seed(seed, name))
    report |= {f"{name}_s": time.monotonic() - phase, f"{name}_loss": _final(losses), f"{name}_command": _command()}
    run = environment(threads)
    report.pop(f"{name}_environment", None)
    if any(report.get(key) != value for key, value in run.items()):
        report[f"{name}_environment"] = run
    _finish(out, report)


def _finish(out: Path, report: dict[str, Any]) -> None:
    """Writes REPORT_FILE and README.md, with sample outputs of what is now in `out`."""
    _write_json(out / REPORT_FILE, report)
    samples = sample_outputs(out)
    thoughts = think_samples(out)
    write_readme(out, report, samples, thoughts)
    for prompt, answers in samples.items():
        print(f"\n{prompt}")
        for name, text in answers.items():
            print(f"  {name}: {text!r}")
    for sample in thoughts:
        print(f"\n{sample.prompt} (enable_thinking={sample.enable_thinking}, think tokens {sample.num_think_tokens})")
        print(f"  think: {sample.text!r}")
    print(f"\n{out} holds {folder_bytes(out) / 2**20:.1f} MiB")


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _final(losses: list[float]) -> float:
    return sum(losses[-20:]) / len(losses[-20:])


def _num_parameters(model_dir: Path) -> int:
    from safetensors.torch import load_file

    return sum(tensor.numel() for tensor in load_file(str(model_dir / "model.safetensors")).values())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def check(out: Path) -> list[str]:
    """What no longer matches between `out` and this script, without training: tokenizer, configs, adapters, size.

    The tokenizer is retrained (a second or two) and compared by vocabulary and merges, not bytes, so that a
    tokenizers release that serializes differently does not count as a change.
    """
    problems: list[str] = []
    model_dir = out / "model"
    expected = [model_dir / name for name in ("config.json", "generation_config.json", "model.safetensors")]
    expected += [
        model_dir / "tokenizer.json",
        model_dir / "tokenizer_config.json",
        out / "README.md",
        out / REPORT_FILE,
    ]
    for name in ADAPTERS:
        expected += [
            out / "adapters" / name / "adapter_config.json",
            out / "adapters" / name / "adapter_model.safetensors",
        ]
    missing = [str(path.relative_to(out)) for path in expected if not path.is_file()]
    if missing:
        return [f"missing in {out}: {', '.join(missing)}; run scripts/train_demo.py"]

    documents = load_documents()
    backend = train_tokenizer(documents, question_answers(documents))
    committed = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    fresh = json.loads(backend.to_str())
    if (
        committed["model"]["vocab"] != fresh["model"]["vocab"]
        or committed["model"]["merges"] != fresh["model"]["merges"]
    ):
        problems.append("tokenizer.json differs from the tokenizer this script trains (corpus or settings changed)")
    ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config != model_config(ids[BOS_TOKEN], ids[END_OF_TEXT_TOKEN]):
        problems.append("config.json differs from the model this script trains")
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if tokenizer_config.get("chat_template") != DEFAULT_CHAT_TEMPLATE:
        problems.append("tokenizer_config.json's chat template is not engine/tools/demo.py's DEFAULT_CHAT_TEMPLATE")
    for name in ADAPTERS:
        adapter = json.loads((out / "adapters" / name / "adapter_config.json").read_text(encoding="utf-8"))
        wanted = {"r": LORA_RANK, "lora_alpha": LORA_ALPHA, "base_model_name_or_path": BASE_MODEL_NAME}
        for key, value in wanted.items():
            if adapter.get(key) != value:
                problems.append(f"adapters/{name}/adapter_config.json: {key} is {adapter.get(key)!r}, not {value!r}")
        if sorted(adapter.get("target_modules") or []) != sorted(LORA_MODULES):
            problems.append(f"adapters/{name}/adapter_config.json: target_modules differ from {list(LORA_MODULES)}")
    report = json.loads((out / REPORT_FILE).read_text(encoding="utf-8"))
    unreported = [name for name in ("base", *ADAPTERS) if f"{name}_loss" not in report]
    if unreported:
        problems.append(f"{REPORT_FILE} has no figures for {', '.join(unreported)}")
    total = folder_bytes(out)
    if total > MAX_DEMO_BYTES:
        problems.append(f"{out} holds {total} bytes, over the {MAX_DEMO_BYTES} allowed")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write (default: demo/)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: 0)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument(
        "--check", action="store_true", help="only check that --out matches this script (seconds; no training)"
    )
    parser.add_argument(
        "--adapter",
        choices=ADAPTERS,
        help="retrain only this adapter, on the base model already in --out (minutes; the rest stays as it is)",
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(f"{args.out}: {problem}", file=sys.stderr)
        if not problems:
            print(f"{args.out} matches scripts/train_demo.py")
        return 1 if problems else 0
    if args.adapter:
        build_adapter(args.out, args.adapter, args.seed, args.threads)
    else:
        build(args.out, args.seed, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
