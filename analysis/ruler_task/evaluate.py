"""One RULER task at one length through lm-evaluation-harness, on a transformers model under any position scheme.

`posfreq ruler` (scripts/commands/ruler.py) keys each result by this module's import closure: the code here decides
scores; the command line, the keys and the tables live there.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

TASK_DIR = Path(__file__).resolve().parent
LIBRARY_LOGGERS = ("lm_eval", "lm-eval", "transformers", "datasets", "accelerate")
"""Loggers whose notices go to the run's log file, not the terminal."""


@contextlib.contextmanager
def into_log(path: Path) -> Iterator[None]:
    """Everything the libraries say meanwhile (their loggers, prints and progress bars) appended to `path`, a file
    the output folder records, instead of the terminal; restored afterwards, also on an error."""
    from posfreq.train.journal import open_recorded

    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    saved = [(logger, logger.handlers[:], logger.propagate) for logger in loggers]
    with open_recorded(path, "a") as sink:
        handler = logging.StreamHandler(sink)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        for logger in loggers:
            logger.handlers, logger.propagate = [handler], False
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield
        finally:
            for logger, handlers, propagate in saved:
                logger.handlers, logger.propagate = handlers, propagate


class RulerError(ValueError):
    """A setting or input the command cannot run with; the message names it and the fix."""


class Evaluator:
    """The model, loaded on first use (a rerun whose parts are all done loads nothing), and one lm-eval call per
    (task, length)."""

    def __init__(
        self, path: Path, tokenizer, args, options: dict, device, dtype, longest: int, log: Path
    ) -> None:
        self.path, self.tokenizer, self.args, self.options = path, tokenizer, args, options
        self.device, self.dtype, self.longest, self.log = device, dtype, longest, log
        self.lm = None

    def load(self) -> None:
        from lm_eval.models.huggingface import HFLM

        from posfreq.train.model.hf_folder import ModelFolderError
        from posfreq.train.model.transformer import finite
        from posfreq.train.positions.hf_schemes import load_causal_lm

        args = self.args
        try:
            model = load_causal_lm(
                self.path, args.positions, args.train_len, self.dtype, **self.options
            ).to(self.device)
        except ModelFolderError as err:  # a damaged file of the folder, named with its fix
            raise RulerError(str(err)) from None
        except Exception as err:  # transformers' and safetensors' errors share no base class
            raise RulerError(
                f"--model {self.path}: transformers could not load it ({type(err).__name__}: {err}). "
                "Fix: check that AutoModelForCausalLM.from_pretrained(DIR) loads it"
            ) from err
        # lm-eval argmaxes and scores whatever the head returns: a NaN or infinite logit stops the command instead
        model.get_output_embeddings().register_forward_hook(
            lambda module, inputs, logits: finite(logits, "the model's output head")
        )
        # RULER sizes each prompt to its length; a chat template adds its own tokens, which lm-eval would cut
        # from the prompt's start (the instructions) at max_length: leave it room instead.
        self.lm = HFLM(
            pretrained=model,
            tokenizer=self.tokenizer,
            batch_size=args.batch_size,
            max_length=2 * self.longest,
        )

    def evaluate(self, task: str, length: int) -> dict:
        """One task at one length: its per-sample scores, lm-eval's results and (if asked) its samples; what the
        libraries print goes to the log file."""
        with into_log(self.log):
            return self._evaluate(task, length)

    def _evaluate(self, task: str, length: int) -> dict:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        if self.lm is None:
            self.load()
        name = f"posfreq_ruler_{task}"
        manager = TaskManager(
            include_path=str(TASK_DIR),
            include_defaults=False,  # indexing lm-eval's thousands of task files took ~20 s per call
            metadata={
                "tokenizer": str(self.path),
                "max_seq_lengths": [length],
                "num_samples": self.args.samples,
            },
        )
        try:
            evaluation = simple_evaluate(
                model=self.lm,
                tasks=[name],
                task_manager=manager,
                apply_chat_template=self.args.chat_template,
                log_samples=True,
                bootstrap_iters=0,
            )
        except FloatingPointError as err:
            raise RulerError(
                f"{self.path}: {err} in task {task} at length {length}: its scores would be numbers made of NaN. "
                "Fix: run with --dtype float32, or check the model's weights"
            ) from None
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
