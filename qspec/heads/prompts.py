"""Instruction prompts of the kinds chat assistants are asked, for a head's training answers.

Eight kinds (writing, role-play, reasoning, math, coding, extraction, science and technology,
humanities), each a set of templates whose slots are filled from the lists below, from numbers drawn
at random and from the text of the ``chitchat-dataset`` dialogues (:mod:`qspec.heads.data`). The
templates are written for qspec; MT-bench, the evaluation set, is not read here.
"""

from __future__ import annotations

import random
from collections.abc import Callable

FORMS = (
    "blog post", "short story", "poem", "speech", "product description", "cover letter", "diary entry",
    "limerick", "news report", "review", "letter", "dialogue", "travel guide", "advertisement", "fable",
)  # fmt: skip
TONES = ("funny", "formal", "heartfelt", "persuasive", "concise", "optimistic", "dramatic", "friendly")
AUDIENCES = ("children", "a company newsletter", "a science magazine", "teenagers", "a local newspaper", "retirees")
ROLES = (
    "pirate", "chef", "detective", "tour guide", "doctor", "teacher", "astronaut", "medieval knight",
    "customer support agent", "personal trainer", "financial advisor", "poet", "lawyer", "park ranger",
    "museum curator", "startup founder", "sports coach", "librarian", "travel agent", "mechanic",
)  # fmt: skip
SITUATIONS = (
    "wants to change careers", "cannot sleep well", "is nervous about a job interview", "wants to save money",
    "is learning a new language", "is planning a wedding", "just moved to a new city", "wants to get fit",
    "has a difficult coworker", "is starting a small business", "wants to read more books",
)  # fmt: skip
TASKS = (
    "reverses the words of a sentence", "checks whether a number is prime", "merges two sorted lists",
    "counts how often each word appears in a text", "returns the n-th Fibonacci number",
    "removes duplicates from a list and keeps the order", "flattens a nested list", "finds the median of a list",
    "validates an email address with a regular expression", "performs binary search on a sorted list",
    "converts Celsius to Fahrenheit", "finds the longest common prefix of a list of strings",
    "checks whether a string is a palindrome", "computes the greatest common divisor of two numbers",
    "reads a CSV file and prints the average of a column", "groups a list of words by their first letter",
    "rotates a matrix by 90 degrees", "finds the two numbers in a list that add up to a target",
    "implements a stack with push and pop", "counts the vowels in a string",
    "sorts a list of tuples by the second item",
    "returns the k largest elements of a list", "checks whether two strings are anagrams",
    "converts a Roman numeral to an integer", "computes the factorial of a number recursively",
)  # fmt: skip
LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust", "Bash")
STEM = (
    "photosynthesis", "vaccines", "black holes", "the water cycle", "electric motors", "DNA replication",
    "neural networks", "plate tectonics", "quantum entanglement", "blockchains", "GPS", "the greenhouse effect",
    "compound interest", "antibiotics", "semiconductors", "nuclear fusion", "the immune system", "rainbows",
    "public key cryptography", "batteries", "earthquakes", "the human heart", "solar panels", "evolution",
    "inflation", "supply and demand", "machine learning", "the internet", "airplane wings", "tides",
)  # fmt: skip
PAIRS = (
    ("weather", "climate"), ("viruses", "bacteria"), ("speed", "velocity"), ("memory", "storage"),
    ("mitosis", "meiosis"), ("a comet", "an asteroid"), ("stocks", "bonds"), ("AC", "DC"),
    ("a compiler", "an interpreter"), ("TCP", "UDP"), ("renewable", "non-renewable energy"),
    ("mass", "weight"), ("an atom", "a molecule"), ("a list", "a tuple in Python"),
)  # fmt: skip
EVENTS = (
    "the French Revolution", "the First World War", "the fall of the Roman Empire", "the Industrial Revolution",
    "the Renaissance", "the printing press", "the Cold War", "the Silk Road", "the moon landing",
    "the invention of writing", "the abolition of slavery", "the rise of social media",
)  # fmt: skip
THINKERS = ("Socrates", "Confucius", "Kant", "Adam Smith", "Simone de Beauvoir", "Aristotle", "Nietzsche", "Buddha")
THEMES = ("happiness", "justice", "freedom", "friendship", "work", "education", "truth", "leadership")
WHATS = ("the names of people", "the places", "the numbers", "the main topics", "the questions asked", "the feelings")
NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Kemal", "Lena")

Fill = Callable[[random.Random, str, str], str]


def _writing(rng: random.Random, topic: str, text: str) -> str:
    return rng.choice(
        (
            f"Write a {rng.choice(FORMS)} about {topic}.",
            f"Compose a {rng.choice(TONES)} {rng.choice(FORMS)} for {rng.choice(AUDIENCES)} about {topic}.",
            f'Rewrite this to sound more {rng.choice(TONES)}: "{text}"',
            f'Fix the grammar and style of this text: "{text}"',
            f"Write a {rng.choice(FORMS)} that starts with the sentence: {text}",
            f"Give me a catchy title and an outline for a {rng.choice(FORMS)} about {topic}.",
        )
    )


