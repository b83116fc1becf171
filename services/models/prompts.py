"""The prompt sets the drafters are measured on (``splitspec bench``, the GPU checks, the tests).

Held-out: the templates the first drafter was distilled on (services.training.prompts) over subjects that never
appear in any training prompt (services.training.prompt_bank.check_disjoint proves it), so acceptance measured on
them is not memorisation. Everyday: hand-written requests of the kinds where the first drafter did worst (emails,
explanations, stories, summaries, SQL, pandas). Spec-Bench's questions are in ``specbench``.
"""

from __future__ import annotations

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}. Include a short docstring.",
    "Implement a function in {lang} that {task}, and explain how it works.",
    "Can you show me {lang} code that {task}?",
    "I need a {lang} function that {task}. Please add comments.",
    "Write a {lang} program that {task} and prints the result.",
    "How would you write a function that {task} in {lang}?",
    "Give an example of {lang} code that {task}, with a test case.",
]
HELD_OUT_CODE_TASKS = [
    "computes the least common multiple of two numbers", "implements merge sort", "counts the uppercase letters in a string",
    "returns the n largest elements of a list", "checks whether a list is sorted", "computes the running sum of a list",
    "converts a Roman numeral to an integer", "finds the most common element of a list",
]
TOPIC_TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What is {topic}?",
    "Give me three interesting facts about {topic}.",
    "Write a short paragraph about {topic}.",
    "Why is {topic} important?",
    "Explain {topic} to a ten-year-old.",
    "What are the main ideas behind {topic}?",
    "Write a short poem about {topic}.",
    "Summarize the history of {topic} in a few sentences.",
    "What are common misconceptions about {topic}?",
]
HELD_OUT_TOPICS = ["ocean tides", "the Great Wall of China", "antibiotics", "compound interest", "glaciers", "chess", "coffee", "hurricanes"]
EVERYDAY = [
    "Write an email to my team saying the office will be closed on Friday for maintenance.",
    "Write a short thank-you note to my aunt for the birthday present, a wool scarf.",
    "Explain how a refrigerator keeps food cold.",
    "Explain what an index fund is and why people recommend it.",
    "Write a short story about a mailman who delivers letters to the moon.",
    "Tell me a story about a lost umbrella that travels around the world.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Summarize this: The city council voted on Tuesday to expand the bike lane network by 40 kilometres over the next "
    "three years. Supporters say it will reduce traffic and pollution, while some shop owners worry about losing parking.",
    "Write a SQL query that returns the total amount spent by each customer in 2023, highest first.",
    "Write a SQL query to find all orders that have no matching shipment.",
    "How do I read an Excel file with pandas and keep only the rows where the status column is 'open'?",
    "In pandas, how do I count how many times each value appears in the 'city' column and plot it as a bar chart?",
    "Give me a packing list for a weekend trip to the mountains.",
    "Rewrite this to sound friendlier: Your request has been denied due to policy.",
    "What should I cook for dinner tonight with eggs, spinach and cheese?",
    "Write a Python script that renames all .txt files in a folder to .md.",
]


def held_out_prompts() -> list[str]:
    """Prompts on subjects absent from training, alternating code and prose."""
    code = [CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(lang="Python", task=t) for i, t in enumerate(HELD_OUT_CODE_TASKS)]
    prose = [TOPIC_TEMPLATES[i % len(TOPIC_TEMPLATES)].format(topic=t) for i, t in enumerate(HELD_OUT_TOPICS)]
    return [p for pair in zip(code, prose) for p in pair]


def everyday_prompts() -> list[tuple[str, str]]:
    return [("everyday", p) for p in EVERYDAY]
