"""A broad prompt mix for distilling drafters: crossed templates per kind of request.

Kinds follow what users ask an assistant: code (incl. SQL, pandas, shell),
explanations, lists, writing (emails, stories, poems), rewriting, Q&A,
comparisons and advice. Summaries, rewrites of longer text and multi-turn
chats need a passage or a first answer; ``selfinstruct`` builds those from
the target's own answers. Every kind has training subjects and held-out
subjects that never appear in training (``check_disjoint`` proves it). The
sets the drafters are measured on, held-out and everyday, are runtime's:
services.models.prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from services.models import prompts as measured
from services.training import prompts as base


@dataclass(frozen=True)
class Kind:
    name: str
    templates: list[str]
    train: list[str]  # subjects
    held_out: list[str]


CODE_TASKS = base.CODE_TASKS + [
    "parses a date string into year, month and day", "computes the Levenshtein distance of two strings",
    "finds all pairs in a list that sum to a target", "implements a linked list with insert and delete",
    "checks whether a binary tree is balanced", "computes the mode of a list", "chunks a list into pieces of size n",
    "converts a string to title case", "shuffles a list in place", "computes the moving average of a list",
    "removes whitespace from both ends of every line of a file", "counts the characters in a string",
    "computes the area of a circle", "merges two dictionaries", "finds the first non-repeating character in a string",
    "implements quicksort", "downloads a web page and counts its links", "generates a random password",
    "computes the simple interest on a loan", "checks whether a number is a perfect square",
    "implements an LRU cache", "converts a list of dictionaries to a CSV file", "finds the longest common prefix of strings",
    "computes the sum of squares from 1 to n", "validates a phone number", "splits a sentence into words",
    "implements a simple calculator", "computes the Hamming distance of two strings", "finds the missing number in 1..n",
    "reverses a linked list", "implements depth-first search on a graph", "implements breadth-first search on a graph",
    "computes the nth triangular number", "zips two lists into a dictionary", "groups words by their first letter",
    "checks whether a string contains only digits", "converts hours and minutes to seconds",
]
HELD_OUT_CODE = measured.HELD_OUT_CODE_TASKS + [
    "computes the Jaccard similarity of two sets", "implements a min-heap", "finds the longest increasing subsequence",
    "converts snake_case to camelCase",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "TypeScript", "C", "C++", "Java", "Go", "Rust", "Bash"]
CODE = Kind("code", measured.CODE_TEMPLATES + [
    "Write a {lang} function that {s}. Keep it short.",
    "Show me how to write code that {s} in {lang}, then explain the time complexity.",
    "Write a {lang} snippet that {s}, with example input and output.",
    "Fix and improve this plan: I want a {lang} function that {s}. What is the cleanest way?",
], CODE_TASKS, HELD_OUT_CODE)

SQL_TASKS = [
    "selects all customers from Germany", "counts orders per customer", "finds the ten most expensive products",
    "joins orders with customers and shows the customer name", "finds employees earning more than their manager",
    "deletes rows older than one year", "updates the price of a product", "creates a table for blog posts",
    "computes the average salary per department", "finds duplicate email addresses", "lists products never ordered",
    "computes monthly revenue", "finds the second highest salary", "adds an index on the email column",
    "selects users who signed up last week", "counts distinct cities of customers",
]
HELD_OUT_SQL = ["finds the top three students per class by grade", "computes the running total of sales per day",
                "lists authors with more than five books"]
SQL = Kind("sql", [
    "Write a SQL query that {s}.",
    "How do I write a SQL query that {s}?",
    "Write an SQL statement that {s} and explain each clause.",
    "Give me a PostgreSQL query that {s}.",
], SQL_TASKS, HELD_OUT_SQL)

PANDAS_TASKS = [
    "reads a CSV file into a DataFrame", "drops rows with missing values", "groups rows by a column and sums another",
    "merges two DataFrames on a key", "sorts a DataFrame by two columns", "renames columns",
    "filters rows where a column is greater than 100", "converts a column to datetime", "computes a pivot table",
    "adds a new column computed from two others", "removes duplicate rows", "computes the correlation matrix",
    "fills missing values with the column mean", "counts the values of a column", "selects columns by name",
    "resamples a time series to monthly frequency",
]
HELD_OUT_PANDAS = ["computes a rolling 7-day mean per store", "melts a wide table into long format",
                   "bins ages into ranges with cut"]
PANDAS = Kind("pandas", [
    "How do I use pandas to write code that {s}?",
    "Write pandas code that {s}.",
    "Show a short pandas example that {s}.",
], PANDAS_TASKS, HELD_OUT_PANDAS)

TOPICS = base.TOPICS + [
    "neural networks", "quantum computing", "the Industrial Revolution", "supply and demand", "the placebo effect",
    "photosynthesis in algae", "blockchain", "the greenhouse effect", "the nervous system", "interest rates",
    "the Renaissance", "artificial intelligence", "solar panels", "the carbon cycle", "viruses", "the human brain",
    "electric cars", "3D printing", "the Olympic Games", "ancient Egypt", "the scientific method", "gene editing",
    "social media", "nuclear power", "the speed of light", "magnetism", "memory", "habits", "procrastination",
    "stress", "teamwork", "leadership", "budgeting", "credit scores", "version control", "APIs", "recursion",
    "object-oriented programming", "unit testing", "computer networks", "the Cold War", "World War I",
    "the Silk Road", "the Amazon rainforest", "coral reefs", "deserts", "migration of birds", "honey",
    "bread baking", "fermentation", "the metric system", "probability", "statistics", "calculus", "prime numbers",
]
HELD_OUT_TOPICS = measured.HELD_OUT_TOPICS + ["volcanic islands", "jazz", "the Byzantine Empire", "tea ceremonies"]
EXPLAIN = Kind("explain", measured.TOPIC_TEMPLATES + [
    "How does {s} work?",
    "Can you explain {s} step by step?",
    "I don't understand {s}. Can you help?",
    "Describe {s} in one paragraph for a beginner.",
    "What should everyone know about {s}?",
    "Write a short blog post introduction about {s}.",
    "Give an analogy that explains {s}.",
], TOPICS, HELD_OUT_TOPICS)

ACTIVITIES = [
    "studying for exams", "staying productive at home", "learning to cook", "running a marathon", "starting a garden",
    "writing a resume", "preparing for a job interview", "traveling on a budget", "sleeping better", "making friends",
    "learning to code", "reducing stress", "saving for retirement", "moving to a new city", "raising a puppy",
    "keeping houseplants alive", "giving feedback to a colleague", "planning a wedding", "eating healthier",
    "learning the guitar", "organizing a closet", "hosting a dinner party", "writing a novel", "taking better photos",
    "starting a small business", "managing a remote team", "reading more books", "camping for the first time",
]
HELD_OUT_ACTIVITIES = ["learning to surf", "brewing beer at home", "restoring old furniture", "training for a triathlon"]
LISTS = Kind("lists", [
    "List five tips for {s}.",
    "What are the most important things to know about {s}?",
    "Give me a checklist for {s}.",
    "What are common mistakes people make when {s}?",
    "Make a step-by-step plan for {s}.",
    "What are the pros and cons of {s}?",
], ACTIVITIES, HELD_OUT_ACTIVITIES)

EMAIL_MATTERS = [
    "asking my manager for a day off", "thanking a colleague for their help", "following up after a job interview",
    "declining a meeting invitation", "asking a professor for a recommendation letter", "complaining about a late delivery",
    "inviting the team to a lunch", "announcing a new product feature", "apologizing for a missed deadline",
    "requesting a refund", "introducing myself to a new client", "asking for a deadline extension",
    "resigning from my job", "welcoming a new employee", "reminding a customer about an unpaid invoice",
    "rescheduling a doctor's appointment", "asking a landlord to fix the heating", "congratulating a friend on a promotion",
]
HELD_OUT_EMAIL = ["asking my neighbour to keep the noise down", "proposing a four-day work week to HR",
                  "cancelling a gym membership"]
EMAIL = Kind("email", [
    "Write an email {s}.",
    "Draft a short, polite email {s}.",
    "Write a professional email {s}. Keep it under 150 words.",
    "Help me write a friendly message {s}.",
], EMAIL_MATTERS, HELD_OUT_EMAIL)

CHARACTERS = [
    "a robot who learns to paint", "a girl who finds a map in the attic", "a dragon afraid of fire",
    "an old fisherman and a talking fish", "a detective in a city of cats", "a astronaut stranded on Mars",
    "a baker who bakes magic bread", "two friends lost in a forest", "a time traveler stuck in 1920",
    "a dog who wants to be a firefighter", "a shy student who joins a band", "a lighthouse keeper during a storm",
    "a king who loses his crown", "a tree that can walk", "a programmer whose code comes alive",
    "a penguin who moves to the desert", "a librarian who discovers a secret door", "a knight who hates swords",
]
HELD_OUT_CHARACTERS = ["a clockmaker who can pause time", "a whale who sings opera", "a farmer who grows glass"]
STORY = Kind("story", [
    "Write a short story about {s}.",
    "Tell me a bedtime story about {s}.",
    "Write the opening paragraph of a novel about {s}.",
    "Write a funny story about {s} in under 200 words.",
    "Write a poem about {s}.",
], CHARACTERS, HELD_OUT_CHARACTERS)

SENTENCES = [
    "me and him goes to the store yesterday and buyed some apple", "The meeting was moved because of the reasons we discussed.",
    "Our product is very good and you should buy it because it is good.", "i cant come tomorow im sick sorry",
    "The results of the experiment was not what we expected at all.", "We need to talk about the budget, it is too high.",
    "The weather today is nice and sunny and warm and pleasant.", "He don't know nothing about computers.",
    "Please send me the report as soon as possible, thanks.", "The new policy will affect all employees starting next month.",
    "This app helps people track their spending and save money.", "Their going to the park later to play football.",
    "The cat sat on the mat and looked at the bird outside.", "I think that maybe we could possibly consider changing the plan.",
    "Climate change is a big problem that affects everyone on the planet.", "The software update fixed several bugs and improved speed.",
]
HELD_OUT_SENTENCES = ["the train were late so i miss the first part of the concert",
                      "Our quarterly numbers went up a lot which is great news for the whole team."]
REWRITE = Kind("rewrite", [
    "Rewrite this sentence to be more formal: {s}",
    "Fix the grammar in this sentence: {s}",
    "Paraphrase the following sentence: {s}",
    "Make this sentence more concise: {s}",
    "Translate this sentence into French: {s}",
    "Rewrite this sentence for a ten-year-old: {s}",
], SENTENCES, HELD_OUT_SENTENCES)

QA_SUBJECTS = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Australia", "Mexico", "Italy", "Kenya", "Norway", "Peru",
]
HELD_OUT_QA = ["Portugal", "Vietnam", "Chile"]
QA = Kind("qa", [
    "What is the capital of {s}?",
    "Tell me about the history of {s}.",
    "What is the population of {s}, roughly?",
    "What language do people speak in {s}?",
    "What are famous foods from {s}?",
    "What should a tourist visit in {s}?",
], QA_SUBJECTS, HELD_OUT_QA)

PAIRS = [
    "a list and a tuple in Python", "weather and climate", "a virus and a bacterium", "RAM and storage",
    "stocks and bonds", "TCP and UDP", "SQL and NoSQL databases", "a crocodile and an alligator",
    "machine learning and deep learning", "affect and effect", "speed and velocity", "a CPU and a GPU",
    "HTTP and HTTPS", "mitosis and meiosis", "a democracy and a republic", "renting and buying a house",
]
HELD_OUT_PAIRS = ["baking soda and baking powder", "a violin and a viola", "git merge and git rebase"]
COMPARE = Kind("compare", [
    "What is the difference between {s}?",
    "Compare {s}.",
    "Explain the difference between {s} with an example.",
], PAIRS, HELD_OUT_PAIRS)

KINDS = [CODE, SQL, PANDAS, EXPLAIN, LISTS, EMAIL, STORY, REWRITE, QA, COMPARE]



def _cross(kind: Kind, subjects: list[str], rng: random.Random, per_subject: int) -> list[str]:
    out = []
    for subject in subjects:
        for template in rng.sample(kind.templates, min(per_subject, len(kind.templates))):
            lang = rng.choice(LANGUAGES)
            out.append(template.format(s=subject, task=subject, topic=subject, lang=lang))
    return out


def crossed_prompts(seed: int = 0, per_subject: int = 6) -> list[tuple[str, str]]:
    """(kind, prompt) pairs over the training subjects, shuffled with ``seed``."""
    rng = random.Random(seed)
    pairs = [(kind.name, p) for kind in KINDS for p in _cross(kind, kind.train, rng, per_subject)]
    pairs = list(dict.fromkeys(pairs))
    rng.shuffle(pairs)
    return pairs


def held_out_prompts(seed: int = 0) -> list[tuple[str, str]]:
    """(kind, prompt) pairs on held-out subjects: two templates per subject."""
    rng = random.Random(seed + 1)
    return [(kind.name, p) for kind in KINDS for p in _cross(kind, kind.held_out, rng, 2)]


def held_out_subjects() -> list[str]:
    return [s for kind in KINDS for s in kind.held_out]


def mentions_held_out(text: str) -> bool:
    """True when ``text`` names a held-out subject (used to filter self-instruct prompts)."""
    low = text.lower()
    return any(s.lower() in low for s in held_out_subjects())


def check_disjoint(train: list[str]) -> None:
    """Raise if a training prompt names a held-out subject."""
    leaks = [p for p in train if mentions_held_out(p)]
    if leaks:
        raise ValueError(f"{len(leaks)} training prompts name held-out subjects, e.g. {leaks[0]!r}")