def _roleplay(rng: random.Random, topic: str, text: str) -> str:
    role = rng.choice(ROLES)
    return rng.choice(
        (
            f"Pretend you are a {role}. Someone asks you about {topic}. What do you say?",
            f"Act as a {role} and give advice to someone who {rng.choice(SITUATIONS)}.",
            f"You are a {role}. Introduce yourself and describe a typical day.",
            f'Stay in character as a {role} and reply to this: "{text}"',
            f"Imagine you are a {role} giving a short talk about {topic}. Write the talk.",
        )
    )


def _reasoning(rng: random.Random, topic: str, text: str) -> str:
    a, b, c = rng.sample(NAMES, 3)
    n, m = rng.randint(2, 12), rng.randint(2, 12)
    start, step = rng.randint(1, 9), rng.randint(2, 5)
    return rng.choice(
        (
            f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
            f"A bag has {n} red and {m} blue marbles. If I pick one at random, what is the chance it is blue?",
            f"What comes next in the sequence {', '.join(str(start * step**i) for i in range(4))}? Why?",
            f"{a} is older than {b}. {c} is younger than {b}. Is {a} older than {c}? Think step by step.",
            f"If all {topic} lovers are happy and {a} loves {topic}, what can we conclude? Is the argument valid?",
            f"{a} has {n} apples and gives {min(n, m)} to {b}, who then eats one. How many apples does each have?",
            f"A clock shows {n} o'clock. What angle do the hour and minute hands make?",
        )
    )


def _math(rng: random.Random, topic: str, text: str) -> str:
    a, b, c = rng.randint(2, 19), rng.randint(1, 40), rng.randint(20, 200)
    return rng.choice(
        (
            f"Solve for x: {a}x + {b} = {c}. Show your steps.",
            f"What is {a * 7} times {b + 3}? Show the calculation.",
            f"Find the area and the perimeter of a rectangle with sides {a} cm and {b} cm.",
            f"A train travels {c} km in {a} hours. What is its average speed?",
            f"What is the derivative of {a}x^3 + {b}x^2 - {c}x?",
            f"Compute the sum of the integers from 1 to {c}.",
            f"Is {c + a} a prime number? Explain.",
            f"A shirt costs ${c} and is {a * 5}% off. What is the sale price?",
            f"Solve the system: x + y = {b + c}, x - y = {c - b}.",
            f"What is the probability of rolling a total of {min(a, 12)} with two dice?",
        )
    )


def _coding(rng: random.Random, topic: str, text: str) -> str:
    task, language = rng.choice(TASKS), rng.choice(LANGUAGES)
    return rng.choice(
        (
            f"Write a {language} function that {task}.",
            f"Write a {language} function that {task}, with a short explanation and an example.",
            f"How would you write a program that {task}? Use {language}.",
            f"Explain the time complexity of a function that {task}, and write it in {language}.",
            f"Write unit tests for a function that {task}.",
            "Write a SQL query that finds the five customers with the most orders in a table orders(customer_id, id).",
        )
    )


def _extraction(rng: random.Random, topic: str, text: str) -> str:
    return rng.choice(
        (
            f'Extract {rng.choice(WHATS)} from this text: "{text}"',
            f'Summarize this in one sentence: "{text}"',
            f'Is the sentiment of this text positive, negative or neutral? "{text}"',
            f'Return this as JSON with the keys "topic" and "mood": "{text}"',
            f'List the keywords of this text, separated by commas: "{text}"',
        )
    )


def _stem(rng: random.Random, topic: str, text: str) -> str:
    subject = rng.choice(STEM)
    x, y = rng.choice(PAIRS)
    return rng.choice(
        (
            f"Explain how {subject} works.",
            f"Explain {subject} to a ten-year-old.",
            f"What is the difference between {x} and {y}?",
            f"What are common misconceptions about {subject}?",
            f"Describe an experiment that shows {subject}.",
            f"Why is {subject} important in everyday life?",
        )
    )


def _humanities(rng: random.Random, topic: str, text: str) -> str:
    return rng.choice(
        (
            f"Discuss the main causes and effects of {rng.choice(EVENTS)}.",
            f"What can we learn from {rng.choice(THINKERS)}'s ideas about {rng.choice(THEMES)}?",
            f"Compare how two cultures think about {topic}.",
            f"Write an essay outline on the role of {topic} in society.",
            f"How did {rng.choice(EVENTS)} change everyday life?",
            f"Give arguments for and against this statement: {topic} makes people happier.",
        )
    )


KINDS: dict[str, Fill] = {
    "writing": _writing,
    "roleplay": _roleplay,
    "reasoning": _reasoning,
    "math": _math,
    "coding": _coding,
    "extraction": _extraction,
    "stem": _stem,
    "humanities": _humanities,
}


def instruction_prompt(index: int, rng: random.Random, topic: str, text: str) -> str:
    """The ``index``-th instruction: the kinds in turn, a template of that kind filled with ``rng``."""
    fill = list(KINDS.values())[index % len(KINDS)]
    return fill(rng, topic, text)
