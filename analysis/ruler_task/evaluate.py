"""One RULER task at one length through lm-evaluation-harness, on a transformers model with rope or STRING.

`posfreq ruler` (scripts/commands/ruler.py) keys each result by this module's import closure: the code here decides
scores; the command line, the keys and the tables live there.
"""

from __future__ import annotations

from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent


class RulerError(ValueError):
    """A setting or input the command cannot run with; the message names it and the fix."""


class Evaluator:
    """The model, loaded on first use (a rerun whose parts are all done loads nothing), and one lm-eval call per
    (task, length)."""

    def __init__(
        self, path: Path, tokenizer, args, options: dict, device, dtype, longest: int
    ) -> None:
        self.path, self.tokenizer, self.args, self.options = path, tokenizer, args, options
        self.device, self.dtype, self.longest = device, dtype, longest
        self.lm = None

    def load(self) -> None:
        from lm_eval.models.huggingface import HFLM

        from posfreq.train.positions.hf_schemes import load_causal_lm

        args = self.args
        try:
            model = load_causal_lm(
                self.path, args.positions, args.train_len, self.dtype, **self.options
            ).to(self.device)
        except Exception as err:  # transformers' and safetensors' errors share no base class
            raise RulerError(
                f"--model {self.path}: transformers could not load it ({type(err).__name__}: {err}). "
                "Fix: check that AutoModelForCausalLM.from_pretrained(DIR) loads it"
            ) from err
        # RULER sizes each prompt to its length; a chat template adds its own tokens, which lm-eval would cut
        # from the prompt's start (the instructions) at max_length: leave it room instead.
        self.lm = HFLM(
            pretrained=model,
            tokenizer=self.tokenizer,
            batch_size=args.batch_size,
            max_length=2 * self.longest,
        )

    def evaluate(self, task: str, length: int) -> dict:
        """One task at one length: its per-sample scores, lm-eval's results and (if asked) its samples."""
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        if self.lm is None:
            self.load()
        name = f"posfreq_ruler_{task}"
        manager = TaskManager(
            include_path=str(TASK_DIR),
            metadata={
                "tokenizer": str(self.path),
                "max_seq_lengths": [length],
                "num_samples": self.args.samples,
            },
        )
        evaluation = simple_evaluate(
            model=self.lm,
            tasks=[name],
            task_manager=manager,
            apply_chat_template=self.args.chat_template,
            log_samples=True,
            bootstrap_iters=0,
        )
        logged = evaluation["samples"][name]
        scores = [entry[str(length)] for entry in logged if entry["doc"]["max_length"] == length]
        if not scores:
            raise RulerError(f"{task} at {length}: lm-eval returned no samples")
        return {
            "task": task,
            "length": length,
            "scores": scores,
            "results": evaluation["results"][name],
            "version": (evaluation.get("versions") or {}).get(name),
            "samples": logged if self.args.log_samples else None,
        }
