"""Instruction and code prompts for distilling the drafter.

Hand-written templates crossed with subjects (no data set download). The
held-out split (services.models.prompts) crosses the same templates with
subjects that never appear here, so acceptance measured on it is not
memorisation.
"""

from __future__ import annotations

import random

from services.models.prompts import CODE_TEMPLATES, TOPIC_TEMPLATES

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "merges two sorted lists", "removes duplicates from a list",
    "counts the vowels in a string", "finds the maximum value in a list", "checks whether a string is a palindrome",
    "flattens a nested list", "computes the greatest common divisor of two numbers", "sorts a list with bubble sort",
    "implements binary search", "converts Celsius to Fahrenheit", "reads a CSV file and returns its rows",
    "counts word frequencies in a text", "validates an email address", "transposes a matrix",
    "computes the average of a list of numbers", "finds the second largest element of a list",
    "checks whether two strings are anagrams", "generates all permutations of a list", "converts a decimal number to binary",
    "sums the digits of an integer", "finds the longest word in a sentence", "capitalizes every word in a sentence",
    "implements a stack class", "implements a queue using two stacks", "computes the dot product of two vectors",
    "checks whether a year is a leap year", "returns the prime factors of a number", "rotates a list by k positions",
    "finds the intersection of two lists", "counts the lines in a file", "parses a JSON string into a dictionary",
    "computes the power set of a set", "implements insertion sort", "finds the median of a list",
    "reverses the words in a sentence", "checks whether parentheses are balanced",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Java", "Go", "Rust"]
TOPICS = [
    "photosynthesis", "the water cycle", "gravity", "the French Revolution", "machine learning", "climate change",
    "the immune system", "black holes", "the stock market", "democracy", "plate tectonics", "the internet",
    "vaccines", "renewable energy", "the human heart", "inflation", "the Roman Empire", "DNA", "volcanoes",
    "electricity", "the moon landing", "recycling", "sleep", "meditation", "the printing press", "bees",
    "rainbows", "earthquakes", "the solar system", "nutrition", "exercise", "time management", "public speaking",
    "learning a new language", "saving money", "cloud computing", "databases", "encryption", "operating systems",
    "the theory of evolution",
]


def _code_prompts(tasks: list[str]) -> list[str]:
    return [t.format(lang=lang, task=task) for task in tasks for t in CODE_TEMPLATES for lang in LANGUAGES[:1]] + [
        CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(lang=lang, task=task)
        for i, (task, lang) in enumerate((task, lang) for task in tasks for lang in LANGUAGES[3:])
    ]


def _topic_prompts(topics: list[str]) -> list[str]:
    return [t.format(topic=topic) for topic in topics for t in TOPIC_TEMPLATES]


def train_prompts(seed: int = 0) -> list[str]:
    """Distillation prompts, shuffled with ``seed``."""
    prompts = _code_prompts(CODE_TASKS) + _topic_prompts(TOPICS)
    random.Random(seed).shuffle(prompts)
    return prompts
