"""An example reward module for env=dataset, kept outside the slurmrl packages (put its directory
on PYTHONPATH):

    PYTHONPATH=docs/examples/byot slurmrl env=dataset env.path=$PWD/docs/examples/byot/train.jsonl \
        env.prompt_key=question env.reward_fn=my_rewards:REWARDS ...

A reward is ``(prompt, completion, sample) -> float``; ``sample`` is the record (plus ``answer``,
the env.answer_key field). A dict of them is summed, and each one is logged as reward/<name>.
"""


def correct(prompt: str, completion: str, sample: dict) -> float:
    """1 for the exact sum."""
    return float(completion.strip() == str(sample["answer"]))


def digits_only(prompt: str, completion: str, sample: dict) -> float:
    """A small bonus for answering with digits only (the format), even when wrong."""
    text = completion.strip()
    return 0.1 if text.isdigit() and len(text) <= 2 else 0.0


REWARDS = {"correct": correct, "format": digits_only}
