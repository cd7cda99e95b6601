"""Print one trajectory as the trainer sees it: the text of each run of tokens and its mask.

The trajectory is a cold-start dialogue of the demo's arithmetic task (``retool/tasks.py``;
its tool message is the real output of the sandbox), laid out in tokens by the same
renderer and code the rollout uses (:func:`retool.dialogues.dialogue_tokens`) with the bundled
SmolLM2 tokenizer and the Hermes chat template. Mask 1 marks the tokens the policy writes
(trained, with the trajectory's advantage); mask 0 the prompt, the template's glue and
the interpreter's answer (in the context, never trained).

    .venv/bin/python examples/show_trajectory.py [--seed 3] [--show-system]

Not covered: a trajectory sampled from a model (``retool view RUN_DIR`` renders those,
with the same mask, as HTML).
"""

from __future__ import annotations

import argparse
import itertools
import sys

from transformers import AutoTokenizer

from retool.bundled import smollm2_path
from retool.render import Renderer
from retool.sandbox import Sandbox, SandboxConfig
from retool.dialogues import AssistantFormatter, dialogue_tokens, parse_dialogue
from retool.tasks import make_sft_conversations


def runs_of_mask(tokens_T: tuple[int, ...], mask_T: tuple[int, ...], tokenizer) -> list[tuple[int, str]]:
    """Consecutive tokens with the same mask, decoded: ``[(mask, text), ...]``."""
    pairs = list(zip(tokens_T, mask_T))
    return [(mask, tokenizer.decode([t for t, _ in run]))
            for mask, run in ((m, list(r)) for m, r in itertools.groupby(pairs, key=lambda p: p[1]))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=3, help="which dialogue of the task to draw")
    parser.add_argument("--show-system", action="store_true", help="print the system prompt instead of eliding it")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    renderer = Renderer(tokenizer, chat_template="hermes", tools=True, model_name="bundled:smollm2")
    with Sandbox(SandboxConfig(workers=1)) as sandbox:
        row = make_sft_conversations(1, seed=args.seed, sandbox=sandbox)[0]
    dialogue = parse_dialogue(row)
    seq = dialogue_tokens(dialogue, renderer, AssistantFormatter(renderer))
    system_len = len(renderer.encode(renderer.render(dialogue.prompt_messages()[:1], add_generation_prompt=False)))
    print(f"# {len(seq.tokens_T)} tokens, {sum(seq.mask_T)} with mask 1; gold answer {row['answer']}")
    for mask, text in runs_of_mask(seq.tokens_T[system_len:], seq.mask_T[system_len:], tokenizer):
        shown = text.rstrip("\n") if text.strip() else f"(only whitespace: {text!r})"
        print(f"--- mask {mask} ---")
        print(shown)
    if not args.show_system:
        print(f"(the first {system_len} tokens, mask 0 — the system prompt with the tool's declaration — "
              "left out; --show-system prints them)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
