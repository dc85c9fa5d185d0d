"""Callbacks that record the runs of other frameworks' training loops in lowprec's run store.

* ``lowprec.integrations.transformers.LowprecCallback``: a Hugging Face ``transformers.TrainerCallback``
  (``pip install 'lowprec[transformers]'``);
* ``lowprec.integrations.lightning.LowprecCallback``: a PyTorch Lightning ``Callback``
  (``pip install 'lowprec[lightning]'``).

Each module imports its framework only when it is itself imported; ``import lowprec`` (and this package) imports
none of them.  The runs are written with ``lowprec.runs.track``, so ``lowprec baseline --from-runs`` and
``lowprec compare`` judge them like any other run (docs/own-loop.md).
"""

__all__: list[str] = []
