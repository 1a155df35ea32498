"""Benchmark prompt suites, written out in full so runs are comparable across machines.

`seed10` is the reference benchmark protocol (the numbers to beat, benchmarks/RESULTS.md):
10 fixed requests, 5 Alpaca and 5 MMLU, sent one at a time in this order as a single
user message, temperature 0, 200 completion tokens. The texts are the reference
run's own prompts ("The ten prompts, in request order" of its reproduction record);
MMLU prompts carry the reference's instruction line, question and options.
"""

from __future__ import annotations

from dataclasses import dataclass

MC_INSTRUCTION = "Answer the multiple-choice question. Select the correct option and briefly explain your answer."


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark request: its sample id, dataset ("Alpaca" or "MMLU") and full prompt text."""

    sample_id: str
    dataset: str
    prompt: str


def _mc(question: str, *options: str) -> str:
    lines = [MC_INSTRUCTION, "", f"Question: {question}"]
    lines += [f"{letter}. {text}" for letter, text in zip("ABCD", options)]
    return "\n".join(lines)


SEED10: tuple[BenchPrompt, ...] = (
    BenchPrompt("alpaca-37246", "Alpaca", 'Summarize the movie "Toy Story"'),
    BenchPrompt("mmlu-abstract_algebra-14", "MMLU", _mc(
        "Find the maximum possible order for an element of S_n for n = 10.", "6", "12", "30", "105")),
    BenchPrompt("alpaca-50812", "Alpaca",
                "Given a list of items, suggest an interesting activity.\n\nInput: pencils, paper, markers"),
    BenchPrompt("mmlu-moral_disputes-8315", "MMLU", _mc(
        'According to Hardin, the "ratchet effect" refers to the fact that',
        "overpopulation does not affect the number of people who are poor.",
        "overpopulation leads to creation of food banks that help curb poverty rates.",
        "world hunger and poverty leads to recognition of rights not to be hungry.",
        "the use of a world food bank to feed the hungry leads to an escalating series of emergency situations.")),
    BenchPrompt("alpaca-9907", "Alpaca", "Translate this phrase from Spanish to English: El sol no brilla hoy."),
    BenchPrompt("mmlu-high_school_macroeconomics-3940", "MMLU", _mc(
        "The crowding-out effect from government borrowing is best described as",
        "the rightward shift in AD in response to the decreasing interest rates from contractionary fiscal policy.",
        "the leftward shift in AD in response to the rising interest rates from expansionary fiscal policy.",
        "the effect of the President increasing the money supply which decreases real interest rates and "
        "increases AD.",
        "the effect on the economy of hearing the chairperson of the central bank say that he or she believes "
        "that the economy is in a recession.")),
    BenchPrompt("alpaca-40699", "Alpaca", "Give an example of a bias that could exist in an AI algorithm."),
    BenchPrompt("mmlu-professional_law-10971", "MMLU", _mc(
        "Homeowner owns a property in its natural condition with a house on it. There was no fill of any kind on "
        "the property. Neighbor, who owns the adjacent property to the East, built a driveway whose western "
        "boundary is along the border of homeowner's property. The excavator dug the driveway five feet deep. "
        "The land began to subside along the line of excavation and about three feet of homeowner's land fell "
        "off into the driveway, making that part of her property useless. Homeowner demanded that neighbor fill "
        "in the property to buttress the erosion created. That was not done and the erosion continued to occur. "
        "Homeowner sued and asked for an injunction compelling the neighbor to build and maintain a retaining "
        "wall. Will the court rule for the plaintiff/homeowner?",
        "Yes, because excavation is an abnormally dangerous activity and neighbor is absolutely liable for any "
        "damages caused by the violation.",
        "Yes, because every landowner has a right to the lateral support of the soil in its natural state.",
        "No, because the neighbor did not go onto the adjacent land and confined all excavation to his own land.",
        "No, the right to lateral support is a common law right that has been abrogated by statute in virtually "
        "all states so that the right no longer exists.")),
    BenchPrompt("alpaca-34440", "Alpaca",
                "Make a menu item for a restaurant that contains the following ingredients.\n\n"
                "Input: Salmon, avocado, spinach"),
    BenchPrompt("mmlu-jurisprudence-6660", "MMLU", _mc(
        "Which of the following is the strongest argument against ethical relativism's hostility to human rights?",
        "Utilitarianism", "Communitarianism.", "Cognitivism.", "Positivism.")),
)

#: Reference settings of the seed protocol.
SEED10_TEMPERATURE = 0.0
SEED10_MAX_TOKENS = 200

SUITES: dict[str, tuple[BenchPrompt, ...]] = {"seed10": SEED10}

#: The reference results (DeepSeek-V4-Flash, seed, RTX 5090), per dataset: (Alpaca, MMLU).
SEED10_REFERENCE = {
    "model": "DeepSeek-V4-Flash, seed",
    "prefill_tok_s": (2.532, 4.141),
    "decode_tok_s": (1.992, 1.846),
    "hit_rate": (0.542, 0.464),
    "ssd_gb_per_token": (1.66, 2.04),
}


def suite(name: str) -> tuple[BenchPrompt, ...]:
    """The prompts of suite `name`; ValueError listing the known suites otherwise."""
    try:
        return SUITES[name]
    except KeyError:
        raise ValueError(f"unknown benchmark suite {name!r}; available: {', '.join(SUITES)}") from None
