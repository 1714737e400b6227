"""reasoning-gym datasets as tasks (unit tier, no server): the reward of a completion equals the dataset's own
``score_answer`` on the answer extracted by hand (the last ``<answer>`` tag, or the last line), for three datasets;
prompts carry the question and the system prompt; the held-out split shares no question with the training split,
although reasoning-gym's nearby seeds share entries (the reason it exists)."""

from __future__ import annotations

import importlib.util

import pytest

from llmrl.engine.envs import EvalTask, ReasoningGymTask

pytestmark = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="needs the envs extra")

DATASETS = {"basic_arithmetic": {"min_digits": 1, "max_digits": 2}, "leg_counting": {"max_animals": 3},
            "count_bits": {"max_n": 1000}}


def completions_for(answer: str) -> list[tuple[str, str | None]]:
    """Completions, each with the answer a reader takes from it by the tag convention (by hand)."""
    return [(f"Let me think.\n<answer>{answer}</answer>", answer),
            (f"<answer>0</answer> no, wait: <answer> {answer} </answer>", answer),  # the last tag counts
            (f"<answer>{answer}7</answer>", f"{answer}7"),  # wrong, but contains the answer: partial credit
            (f"The answer is {answer}.", None),  # no tag: no answer
            ("<answer></answer>", "")]


@pytest.fixture(scope="module")
def reasoning_gym():
    """The package itself, the reference (imported here, not when the suite is collected: a second of imports)."""
    import reasoning_gym

    return reasoning_gym


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_the_reward_is_the_datasets_score_of_the_tagged_answer(name, reasoning_gym):
    task = ReasoningGymTask(name, size=6, seed=3, dataset_args=DATASETS[name])
    reference = reasoning_gym.create_dataset(name, size=6, seed=3, **DATASETS[name])
    assert isinstance(task, EvalTask) and len(task.prompts()) == 6
    scores = []
    for index in range(6):
        entry = reference[index]
        assert task.answers()[index] == entry["answer"]
        for completion, extracted in completions_for(entry["answer"]):
            expected = reference.score_answer(extracted, entry)
            assert task.reward(index, completion) == expected, (completion, extracted)
            scores.append(expected)
    assert 1.0 in scores and 0.0 in scores  # the cases reach both ends


def test_last_line_extraction_and_text_prompts(reasoning_gym):
    task = ReasoningGymTask("leg_counting", size=4, seed=0, answer_format="last_line", chat=False)
    reference = reasoning_gym.create_dataset("leg_counting", size=4, seed=0)
    for index, prompt in enumerate(task.prompts()):
        entry = reference[index]
        assert prompt.startswith(task.system_prompt) and entry["question"] in prompt and "last line" in prompt
        assert task.reward(index, f"Counting...\n{entry['answer']}\n\n") == 1.0
        assert task.reward(index, f"{entry['answer']}\nI am not sure") == reference.score_answer("I am not sure",
                                                                                                 entry)


def test_last_number_extraction_reads_a_sentence(reasoning_gym):
    task = ReasoningGymTask("basic_arithmetic", size=3, seed=2, answer_format="last_number",
                            dataset_args={"max_digits": 1, "max_terms": 2})
    reference = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=2, max_digits=1, max_terms=2)
    for index in range(3):
        entry = reference[index]
        assert task.reward(index, f"First 1 + 2 = 3, then the result is {entry['answer']}.") == 1.0
        assert task.reward(index, f"The result is {entry['answer']}, or 123456.") == reference.score_answer(
            "123456", entry)
        assert task.reward(index, "I cannot tell.") == reference.score_answer(None, entry)
    assert "last line" in task.prompts()[0][0]["content"]


def test_chat_prompts_hold_the_system_prompt_and_the_question(reasoning_gym):
    task = ReasoningGymTask("count_bits", size=2, seed=5, system_prompt="Be brief. Use <answer> tags.")
    reference = reasoning_gym.create_dataset("count_bits", size=2, seed=5)
    assert task.prompts()[1] == [{"role": "system", "content": "Be brief. Use <answer> tags."},
                                 {"role": "user", "content": reference[1]["question"]}]
    assert ReasoningGymTask("count_bits", size=1, seed=5, system_prompt=None).prompts()[0] == [
        {"role": "user", "content": reference[0]["question"]}]


def test_the_held_out_split_shares_no_question_with_the_training_split(reasoning_gym):
    train = ReasoningGymTask("basic_arithmetic", size=30, seed=0, dataset_args={"max_digits": 1, "max_terms": 2})
    # the pitfall: seed 1's first entries are seed 0's next ones
    shifted = reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=1, max_digits=1, max_terms=2)
    assert shifted[0]["question"] == train.entries[1]["question"]
    test = train.held_out(size=20)
    questions = {entry["question"] for entry in train.entries}
    assert len(test) == 20 and not questions & {entry["question"] for entry in test.entries}
    assert test.seed >= train.seed + len(train)
    same_seed = train.held_out(size=10, seed=0)  # even from the training seed itself: its questions are skipped
    assert not questions & {entry["question"] for entry in same_seed.entries}


def test_bad_settings_are_refused_with_their_name():
    with pytest.raises(ValueError, match="answer_format"):
        ReasoningGymTask("leg_counting", size=2, answer_format="first_word")
    with pytest.raises(ValueError, match="size"):
        ReasoningGymTask("leg_counting", size=0)
