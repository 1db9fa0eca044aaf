"""The benchmark's fixed prompt set, in eight categories (CATEGORIES): chat, code, summary, edit (rewrite a given
paragraph, function or email with a small change), extraction (verbatim quotes or a table of values from a
passage), rag (answer from about 1.6k tokens of retrieved documents), multi_turn (a conversation whose last turn
refers to the earlier ones) and structured (a JSON object of given fields). All written for this project
(specdec/eval_passages.py holds their texts); nothing is downloaded. The benchmark (bench/) measures on it; the
offline tools (offline/datastore_build.py) keep it out of what they build from, so it lives here, below both.

Every configuration gets exactly these prompts, turned into token ids once by :func:`encode` (the same
chat template the orchestrator applies for ``apply_chat_template=True``; a multi-turn prompt's history as the
earlier messages), so the services and the in-process anchors decode from identical inputs. The set is fixed;
``--quick`` takes a prefix of :func:`select`'s round-robin order (one prompt of each category first), never a
hand-picked subset.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from specdec import eval_passages as P


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str  # one of CATEGORIES
    text: str  # the last user message
    history: tuple[dict, ...] = ()  # earlier chat messages (multi_turn), {"role", "content"}

    def messages(self) -> list[dict]:
        return [*self.history, {"role": "user", "content": self.text}]


CATEGORIES = ("chat", "code", "summary", "edit", "extraction", "rag", "multi_turn", "structured")


def _turns(*texts: str) -> tuple[dict, ...]:
    """Earlier chat messages, alternating user and assistant, the user's first."""
    return tuple({"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(texts))


_TALLY_HISTORY = _turns(
    "What is new in this release?\n\n" + P.RELEASE,
    "Version 4.2 of Tally adds bank imports in the CSV format used by most European banks, a dark theme, and a "
    "yearly report that groups expenses by category. It also fixes a rounding bug in currency amounts and a bug that "
    "lost unsaved notes when the app was closed.",
)
_TRIP_HISTORY = _turns(
    "I am planning a weekend on the coast. How do the trains work?\n\n" + P.TRAIN,
    "Trains on the coast line run every thirty minutes between 6 am and 10 pm and every hour after that until "
    "midnight. A single ticket costs 3.40 euros and a day ticket 8 euros, and children under twelve travel free with "
    "an adult.",
    "Can I take my bike?",
    "Yes, bicycles are allowed on all trains except those arriving in the city between 7.30 and 9 am.",
)
_BAKERY_HISTORY = _turns(
    "Tell me about this bakery.\n\n" + P.BAKERY,
    "The Corner Loaf was opened in 1998 by the brothers Tomas and Luis Ferrer. They bake about six hundred loaves a "
    "day in a wood-fired oven, and their best seller is a rye sourdough. Since 2021 they deliver by cargo bike, and "
    "they close for the whole of August.",
)

PROMPTS: list[Prompt] = [
    Prompt("chat-tea", "chat", "What are three good reasons to drink green tea? Answer briefly."),
    Prompt("code-prime", "code", "Write a Python function that checks whether a number is prime, with a docstring."),
    Prompt("summary-lighthouse", "summary",
           "Summarise the following passage in two sentences.\n\n" + P.LIGHTHOUSE),
    Prompt("edit-function", "edit",
           "Rename the variable `total` to `amount` in this Python function. Reply with the whole function and "
           "change nothing else.\n\n" + P.FUNCTION_INVOICE),
    Prompt("extraction-quotes", "extraction",
           "Quote word for word every sentence of this passage that contains a number.\n\n" + P.VOLCANO),
    Prompt("rag-bridge", "rag",
           "Answer the question using only the documents below, and quote the sentence that supports your answer."
           "\n\n" + P.retrieved_context(list(range(len(P.DOCUMENTS))))
           + "\n\nQuestion: How long will the Alder Street footbridge be closed, and which crossing should "
             "pedestrians use instead?"),
    Prompt("multi-turn-tally", "multi_turn",
           "Repeat your answer as a bulleted list, one bullet for each change you mentioned.",
           history=_TALLY_HISTORY),
    Prompt("structured-contact", "structured",
           "Return a JSON object with the fields name, age, city, job, email, phone and plan, taken from this "
           "note. Reply with the JSON only.\n\n" + P.CONTACT_NOTE),
    Prompt("chat-interview", "chat", "Give me some tips for preparing for a job interview."),
    Prompt("code-reverse", "code",
           "Write a Python function that reverses the words in a sentence, and show an example of calling it."),
    Prompt("summary-batteries", "summary",
           "Summarise this text for a ten-year-old.\n\n" + P.BATTERIES),
    Prompt("edit-paragraph", "edit",
           "Rewrite this paragraph with 'Skerry Point' replaced by 'Gull Rock'. Keep every other word the same."
           "\n\n" + P.LIGHTHOUSE),
    Prompt("extraction-table", "extraction",
           "Make a Markdown table of the action items in these minutes, with the columns Person, Task and Date, "
           "using the words of the minutes.\n\n" + P.MEETING),
    Prompt("rag-library", "rag",
           "Use the documents below to answer the question. Quote the relevant sentences first, then answer.\n\n"
           + P.retrieved_context([5, 10, 2, 8, 0, 6, 3, 9, 1, 7, 4])
           + "\n\nQuestion: When is the central library open on Saturdays, and what do late returns cost?"),
    Prompt("multi-turn-trip", "multi_turn",
           "Thanks. Now write all of that as one short note I can send to my friend, keeping the times and prices.",
           history=_TRIP_HISTORY),
    Prompt("structured-book", "structured",
           "Convert this catalogue note into a JSON object with the keys title, author, publisher, year, pages, "
           "format, isbn, subjects and loans.\n\n" + P.BOOK_NOTE),
    Prompt("chat-photosynthesis", "chat", "Explain how photosynthesis works in simple terms."),
    Prompt("code-fizzbuzz", "code", "Write a JavaScript function that prints FizzBuzz for the numbers 1 to 100."),
    Prompt("summary-meeting", "summary",
           "List the decisions and action items in these meeting minutes.\n\n" + P.MEETING),
    Prompt("edit-email", "edit",
           "Correct the spelling mistakes in this email and reply with the corrected email only.\n\n" + P.EMAIL),
    Prompt("extraction-release", "extraction",
           "List, quoting the release notes exactly, every change in version 4.2 that a user must act on.\n\n"
           + P.RELEASE),
    Prompt("multi-turn-bakery", "multi_turn",
           "Write that again, but in the past tense, as if the bakery had closed last year.",
           history=_BAKERY_HISTORY),
    Prompt("chat-paris", "chat", "I have one day in Paris. What should I see?"),
    Prompt("code-sql", "code",
           "Write an SQL query that returns the five customers with the highest total order value from tables "
           "customers(id, name) and orders(id, customer_id, amount)."),
    Prompt("summary-sleep", "summary", "Summarise the main finding of this study.\n\n" + P.SLEEP),
    Prompt("edit-words", "edit",
           "Add a parameter `min_length=1` to this function so that it skips words shorter than min_length. Reply "
           "with the whole function.\n\n" + P.FUNCTION_WORDS),
]


def select(n: int | None = None) -> list[Prompt]:
    """The first ``n`` prompts in round-robin order over the categories (chat, code, summary, edit, ..., chat,
    ...), so any n >= len(CATEGORIES) covers every category."""
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
        return _tiny_ids(" ".join(m["content"] for m in prompt.messages()), tiny_vocab)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(prompt.messages(),
                                            add_generation_prompt=True, tokenize=True)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
    text = "\n\n".join(m["content"] for m in prompt.messages())
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=True)]
