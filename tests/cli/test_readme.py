"""The README's example prompts are ones the bundled model answers: every task prompt the README sends
to `reference` (`--prompt "add 12 + 34"`, the curl body's `"prompt"`) is answered correctly, greedily,
by the full model and by the bundled 50% plan's decode pool."""
import re
from pathlib import Path

from moetailor.data.tasks.base import extract_answer
from moetailor.plans import Plan
from moetailor.serving import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "src" / "moetailor" / "assets" / "plans" / "reference-reap-50.json"


def readme_task_prompts() -> dict[str, str]:
    """prompt -> the answer it asks for, for the README's prompts shaped as a task's (add, sort, reverse)."""
    text = (ROOT / "README.md").read_text()
    prompts = set(re.findall(r'--prompt "([^"]+)"', text)) | set(re.findall(r'"prompt": "([^"]+)"', text))
    asks = {}
    for prompt in prompts:
        words = prompt.split()
        if re.fullmatch(r"add (\d+) \+ (\d+)", prompt):
            asks[prompt] = str(int(words[1]) + int(words[3]))
        elif re.fullmatch(r"sort( \d+)+", prompt):
            asks[prompt] = " ".join(map(str, sorted(map(int, words[1:]))))
        elif re.fullmatch(r"reverse( \S)+", prompt):
            asks[prompt] = " ".join(reversed(words[1:]))
    return asks


def test_the_readme_asks_the_bundled_model_what_it_answers():
    asks = readme_task_prompts()
    assert asks, "the README sends the bundled model no task prompt any more: update this test"
    llm = LLM("reference")
    for plan in (None, Plan.load(PLAN).phase_aware()):
        llm.set_plan(plan)
        outputs = llm.generate(list(asks), SamplingParams(max_tokens=160, temperature=0.0))
        for (prompt, answer), out in zip(asks.items(), outputs):
            assert extract_answer(out.text) == answer, (prompt, out.text)
