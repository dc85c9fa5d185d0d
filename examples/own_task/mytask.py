"""A task of your own for ``lowprec run``: a tiny sequence classifier on generated data, with dict batches.

Each example is 16 tokens from a vocabulary of 32; its label says whether more than half of the tokens are in
the upper half of the vocabulary.  The model (embedding, mean over the sequence, two Linear layers ending in
``head``) takes ``input_ids`` and, like a Hugging Face model, returns its loss when the batch has ``labels``.

Everything is a pure function of the seed: the model is initialised inside ``zoo.seeded(seed)``, the training
batch of step ``s`` comes from a generator seeded with ``(seed, "train", s)``, and the held-out batches from a
fixed generator that does not depend on the seed, so every seed is judged on the same examples.

Run it with ``lowprec run examples/own_task/run.toml`` from any folder: the config's folder is where
``model = "mytask:make"`` is looked for.
"""

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.runs import zoo

VOCAB, LENGTH = 32, 16


def examples(g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` examples drawn from ``g``: ``input_ids`` [n, LENGTH] int64 and ``labels`` [n] int64 (0 or 1)."""
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = ((ids >= VOCAB // 2).sum(1) > LENGTH // 2).long()
    return {"input_ids": ids, "labels": labels}


class Classifier(nn.Module):
    """``input_ids`` [B, T] -> logits [B, 2]; with ``labels`` also the mean cross-entropy as ``loss``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 2)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(F.relu(self.fc(self.embed(input_ids).mean(1))))  # [B, hidden] -> [B, 2]
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


@zoo.task
def make(*, seed: int, batch_size: int | None = None, hidden: int = 32) -> zoo.Task:
    """The task for ``seed``; ``hidden`` comes from the config's ``[model_options]``."""
    batch_size = batch_size or 32
    with zoo.seeded(seed):
        model = Classifier(hidden)
    held_out = [examples(zoo.generator("mytask/eval", i), 256) for i in range(2)]

    @zoo.restoring_mode  # eval mode and no_grad inside, training mode restored after
    def evaluate(m: nn.Module) -> dict[str, float]:
        device = zoo.model_device(m)
        loss = correct = 0.0
        for batch in held_out:
            out = m(**zoo.to_device(batch, device))
            loss += float(out["loss"]) / len(held_out)
            correct += float((out["logits"].argmax(-1) == batch["labels"].to(device)).double().mean()) / len(held_out)
        return {"loss": loss, "accuracy": correct}

    return zoo.Task(
        model=model,
        train_batch=lambda step: examples(zoo.generator(seed, "mytask/train", zoo.check_step(step)), batch_size),
        eval_batches=held_out,
        evaluate=evaluate,
        metrics={"loss": "min", "accuracy": "max"},
        data_source=f"generated: {VOCAB}-token sequences of {LENGTH}, label = more than half in the upper half",
        defaults={"steps": 200, "lr": 3e-3, "optimizer": "adamw", "eval_interval": 50, "warmup_steps": 10},
    )
