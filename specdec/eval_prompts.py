"""The fixed evaluation prompt set: chat, code, and summarising a given passage. The benchmark (bench/) measures
on it; the offline tools (offline/datastore_build.py) keep it out of what they build from, so it lives here, below both.

Every configuration gets exactly these prompts, turned into token ids once by :func:`encode` (the same
chat template the orchestrator applies for ``apply_chat_template=True``), so the services and the
in-process Hugging Face anchors decode from identical inputs. The set is fixed; ``--quick`` takes a
prefix of :func:`select`'s round-robin order (one prompt of each kind first), never a hand-picked subset.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str  # chat | code | summary
    text: str


_PASSAGE_LIGHTHOUSE = (
    "The lighthouse on Skerry Point was built in 1872 after three ships were lost on the reef in a single "
    "winter. Its first keeper, Margaret Dunn, kept the lamp burning for thirty-one years, trimming the wick "
    "every four hours and writing the weather into a leather logbook that still survives. In 1931 the oil "
    "lamp was replaced by an electric light, and in 1987 the station was automated, so no keeper has lived "
    "there since. Today the cottage is a small museum, and the logbook is displayed in a glass case beside "
    "the original brass lens."
)

_PASSAGE_BATTERIES = (
    "Lithium-ion batteries age in two ways. Calendar ageing happens even when a battery sits unused: a thin "
    "layer called the solid electrolyte interphase slowly grows on the anode and consumes lithium, and it "
    "grows faster when the battery is stored hot or fully charged. Cycle ageing comes from use: every charge "
    "and discharge makes the electrode materials swell and shrink, which cracks particles and loosens their "
    "contact with the current collector. Manufacturers therefore recommend storing devices half charged in "
    "a cool place, and avoiding fast charging when the battery is already warm."
)

_PASSAGE_MEETING = (
    "Minutes of the garden committee, 4 March. Present: Ana, Bilal, Chen and Dora. The committee agreed to "
    "replace the broken water tank before the end of April; Bilal will collect three quotes. The spring plant "
    "sale will be held on 12 May, with Dora coordinating volunteers and Chen designing the poster. Ana "
    "reported that membership fees cover only two thirds of this year's costs, so the committee will apply "
    "for a small grant from the city council. The next meeting is on 1 April."
)

_PASSAGE_SLEEP = (
    "Researchers followed 2,000 adults for six years and recorded how long they slept each night. Those who "
    "regularly slept fewer than six hours were more likely to develop high blood pressure than those who slept "
    "seven to eight hours, even after accounting for age, weight and exercise. Sleeping more than nine hours "
    "was not protective either. The authors caution that the study shows an association rather than cause "
    "and effect, and they call for trials that extend sleep in short sleepers to test whether blood pressure "
    "falls."
)

PROMPTS: list[Prompt] = [
    Prompt("chat-tea", "chat", "What are three good reasons to drink green tea? Answer briefly."),
    Prompt("code-prime", "code", "Write a Python function that checks whether a number is prime, with a docstring."),
    Prompt("summary-lighthouse", "summary",
           "Summarise the following passage in two sentences.\n\n" + _PASSAGE_LIGHTHOUSE),
    Prompt("chat-interview", "chat", "Give me some tips for preparing for a job interview."),
    Prompt("code-reverse", "code",
           "Write a Python function that reverses the words in a sentence, and show an example of calling it."),
    Prompt("summary-batteries", "summary",
           "Summarise this text for a ten-year-old.\n\n" + _PASSAGE_BATTERIES),
    Prompt("chat-photosynthesis", "chat", "Explain how photosynthesis works in simple terms."),
    Prompt("code-fizzbuzz", "code", "Write a JavaScript function that prints FizzBuzz for the numbers 1 to 100."),
    Prompt("summary-meeting", "summary",
           "List the decisions and action items in these meeting minutes.\n\n" + _PASSAGE_MEETING),
    Prompt("chat-paris", "chat", "I have one day in Paris. What should I see?"),
    Prompt("code-sql", "code",
           "Write an SQL query that returns the five customers with the highest total order value from tables "
           "customers(id, name) and orders(id, customer_id, amount)."),
    Prompt("summary-sleep", "summary", "Summarise the main finding of this study.\n\n" + _PASSAGE_SLEEP),
]


def select(n: int | None = None) -> list[Prompt]:
    """The first ``n`` prompts in round-robin order over kinds (chat, code, summary, chat, ...)."""
    kinds: dict[str, list[Prompt]] = {}
    for p in PROMPTS:
        kinds.setdefault(p.kind, []).append(p)
    order: list[Prompt] = []
    i = 0
    while len(order) < len(PROMPTS):
        for group in kinds.values():
            if i < len(group):
                order.append(group[i])
        i += 1
    return order if n is None else order[: max(1, n)]


def _tiny_ids(text: str, vocab: int) -> list[int]:
    # The tiny test models' WordLevel tokenizer knows only "t1".."t{vocab-1}"; hash words into that
    # range (never the eos id 0) so a prompt is a varied, deterministic token sequence.
    return [1 + zlib.crc32(w.encode()) % (vocab - 1) for w in text.split()][:48]


def encode(prompt: Prompt, tokenizer, chat: bool = True, tiny_vocab: int | None = None) -> list[int]:
    """Token ids exactly as the orchestrator builds them for a text prompt with ``apply_chat_template``."""
    if tiny_vocab:
        return _tiny_ids(prompt.text, tiny_vocab)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                            add_generation_prompt=True, tokenize=True)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
    return [int(t) for t in tokenizer.encode(prompt.text, add_special_tokens=True)]
