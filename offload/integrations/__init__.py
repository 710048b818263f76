"""Offload inside the training loops users already have.

- :func:`offload.integrations.hf.offload_trainer`: HF ``transformers.Trainer`` and its subclasses,
  TRL's trainers included (``SFTTrainer``, ``DPOTrainer``, ...), in one line after the trainer
  is built. For TRL it takes the place of ``activation_offloading=True`` (TRL's copy of
  torchtune's offload context).

Integrations import the core (``offload.activations``, ``offload.layers.find``), never the
other way round, and import their framework only when called: ``import offload`` needs none of
them installed.
"""

from .hf import offload_trainer

__all__ = ["offload_trainer"]
