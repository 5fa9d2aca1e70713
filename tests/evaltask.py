"""A small lm-evaluation-harness task set, written to a folder for `--include_path`: no dataset hub.

  tinydet_mc       multiple choice: a story of 200-400 tokens, then which of 4 sentences comes next
                   (each choice scored with echo over the shared context, as HellaSwag or ARC are)
  tinydet_gen      greedy generation of a story's next sentence, until its period, scored by exact match
  tinydet_rolling  rolling log-likelihood of whole stories (perplexity, as WikiText)

The stories are drawn from a fixed bank of sentences by a seeded generator, so every run and every
machine gets the same documents.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna"]
SENTENCES = [
    "{n} woke up early and looked out of the window.",
    "The sun was warm and the sky was very blue.",
    "{n} put on a red hat and ran outside to play.",
    "In the garden there was a big tree with green leaves.",
    "A small bird sat on a branch and sang a happy song.",
    "{n} found a shiny stone near the pond.",
    "The stone was round and smooth, like a little egg.",
    "{n} showed the stone to Mom, who smiled and said it was pretty.",
    "Then a friendly dog came running across the grass.",
    "The dog wagged its tail and barked two times.",
    "{n} threw a ball and the dog chased it very fast.",
    "They played together until the clouds came.",
    "Soon it began to rain, and the drops made little puddles.",
    "{n} jumped in the puddles and laughed out loud.",
    "Mom called from the door and said it was time for lunch.",
    "They ate bread with honey and drank cold milk.",
    "After lunch {n} drew a picture of the dog and the tree.",
    "The picture had a yellow sun in the corner.",
    "In the evening the wind was soft and the air smelled of flowers.",
    "{n} sat on the step and watched the stars come out.",
    "A kind old man walked by with a bag of apples.",
    "He gave one apple to {n}, who said thank you.",
    "The apple was sweet and crunchy.",
    "{n} wanted to share it with a friend.",
    "Down the road there was a little shop that sold toys.",
    "In the window of the shop there was a blue kite.",
    "{n} wished to fly the kite on the hill one day.",
    "The next morning the sky was clear again.",
    "{n} and Dad climbed the hill with the new kite.",
    "The kite went up high and danced in the wind.",
]
ENDINGS = [
    "At night {n} went to bed and dreamed of the sky.",
    "The cat sat on the mat and slept all day.",
    "{n} said goodbye to the dog and went home.",
    "Everyone was happy, and the day ended with a big hug.",
    "The rain stopped and a rainbow filled the sky.",
    "{n} gave the stone to a friend as a gift.",
    "The bird flew away over the hill.",
    "Mom baked a cake and they ate it together.",
]


def _story(rng: random.Random, lo: int, hi: int) -> tuple[str, str, str]:
    """(a story of lo..hi sentences, its hero's name, the bank's next sentence)."""
    n = rng.choice(NAMES)
    k = rng.randint(lo, hi)
    pos, out = rng.randrange(len(SENTENCES)), []
    for _ in range(k):  # the bank in order from a random start, now and then a sentence left out
        out.append(SENTENCES[pos % len(SENTENCES)].format(n=n))
        pos += 1 + (rng.random() < 0.3)
    return " ".join(out), n, SENTENCES[pos % len(SENTENCES)].format(n=n)


def documents(n_mc: int = 12, n_gen: int = 6, n_rolling: int = 4, seed: int = 1, long: bool = True) -> dict:
    """{task: its documents}. `long`: multiple-choice contexts of 18-30 sentences (about 200-400 tokens
    for a GPT-2-style vocabulary); otherwise 6-10."""
    rng = random.Random(seed)
    lo, hi = (18, 30) if long else (6, 10)
    mc = []
    for _ in range(n_mc):
        context, name, following = _story(rng, lo, hi)
        choices = [e.format(n=name) for e in rng.sample(ENDINGS, 3)]
        label = rng.randrange(4)
        choices.insert(label, following)
        mc.append({"context": context, "choices": choices, "label": label})
    gen = []
    for _ in range(n_gen):
        context, name, following = _story(rng, 3, 5)
        gen.append({"prompt": context, "answer": " " + following[:-1]})
    rolling = [{"text": _story(rng, 8, 14)[0]} for _ in range(n_rolling)]
    return {"tinydet_mc": mc, "tinydet_gen": gen, "tinydet_rolling": rolling}


# What each task's YAML shares: its name and its JSON Lines file (@DATA@), read as a test split.
_HEAD = """task: @TASK@
dataset_path: json
dataset_kwargs:
  data_files: {test: @DATA@}
test_split: test
"""
_YAML = {
    "tinydet_mc": """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
""",
    "tinydet_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
generation_kwargs:
  until: ["."]
  max_gen_toks: 16
  do_sample: false
  temperature: 0.0
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true}
""",
    "tinydet_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
""",
}


def write(folder: Path, **kw) -> list[str]:
    """The task set's YAML and data files in `folder`; the task names."""
    folder.mkdir(parents=True, exist_ok=True)
    for task, docs in documents(**kw).items():
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        head = _HEAD.replace("@TASK@", task).replace("@DATA@", json.dumps(str(data)))
        (folder / f"{task}.yaml").write_text(head + _YAML[task], encoding="utf-8")
    return list(_YAML)


if __name__ == "__main__":  # python tests/evaltask.py DIR: the task set, for lm_eval --include_path DIR
    import sys

    print(" ".join(write(Path(sys.argv[1]))))
