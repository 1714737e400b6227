"""The prompts and continuation words the live RLHF updater tests (``ppo_tokens``, ``grpo``, ``dpo``, ``sft``...)
train on, and the LoRA initializer they use: one copy, so that their plain references read the same data."""

PROMPTS = ["Goal: go to the red ball", "You see a wall 2 steps forward.", "In the kitchen you see a fridge.",
           "pick up the key", "open the door"]
WORDS = [" go to the red ball", " the key", " open the door", " turn left", " a wall", " pick up", " fridge"]
LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
