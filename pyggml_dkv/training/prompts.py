"""The prompts a drafter is trained and measured on, written for this project (no external data).

Training prompts are instruction templates crossed with subjects (`training_prompts`): explain,
describe, list, story, poem, how-to, history, ... Held-out prompts (`HELD_OUT_PROMPTS`) are
written one by one and are of other kinds than any training template: comparisons, advice
letters, dialogues, arithmetic word problems, recipes, product copy, code reviews, summaries of
a given text, role play. Nothing from the held-out list is ever a training prompt.
"""

from __future__ import annotations

import random

SUBJECTS = (
    "volcanoes", "the moon", "honey bees", "the printing press", "black holes", "photosynthesis",
    "the Roman Empire", "rainbows", "electric cars", "the human heart", "penguins", "the internet",
    "earthquakes", "chess", "coffee", "the Great Wall of China", "solar panels", "octopuses",
    "the water cycle", "jazz music", "glaciers", "vaccines", "the Eiffel Tower", "bicycles",
    "deserts", "the immune system", "dinosaurs", "recycling", "the Amazon rainforest", "clouds",
    "trains", "the Olympic Games", "bread baking", "lighthouses", "the piano", "tides",
    "wolves", "the alphabet", "comets", "gardening", "coral reefs", "the telephone", "sleep",
    "mountains", "paper", "elephants", "wind turbines", "the pyramids of Egypt", "magnets",
    "tea", "butterflies", "the stock market", "hurricanes", "libraries", "DNA", "castles",
    "airplanes", "the ocean", "friendship", "snow", "robots", "cheese", "the Sahara",
    "spiders", "the periodic table", "birds migrating", "the violin", "forests", "money",
    "submarines", "the brain", "lightning", "soap", "kangaroos", "maps", "rivers", "clocks",
    "the solar system", "owls", "chocolate", "the French Revolution", "glass", "whales",
    "satellites", "bridges", "autumn leaves", "microscopes", "ants", "the wheel", "rain",
    "cats", "dogs", "the Renaissance", "batteries", "origami", "salt", "the Arctic",
    "hot air balloons", "fireflies", "plastic", "Mars", "yoga", "computers", "the compass",
    "sharks", "tomatoes", "the Silk Road", "languages", "bees and flowers", "pizza",
    "the Moon landing", "telescopes", "sand", "horses", "music festivals", "vitamins",
    "earthworms", "skyscrapers", "the seasons", "dolphins", "camping", "video games",
)

TEMPLATES = (
    "Explain {s} to a ten-year-old.",
    "What is {s}? Answer in a short paragraph.",
    "Write a short story about {s}.",
    "Write a poem about {s}.",
    "List five interesting facts about {s}.",
    "Describe {s} in detail.",
    "Give me a brief history of {s}.",
    "Why is {s} important?",
    "Write a short essay about {s}.",
    "Tell me something surprising about {s}.",
    "How does {s} work?",
    "Write a haiku about {s}, then explain it.",
    "Summarize what scientists know about {s}.",
    "Write the opening paragraph of a novel that involves {s}.",
    "What would the world be like without {s}?",
    "Teach me the basics of {s} in three steps.",
)

# Other kinds than the training templates, each written out by hand.
HELD_OUT_PROMPTS = (
    "Compare cats and dogs as pets for a small apartment.",
    "What are the pros and cons of working from home?",
    "Write a polite email to my landlord asking to fix a leaking tap.",
    "I have 3 apples and buy 7 more, then give away 4. How many apples do I have?",
    "Give me a simple recipe for pancakes.",
    "Write a product description for a waterproof hiking backpack.",
    "Write a dialogue between a teacher and a student about homework.",
    "Summarize this text: The city council met on Monday to discuss the new park. Residents asked "
    "for more trees and a playground. The council agreed to plan both and to report back in May.",
    "Pretend you are a pirate and greet me.",
    "What should I pack for a weekend trip to the beach?",
    "Review this code: def add(a, b): return a - b",
    "Write a Python function that returns the largest number in a list.",
    "How do I say thank you in Spanish, French and German?",
    "Give me three tips for a job interview.",
    "Write a limerick about a forgetful wizard.",
    "What is the difference between weather and climate?",
    "Plan a one-day itinerary for a visit to Paris.",
    "Convert 5 kilometers to miles and show your work.",
    "Write a birthday message for my grandmother.",
    "What questions should I ask before adopting a dog?",
    "Rewrite this sentence to sound more formal: hey, can u send me the report asap?",
    "Explain the rules of tic-tac-toe.",
    "Write a short motivational speech for a football team at half time.",
    "If a train travels 60 miles per hour for 2.5 hours, how far does it go?",
    "Write a thank-you note to a colleague who helped me move house.",
    "Give me a weekly workout plan for a beginner.",
    "What are some good habits for studying?",
    "Create a grocery list for a vegetarian dinner party of six.",
    "Write a news headline and a two-sentence summary about a new public library opening.",
    "Describe your ideal weekend as if you were a cat.",
    "What is 15 percent of 240?",
    "Write a short apology to a friend for missing their party.",
    "Suggest five names for a coffee shop and explain each.",
    "Explain how to change a flat tire on a bicycle.",
    "Write a job advertisement for a part-time baker.",
    "Debate with yourself: should homework be banned?",
    "Write SQL to select all customers from the city of Berlin.",
    "What are the main causes of stress and how can I reduce it?",
    "Tell me a joke about computers, then explain why it is funny.",
    "Write instructions for making a paper airplane.",
)


# The first words of a user request (gpu runs: the target writes the rest itself, selfgen.py).
REQUEST_OPENERS = (
    "Write", "Explain", "What", "How", "Give me", "Can you", "Describe", "List", "Tell me", "Why",
    "Create", "Compare", "Help me", "I need", "Summarize", "Plan", "Is it", "Which", "Who", "When",
    "Where", "Please", "Make", "Suggest", "Show me", "Calculate", "Find", "Should I", "I want to",
    "Generate",
)


def training_prompts(seed: int = 0) -> list[str]:
    """Every template crossed with every subject, shuffled with `seed` (1,952 prompts)."""
    prompts = [t.format(s=s) for s in SUBJECTS for t in TEMPLATES]
    random.Random(seed).shuffle(prompts)
    return prompts
